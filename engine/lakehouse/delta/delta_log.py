"""The Delta log: one version probe, one idempotent append, typed conflicts.

Every stage that needs to know whether a table changed asks :class:`VersionTracker` (a file
probe of ``_delta_log/<v+1>.json``, no read); every write that must not repeat goes through
:func:`append` with a :class:`Txn` (Delta's ``txnAppId``/``txnVersion``: a write whose
version is not above the table's recorded one for that app id is skipped); a lost race
with another writer is recognised by Delta's typed exceptions (``delta.exceptions``, which
PySpark raises once that module is imported), never by the message text.

Example:
    >>> append(df, "/lake/command_results", txn=Txn("delayq-commands-9f", 42))  # doctest: +SKIP
    >>> VersionTracker("/lake/schedule").latest()  # doctest: +SKIP
    17
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from delta.exceptions import (
    ConcurrentAppendException,
    ConcurrentTransactionException,
    ConcurrentWriteException,
    DeltaConcurrentModificationException,
    MetadataChangedException,
    ProtocolChangedException,
)
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError
from pyspark.sql import DataFrame, SparkSession

from engine.core.config import EngineConfig
from engine.core.errors import SetupError
from engine.lakehouse.storage.layout import layout
from engine.lakehouse.storage.location import store_for


def is_txn_race(err: BaseException) -> bool:
    """Whether ``err`` says another writer committed the same ``txnAppId``/``txnVersion``
    at the same moment (Delta's ``ConcurrentTransactionException``).

    Example:
        >>> is_txn_race(ValueError("ConcurrentTransactionException"))
        False
    """
    return isinstance(err, ConcurrentTransactionException)


@dataclass(frozen=True)
class Txn:
    """Delta's idempotent-write pair: a write is skipped if ``version`` is not above the
    table's recorded version for ``app_id``. Each table is idempotent on its own.

    ``also``: more pairs the same commit records, not checked before writing (the Kafka
    ingest records the next offset of each partition it stored, so that it knows where to
    start again).

    Example:
        >>> Txn("delayq-kafka-in-0", 120, also=(Txn("delayq-kafka-in-1", 75),)).also[0].version
        75
    """

    app_id: str
    version: int
    also: tuple[Txn, ...] = ()

    def all(self) -> tuple[Txn, ...]:
        """This pair and the ``also`` ones, as recorded by a commit."""
        return (Txn(self.app_id, self.version), *self.also)

    def recorded_in(self, versions: Callable[[str], int | None]) -> bool:
        """Whether a table records every pair at its version or later (``versions``: the
        recorded version of an app id): the commit that carried them, or a later one, is in.

        Example:
            >>> Txn("a", 3, also=(Txn("b", 5),)).recorded_in({"a": 3, "b": 4}.get)
            False
        """
        for txn in self.all():
            found = versions(txn.app_id)
            if found is None or found < txn.version:
                return False
        return True


#: What Delta raises when another writer changed the table first and nothing was
#: committed (caught by type). A lost ``txnAppId`` race is not one: see :func:`is_txn_race`.
CONCURRENT_CHANGES = (
    ConcurrentAppendException,
    ConcurrentWriteException,
    DeltaConcurrentModificationException,
    MetadataChangedException,
    ProtocolChangedException,
)
#: Tries of an append that keeps losing races to other writers.
WRITE_ATTEMPTS = 5


def append(
    df: DataFrame,
    path: str,
    *,
    txn: Txn | None = None,
    metadata: str | None = None,
    max_records_per_file: int | None = None,
) -> None:
    """Append ``df`` to the Delta table at ``path`` in one commit.

    Args:
        df: the rows.
        path: the table.
        txn: make the append idempotent (``txnAppId``/``txnVersion``): Spark looks the pair
            up at every write and writes nothing when the table records the app id at this
            version or later. (:meth:`engine.lakehouse.delta.arrow_delta.ArrowDelta.append` records
            the pair but does not look it up first: see there.)
        metadata: the commit's ``userMetadata`` (shown by ``DESCRIBE HISTORY``).
        max_records_per_file: cut data files at this many rows.

    Example:
        >>> append(rows, lay.commitlog, txn=Txn("delayq-kafka-ingest-4c1b", 7))  # doctest: +SKIP
    """
    writer = df.write.format("delta").mode("append")
    if txn is not None:
        if txn.also:
            raise ValueError(f"{path}: Spark's writer records one txn, not {len(txn.all())}")
        writer = writer.option("txnAppId", txn.app_id).option("txnVersion", txn.version)
    if metadata is not None:
        writer = writer.option("userMetadata", metadata)
    if max_records_per_file:
        writer = writer.option("maxRecordsPerFile", max_records_per_file)
    for attempt in range(1, WRITE_ATTEMPTS + 1):
        try:
            writer.save(path)
            return
        except CONCURRENT_CHANGES:
            # Nothing was committed: another process changed the table first (it created or
            # upgraded it while this append was under way). The same append again is safe.
            if attempt == WRITE_ATTEMPTS:
                raise
            time.sleep(0.2 * attempt)


#: The table property that lets Delta drop ``txn`` records older than it (at a checkpoint).
TXN_RETENTION = "delta.setTransactionRetentionDuration"


def table_exists(path: str) -> bool:
    """Whether a Delta table has been made at ``path``: its log holds a commit or a
    checkpoint (a file probe, no read). The log folder alone is not enough: another process
    creating the table makes it a moment before its first commit.

    Example:
        >>> table_exists("/nowhere/at/all")
        False
    """
    store = store_for(path)
    log = f"{path.rstrip('/')}/_delta_log"
    if store.exists(f"{log}/_last_checkpoint") or store.exists(f"{log}/{0:020d}.json"):
        return True  # without listing a long log
    return any(name.endswith(".json") for name in store.names(log))


def latest_version(path: str) -> int:
    """The latest committed version of a Delta table, -1 when there is none (delta-rs reads
    the log in milliseconds; Spark's ``history`` took seconds in a fresh JVM).

    Example:
        >>> latest_version("/nowhere/at/all")
        -1
    """
    try:
        return int(store_for(path).delta_table(path).version())
    except TableNotFoundError:
        return -1


def table_id(spark: SparkSession, path: str) -> str:
    """A Delta table's id (a new table at the same path has a new one)."""
    row = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").select("id").first()
    return str(row[0]) if row else ""


def commit_exists(path: str, version: int) -> bool:
    """Whether the Delta table at ``path`` has a commit ``version`` (its ``_delta_log`` entry:
    one ``exists`` call, a millisecond on a local disk).

    Example:
        >>> commit_exists("/nonexistent/table", 0)
        False
    """
    return store_for(path).exists(f"{path.rstrip('/')}/_delta_log/{version:020d}.json")


class VersionTracker:
    """Follows the latest version of a Delta table cheaply.

    Asks Delta once (when first asked, or once the table exists), then looks for the next
    commit files (``_delta_log/<v+1>.json``): versions are consecutive, so a few ``exists``
    calls (about a millisecond each on a local disk) replace a history query.
    ``-1`` means the table does not exist yet.

    Example:
        >>> tracker = VersionTracker("/lake/topics/orders")  # doctest: +SKIP
        >>> tracker.latest()  # doctest: +SKIP
        3
    """

    def __init__(self, path: str) -> None:
        self.path = path.rstrip("/")
        self.version = -1  # not asked yet, or the table does not exist yet

    def latest(self) -> int:
        """The latest version now (-1 while the table does not exist)."""
        if self.version < 0:
            if not table_exists(self.path):  # not even its first commit yet
                return -1
            self.version = latest_version(self.path)
        while commit_exists(self.path, self.version + 1):
            self.version += 1
        return self.version


def check_txn_kept(path: str, configuration: Mapping[str, str]) -> None:
    """Refuse a table whose ``txn`` records may expire: delayq's writes skip a replay by the
    ``txn`` they recorded, and with ``delta.setTransactionRetentionDuration`` set, Delta (Spark
    and delta-rs) drops older ones at a checkpoint, so a replay after a longer stop would write
    its rows again. No finite value is safe: an engine may stay stopped any time.

    Raises:
        SetupError: naming the table, the property and how to unset it.

    Example:
        >>> check_txn_kept("/lake/topics/orders", {"delta.appendOnly": "true"})
        >>> check_txn_kept("/lake/schedule", {TXN_RETENTION: "interval 1 days"})
        Traceback (most recent call last):
        ...
        engine.core.errors.SetupError: /lake/schedule: table property delta.setTra...
    """
    value = configuration.get(TXN_RETENTION)
    if value is not None:
        raise SetupError(
            f"{path}: table property {TXN_RETENTION} = {value!r} lets Delta forget the txn "
            "records that keep replays from writing rows twice: unset it (ALTER TABLE "
            f"delta.`{path}` UNSET TBLPROPERTIES ('{TXN_RETENTION}'))"
        )


def check_tables_keep_txn(cfg: EngineConfig) -> None:
    """:func:`check_txn_kept` for every table the engine writes that exists (its own, the
    consumer log and the topic tables), reading only their metadata (not their files).

    Example:
        >>> check_tables_keep_txn(cfg)  # doctest: +SKIP
    """
    lay = layout(cfg)
    own = [lay.commitlog, lay.schedule, lay.quarantine, lay.commands, lay.command_results,
           lay.consumer_log]  # fmt: skip
    for path in [*own, *(lay.topic(name) for name in list_topics(cfg))]:
        if not table_exists(path):
            continue
        store = store_for(path)
        table = DeltaTable(store.delta_uri(path), storage_options=store.delta_options)
        check_txn_kept(path, table.metadata().configuration)


def list_topics(cfg: EngineConfig) -> list[str]:
    """Names of the topic tables in the lakehouse (lower case, sorted).

    A table counts once its first commit is in its log (its folder appears a moment before).

    Example:
        >>> list_topics(cfg)  # doctest: +SKIP
        ['notifications', 'orders']
    """
    folder = layout(cfg).topics
    store = store_for(folder)
    return [name for name in store.folders(folder) if table_exists(f"{folder}/{name}")]
