"""Send messages into ``commitlog``: one, many, an Arrow table, or a whole DataFrame.

Every message is validated before anything is written (:func:`engine.core.message.validate`);
a bad message raises :class:`~engine.core.errors.InvalidMessageError` naming the field and
value, and nothing of that call is written. ``store_ts`` is assigned from the engine's clock
when the rows are committed, never taken from the producer (``born_ts`` is the producer's own
time).

:func:`send`, :func:`send_many` and :func:`send_arrow` commit from the driver with delta-rs
(a few milliseconds, no Spark job); :func:`send_df` runs Spark jobs, for DataFrames too large
for the driver. Once ``commitlog`` exists, :func:`send_many` needs no Spark session at all
(``spark=None``): ``delayq send`` starts no JVM.

Example:
    >>> send(spark, cfg, "orders", b'{"id": 1}', keys=["order-1"], delay_level=3)  # doctest: +SKIP
    '9F1C...'
    >>> batch = [Message("orders", "a"), Message("audit", "b", delay_level=1)]
    >>> ids = send_many(spark, cfg, batch)  # doctest: +SKIP
    >>> rows = pa.table({"topic": ["orders"] * 2, "body": [b"a", b"b"]})
    >>> send_arrow(spark, cfg, rows)  # doctest: +SKIP
    2
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.core.arrow_checks import rejection_reasons
from engine.core.clock import Clock, SystemClock
from engine.core.config import EngineConfig
from engine.core.errors import InvalidMessageError, SetupError
from engine.core.message import (
    Message,
    message_from_mapping,
    new_msg_id,
    new_msg_ids,
    rejection_reason,
    validate,
)
from engine.lakehouse.delta.arrow_delta import ArrowDelta, columns
from engine.lakehouse.delta.delta_log import Txn, append, table_exists
from engine.lakehouse.delta.tables import ensure_tables
from engine.lakehouse.storage.layout import layout
from schemas import COMMITLOG, column_names

__all__ = ["Message", "commitlog_ready", "send", "send_arrow", "send_df", "send_many"]

#: Columns ``send_arrow`` takes as timestamps only (an integer could be ms, s or us).
_TIMES = ("born_ts", "deliver_at")


def commitlog_ready(cfg: EngineConfig) -> bool:
    """Whether ``commitlog`` exists with every column this version writes, so that
    :func:`send_many` needs no Spark session (only a new or older lakehouse does).

    Example:
        >>> commitlog_ready(EngineConfig(lakehouse="/nowhere/at/all"))
        False
    """
    path = layout(cfg).commitlog
    return table_exists(path) and set(column_names(COMMITLOG)) <= set(columns(path))


def _commitlog(spark: SparkSession | None, cfg: EngineConfig) -> ArrowDelta:
    """The process's handle on ``commitlog`` (kept: opening one reads the whole table state,
    an append through a kept one writes the next log version at any table size). Without a
    session the table must be there already (:func:`commitlog_ready`)."""
    if spark is not None:
        path = ensure_tables(spark, cfg, migrate=False).commitlog
    elif layout(cfg).commitlog in _HANDLES or commitlog_ready(cfg):
        path = layout(cfg).commitlog  # checked once per process, as ensure_tables is
    else:
        raise SetupError(
            f"{layout(cfg).commitlog} is missing or made by an older version: "
            "send with a Spark session once (or start the engine) to create it"
        )
    with _HANDLES_LOCK:
        if path not in _HANDLES:
            _HANDLES[path] = ArrowDelta(path)
        return _HANDLES[path]


_HANDLES: dict[str, ArrowDelta] = {}
_HANDLES_LOCK = threading.Lock()


def _forget_handles() -> None:
    """In a forked child: new handles and lock (the parent's may be held by another thread)."""
    global _HANDLES_LOCK
    _HANDLES.clear()
    _HANDLES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_handles)


def send_many(
    spark: SparkSession | None,
    cfg: EngineConfig,
    messages: Iterable[Message | Mapping[str, Any]],
    clock: Clock | None = None,
    *,
    engine: bool = False,
    txn: Txn | None = None,
) -> list[str]:
    """Validate and append messages to ``commitlog`` in one commit.

    Args:
        spark: a Delta-enabled session; None when ``commitlog`` exists already
            (:func:`commitlog_ready`): the commit needs no Spark.
        cfg: engine configuration (lakehouse, max body size).
        messages: :class:`Message` objects or dicts with the same fields.
        clock: source of ``store_ts`` (and of ``born_ts`` when not given).
        engine: the engine itself sends them (its own property names are allowed).
        txn: recorded with the commit (``txnAppId``/``txnVersion``): a sender that replays
            its batches asks ``commitlog``'s recorded version before sending again.

    Returns:
        The message ids, in input order: the ones given (``Message.msg_id``), or made here.
        Sending a message again with the id returned makes the retry idempotent.

    Raises:
        InvalidMessageError: when any message is bad; nothing is written then.
        SetupError: without a session, when ``commitlog`` is not there to append to.
    """
    clock = clock or SystemClock()
    store_ts = clock.now()
    fields = []
    for i, item in enumerate(messages):
        message = item if isinstance(item, Message) else message_from_mapping(item, i)
        fields.append(validate(message, cfg, store_ts, engine))
    if not fields:
        return []
    ids = [f["msg_id"] or new_msg_id() for f in fields]
    commitlog = _commitlog(spark, cfg)
    rows = [
        {
            **f,
            "msg_id": msg_id,
            "born_ts": f["born_ts"] or store_ts,
            "store_ts": store_ts,
            "properties": list(f["properties"].items()),
        }
        for f, msg_id in zip(fields, ids, strict=True)
    ]
    commitlog.append(pa.Table.from_pylist(rows, schema=commitlog.schema()), txn=txn)
    return ids


def send_arrow(
    spark: SparkSession | None,
    cfg: EngineConfig,
    rows: pa.Table,
    clock: Clock | None = None,
    *,
    txn: Txn | None = None,
) -> int:
    """Append the rows of an Arrow table to ``commitlog`` in one commit; returns how many.

    The fastest way in from Python: checked with vectorised rules and committed with
    delta-rs, no Spark job (tens of milliseconds for 10,000 rows). ``rows`` has the columns
    :func:`send_df` takes (``topic`` and ``body`` at least); rows without ``msg_id`` get one,
    ``store_ts`` is now and ``born_ts`` defaults to it. ``txn`` is recorded with the commit
    (a sender that replays its batches asks ``commitlog``'s recorded version first). Once
    ``commitlog`` exists, ``spark`` may be None.

    Raises:
        InvalidMessageError: when a row is bad (the first one is shown); nothing is written.

    Example:
        >>> rows = pa.table({"topic": ["orders"], "body": [b"paid"], "delay_level": [2]})
        >>> send_arrow(spark, cfg, rows)  # doctest: +SKIP
        1
    """
    clock = clock or SystemClock()
    _check_columns(rows.column_names)
    for name in _TIMES:
        if name in rows.column_names and not pa.types.is_timestamp(rows.schema.field(name).type):
            raise InvalidMessageError(
                name, str(rows.schema.field(name).type), "must be a timestamp column"
            )
    commitlog = _commitlog(spark, cfg)
    schema = commitlog.schema()
    n = int(rows.num_rows)
    if n == 0:
        return 0
    store_ts = pa.repeat(pa.scalar(clock.now(), schema.field("store_ts").type), n)
    columns = []
    for name in schema.names:
        if name == "store_ts":
            columns.append(store_ts)
        elif name not in rows.column_names:
            if name == "msg_id":
                columns.append(new_msg_ids(n))
            elif name == "born_ts":
                columns.append(store_ts)
            else:
                columns.append(pa.nulls(n, schema.field(name).type))
        else:
            given = rows[name].combine_chunks().cast(schema.field(name).type)
            if name == "msg_id" and given.null_count:
                # ids made only for the rows without one (making 100,000 costs 30 ms)
                given = pc.replace_with_mask(
                    given, pc.is_null(given), new_msg_ids(given.null_count).cast(given.type)
                )
            elif name == "born_ts":
                given = pc.coalesce(given, store_ts)
            columns.append(given)
    table = pa.Table.from_arrays(columns, schema=schema)
    reasons = rejection_reasons(table, cfg)
    if reasons.null_count != n:
        first = pc.index(pc.is_valid(reasons), True).as_py()
        raise InvalidMessageError("row", table["topic"][first].as_py(), reasons[first].as_py())
    commitlog.append(table, txn=txn)
    return n


def _check_columns(names: Sequence[str]) -> None:
    missing = {"topic", "body"} - set(names)
    if missing:
        raise InvalidMessageError("columns", sorted(names), f"missing {sorted(missing)}")
    unknown = set(names) - set(column_names(COMMITLOG))
    if unknown:
        raise InvalidMessageError("columns", sorted(unknown), "not commitlog columns")


def send(
    spark: SparkSession,
    cfg: EngineConfig,
    topic: str,
    body: bytes | str,
    *,
    keys: Sequence[str] | str | None = None,
    tags: str | None = None,
    properties: Mapping[str, str] | None = None,
    delay_level: int | None = None,
    deliver_at: datetime | int | str | None = None,
    delay: timedelta | str | None = None,
    msg_id: str | None = None,
    clock: Clock | None = None,
) -> str:
    """Send one message and return its id.

    Give at most one of ``delay_level``, ``deliver_at`` and ``delay`` (see :class:`Message`).
    Give ``msg_id`` to make the send idempotent: sent again with the same id (a retry after
    a timeout), the message is still delivered once (within ``messages.dedup_window``).

    Example:
        >>> send(spark, cfg, "orders", "paid", delay_level=2)  # doctest: +SKIP
        '3F2A...'
        >>> send(spark, cfg, "orders", "remind", delay="15m")  # doctest: +SKIP
        >>> at = "2026-12-01T09:00:00+01:00"
        >>> send(spark, cfg, "orders", "close", deliver_at=at)  # doctest: +SKIP
        >>> send(spark, cfg, "orders", "paid", msg_id="order-1:paid")  # doctest: +SKIP
        'order-1:paid'
    """
    message = Message(
        topic,
        body,
        keys,
        tags,
        properties,
        delay_level,
        deliver_at=deliver_at,
        delay=delay,
        msg_id=msg_id,
    )
    return send_many(spark, cfg, [message], clock)[0]


def send_df(
    spark: SparkSession, cfg: EngineConfig, df: DataFrame, clock: Clock | None = None
) -> int:
    """Append every row of ``df`` to ``commitlog`` and return how many were sent.

    ``df`` needs ``topic`` and ``body`` (string or binary) and may have ``keys``,
    ``tags``, ``properties``, ``delay_level``, ``born_ts``, ``deliver_at`` (a timestamp) and
    ``msg_id`` (the producer's own id, which makes the send idempotent). Rows without an id
    get one; find them in ``commitlog`` (or the topic) by key.

    Raises:
        InvalidMessageError: when a row is bad (the first one is shown); nothing is written.
    """
    clock = clock or SystemClock()
    _check_columns(df.columns)
    store_ts = clock.now()
    present = set(df.columns)

    def column(name: str) -> Column:
        if name == "msg_id":
            made = F.expr("upper(replace(uuid(), '-', ''))")
            return F.coalesce(F.col(name), made) if name in present else made
        if name == "store_ts":
            return F.lit(store_ts)
        if name == "born_ts":
            return F.coalesce(F.col(name), F.lit(store_ts)) if name in present else F.lit(store_ts)
        return F.col(name) if name in present else F.lit(None)

    shaped = df.select(*[column(f.name).cast(f.dataType).alias(f.name) for f in COMMITLOG.fields])
    checked = shaped.withColumn("_reason", rejection_reason(cfg)).cache()
    try:
        # One pass: how many rows, and the first bad one (if any).
        seen = checked.agg(
            F.count(F.lit(1)).alias("n"),
            F.min_by(F.struct("_reason", "topic"), F.col("_reason").isNull()).alias("bad"),
        ).first()
        assert seen is not None
        bad = seen["bad"]
        if bad is not None and bad["_reason"] is not None:
            raise InvalidMessageError("row", bad["topic"], bad["_reason"])
        lay = ensure_tables(spark, cfg, migrate=False)
        append(checked.drop("_reason"), lay.commitlog)
        return int(seen["n"])
    finally:
        checked.unpersist()
