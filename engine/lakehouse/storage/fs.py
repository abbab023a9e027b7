"""Small files of the lakehouse (any store), and the session's JVM for the driver-side classes.

Example:
    >>> read_text("/lake/_checkpoints/stamp/metadata")  # doctest: +SKIP
    '{"id":"4c1b..."}'
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from engine.lakehouse.storage.location import store_for

if TYPE_CHECKING:  # (a `delayq` command through a running engine imports no Spark)
    from pyspark.sql import SparkSession


def jvm(spark: SparkSession) -> Any:
    """The session's JVM view (classic Spark; Spark Connect has none)."""
    view = spark.sparkContext._jvm
    assert view is not None, "the Spark session has no JVM (Spark Connect is not supported)"
    return view


def java_map(spark: SparkSession, values: dict[str, str]) -> Any:
    """A ``java.util.HashMap`` of ``values`` in the session's JVM (settings for the
    driver-side Kafka classes in ``build/jvm``)."""
    made = jvm(spark).java.util.HashMap()
    for key, value in values.items():
        made.put(key, value)
    return made


def read_text(location: str) -> str | None:
    """The whole text of a small file, or ``None`` when it does not exist.

    Example:
        >>> read_text("/nowhere/at/all") is None
        True
    """
    data = store_for(location).read(location)
    return None if data is None else data.decode("utf-8")


def list_files(folder: str, suffix: str = "") -> list[str]:
    """Names of the visible files in ``folder`` ending with ``suffix`` (any store).

    Example:
        >>> list_files("/nowhere/at/all")
        []
    """
    return [n for n in store_for(folder).names(folder) if n.endswith(suffix)]


def put_if_absent(location: str, data: bytes) -> bool:
    """Create the file ``location`` holding ``data``, unless it exists; whether it did.

    Atomic on every store (:meth:`engine.lakehouse.storage.store.Store.create`): of writers racing
    for one name exactly one creates it, and a reader sees the file whole or not at all.

    Example:
        >>> put_if_absent("/lake/_engine/lease/00000000000000000001.json", b"{}")
        ... # doctest: +SKIP
        True
    """
    return store_for(location).create(location, data)


def write_text(location: str, text: str) -> None:
    """Write a small file whole, replacing it (a reader sees the old text or the new).

    Example:
        >>> write_text("/lake/_engine/lease/00000000000000000001.beat.json", "{}")
        ... # doctest: +SKIP
    """
    store_for(location).write(location, text.encode("utf-8"))


def delete_file(location: str) -> None:
    """Delete a file; nothing when there is none.

    Example:
        >>> delete_file("/nowhere/at/all")
    """
    store_for(location).delete(location)


def stream_query_id(checkpoint: str) -> str:
    """The id of the streaming query that owns ``checkpoint`` (kept across restarts).

    A new checkpoint means a new id: batch ids start again from 0 there, so writes made
    idempotent per batch id name their ``txnAppId`` after this id, not after the query.
    """
    text = read_text(f"{checkpoint}/metadata")
    if text is None:
        raise FileNotFoundError(f"{checkpoint}/metadata: the query has not started")
    return str(json.loads(text.splitlines()[0])["id"])


def spark_next_batch(checkpoint: str) -> int:
    """The batch a streaming query runs first when it starts on ``checkpoint``: the one
    after its last committed batch (a batch planned and not committed runs again), 0 when
    none is.

    Example:
        >>> spark_next_batch("/nowhere/at/all")
        0
    """
    done = spark_batches(f"{checkpoint.rstrip('/')}/commits")
    return done[-1] + 1 if done else 0


def spark_batches(folder: str) -> list[int]:
    """The batch ids a streaming query's ``offsets`` or ``commits`` folder holds, in order.

    Example:
        >>> spark_batches("/nowhere/at/all")
        []
    """
    return sorted(int(name) for name in list_files(folder) if name.isdigit())


def spark_offset(checkpoint: str, batch: int) -> dict[str, Any] | None:
    """The offset a streaming query with one source planned for ``batch`` (the last line of
    its offsets log entry, written before the batch runs); ``None`` when there is none.

    Example:
        >>> spark_offset("/lake/_checkpoints/stamp-query", 7)  # doctest: +SKIP
        {'version': 12, 'index': 0}
    """
    lines = (read_text(f"{checkpoint}/offsets/{batch}") or "").splitlines()
    if len(lines) < 3:  # "v1", the batch's metadata, then one line per source
        return None
    found: dict[str, Any] = json.loads(lines[-1])
    return found
