"""Compaction and clean-up of a lakehouse's tables, safe beside a running engine.

Every append makes a small file: a topic table gains one per delivery round, ``schedule`` one
per queue per stamping batch, ``commitlog`` one per send. :func:`maintain` runs, table by
table:

1. ``OPTIMIZE`` (Delta's bin-packing compaction), ordered where the engine's readers skip
   files by a column's range: ``schedule`` by ``deliver_ts`` (a delivery round reads only the
   files whose deliver times reach its window), topic tables by ``delivery_round`` (a
   consumer reads only the files after its position). Compaction rewrites files without
   changing a row (its commit says ``dataChange = false``): stamping and Delta streams skip
   it, and a round or a poll reads the same rows from the new files.
2. ``VACUUM`` with ``maintenance.retention``: data files no version within the retention
   needs are deleted from storage. Older versions become unreadable (time travel), so a table
   the engine may still read at an older version is left alone, saying why: ``commitlog``
   while stamping has not read past a version committed longer ago than the retention (its
   newest batch is read again at a restart), ``schedule`` and ``commands`` while a delivery
   round planned longer ago than that waits to be replayed (it reads the versions it pinned).
   The retention is at least one hour, 7 days by default. Topic tables are vacuumed only
   when asked (``vacuum_topics``): a consumer group's Spark stream reads them version by
   version, and one stopped for longer than the retention would find files gone.

Before ``schedule`` is compacted, :func:`prune_schedule` deletes its rows delivered or
cancelled ``maintenance.prune_after`` (7 days) before the delivery watermark, so the hot table
stays bounded; the messages stay in ``commitlog`` and their deliveries in the topic tables.
It records the cut on the table (``delayq.prunedBefore``) first, so a later cancel of such a
message answers ``already_delivered`` (or ``already_cancelled``) instead of waiting for a row
that is gone; and it prunes only once stamping has stamped everything sent before the cut.

Delta's own conflict detection keeps it safe beside the engine: appends never conflict with a
compaction or with the prune's ``DELETE``, and an operation that loses a race to another
(``ConcurrentWriteException`` and the like) is tried again, up to :data:`ATTEMPTS` times.

Example:
    >>> for report in maintain(spark, cfg, print):  # doctest: +SKIP
    ...     pass
    schedule: 412 files (3.1 MB) -> 9 files (2.8 MB); 403 files (2.9 MB) deleted from storage
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pyarrow.fs as pafs
from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.core.clock import Clock, SystemClock, from_micros, from_millis
from engine.core.config import EngineConfig
from engine.core.errors import DelayQError
from engine.deliver.checkpoint import read_checkpoint
from engine.deliver.commands import PRUNED_BEFORE
from engine.deliver.rates import cursors
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.delta_log import (
    CONCURRENT_CHANGES,
    latest_version,
    list_topics,
    table_exists,
)
from engine.lakehouse.storage.layout import layout
from engine.lakehouse.storage.location import store_for
from engine.stamp.query import newest_plan
from engine.stamp.writer import highest_batch

#: How much earlier than its commit a row's ``store_ts`` may be (taken before the write).
STORE_SLACK = timedelta(minutes=10)
#: Tries of a compaction that keeps losing races to other writers.
ATTEMPTS = 5
#: The column each table's compaction orders rows by (the engine's readers skip on it).
ORDER_BY = {"schedule": "deliver_ts", "topic": "delivery_round"}


@dataclass(frozen=True)
class TableReport:
    """What maintenance did to one table.

    Attributes:
        table: the table's name (``schedule``, ``topics/orders``, ...).
        files_before: data files in the table's current version before.
        files_after: and after compaction.
        bytes_before: their size before.
        bytes_after: and after.
        stored_before: data files in storage before (every version's, and leftovers).
        stored_after: after the clean-up (files written meanwhile, by the engine or a
            producer, included).
        deleted_files: data files that were in storage before and are gone after.
        freed_bytes: their bytes.
        seconds: how long it took.
    """

    table: str
    files_before: int
    files_after: int
    bytes_before: int
    bytes_after: int
    stored_before: int
    stored_after: int
    deleted_files: int
    freed_bytes: int
    seconds: float

    def line(self) -> str:
        """One line for people.

        Example:
            >>> done = TableReport(
            ...     "schedule", 412, 9, 3_100_000, 2_800_000, 820, 12, 811, 2_900_000, 4.2
            ... )
            >>> print(done.line())  # doctest: +NORMALIZE_WHITESPACE
            schedule: 412 files (3.1 MB) -> 9 files (2.8 MB); 811 files (2.9 MB) deleted from
            storage in 4.2 s
        """
        return (
            f"{self.table}: {self.files_before} files ({_mb(self.bytes_before)}) -> "
            f"{self.files_after} files ({_mb(self.bytes_after)}); {self.deleted_files} files "
            f"({_mb(self.freed_bytes)}) deleted from storage in {self.seconds:.1f} s"
        )


def tables_to_maintain(spark: SparkSession, cfg: EngineConfig) -> list[tuple[str, str, str | None]]:
    """``(name, path, order-by column)`` of the lakehouse's Delta tables that exist."""
    lay = layout(cfg)
    fixed = [
        ("commitlog", lay.commitlog, None),
        ("schedule", lay.schedule, ORDER_BY["schedule"]),
        ("quarantine", lay.quarantine, None),
        ("commands", lay.commands, None),
        ("command_results", lay.command_results, None),
        ("consumer_log", lay.consumer_log, None),
    ]
    topics = [(f"topics/{t}", lay.topic(t), ORDER_BY["topic"]) for t in list_topics(cfg)]
    return [(n, p, c) for n, p, c in fixed + topics if table_exists(p)]


def maintain(
    spark: SparkSession,
    cfg: EngineConfig,
    say: Callable[[str], None] = print,
    only: set[str] | None = None,
    clock: Clock | None = None,
    full: bool = False,
    vacuum_topics: bool = False,
) -> Iterator[TableReport]:
    """Compact and clean up each table (see the module's description), one report each.

    Args:
        spark: a Delta-enabled session.
        cfg: ``maintenance.retention`` and the lakehouse.
        say: where progress goes (a line as each table starts).
        only: maintain only these tables (names as :func:`tables_to_maintain` gives them).

    Raises:
        DelayQError: ``only`` names a table the lakehouse does not have (before any work).
        clock: for the retention's cutoff (the system clock by default).
        full: VACUUM by listing every file under each table (also removes files a crashed
            writer left without committing them; slower) instead of from the Delta log.
        vacuum_topics: VACUUM topic tables too. Off by default: a consumer group reading
            with a Spark stream (``consume_stream``) that is stopped for longer than the
            retention would find the files of its next versions gone.
    """
    clock = clock or SystemClock()
    retention_h = cfg.maintenance_retention_ms / 3_600_000
    cutoff = clock.now() - timedelta(milliseconds=cfg.maintenance_retention_ms)
    if retention_h < 168:
        # Delta refuses a retention below its default 7 days unless told the caller knows.
        spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    tables = tables_to_maintain(spark, cfg)
    unknown = sorted(set(only or ()) - {name for name, _, _ in tables})
    if unknown:
        raise DelayQError(
            f"no table {', '.join(unknown)} in {cfg.lakehouse_path}: "
            f"choose from {', '.join(sorted(name for name, _, _ in tables))}"
        )
    chosen = [t for t in tables if only is None or t[0] in only]
    if any(name == "schedule" for name, _, _ in chosen):
        # Before any compaction: commitlog's own would look like news to stamping.
        say(prune_schedule(spark, cfg, clock.now()))
    for i, (name, path, order) in enumerate(chosen, 1):
        say(f"[{i}/{len(chosen)}] {name}: compacting, then deleting files older than "
            f"{retention_h:g} h that no version needs")  # fmt: skip
        started = time.monotonic()
        before = _detail(spark, path)
        if before[0] > 1:  # one file or none: nothing to compact
            _with_retries(_optimize, spark, path, order)
        after = _detail(spark, path)
        stored_before = _stored(path)
        blocker = vacuum_blocker(spark, cfg, name, cutoff, vacuum_topics)
        if blocker is None:
            _vacuum(spark, path, retention_h, full)
        else:
            say(f"{name}: not vacuumed: {blocker}")
        stored_after = _stored(path)
        # by name: the engine and producers add files meanwhile (a difference of counts
        # went negative beside a busy engine)
        gone = stored_before.keys() - stored_after.keys()
        yield TableReport(
            name,
            before[0],
            after[0],
            before[1],
            after[1],
            len(stored_before),
            len(stored_after),
            len(gone),
            sum(stored_before[name] for name in gone),
            time.monotonic() - started,
        )


def prune_schedule(spark: SparkSession, cfg: EngineConfig, now: datetime) -> str:
    """Delete ``schedule`` rows delivered or cancelled ``maintenance.prune_after`` before the
    delivery watermark (see the module's description); a line saying what it did.

    A row is done when its deliver time and stamping batch are both at or below the
    committed progress (it was delivered, or a command took it out before its time).

    Example:
        >>> prune_schedule(spark, cfg, now)  # doctest: +SKIP
        'schedule: pruned 1200 rows delivered or cancelled before 2026-11-17 09:00:00+00:00'
    """
    if not cfg.prune_after_ms:
        return "schedule: not pruned (maintenance.prune_after is off)"
    lay = layout(cfg)
    progress, _ = read_checkpoint(spark, lay)
    if progress.round < 0:
        return "schedule: not pruned: no delivery round has committed yet"
    cutoff = min(progress.watermark, now) - timedelta(milliseconds=cfg.prune_after_ms)
    # (rows a topic's rate cap holds back are due, not delivered: none at or above a cursor)
    for us, _, _ in cursors(progress.rates).values():
        cutoff = min(cutoff, from_micros(us))
    behind = _stamping_behind(spark, cfg, cutoff)
    if behind is not None:
        return f"schedule: not pruned: {behind}"
    table = ArrowDelta(lay.schedule)
    recorded = table.table_property(PRUNED_BEFORE)
    if recorded is None or datetime.fromisoformat(recorded) < cutoff:
        # First: a command that finds no row of a message sent before it reads this.
        record = (f"ALTER TABLE delta.`{lay.schedule}` SET TBLPROPERTIES "
                  f"('{PRUNED_BEFORE}' = '{cutoff.isoformat()}')")  # fmt: skip
        _with_retries(spark.sql, record)
    # Both times before the cut: a timer sent with a past deliver time is taken (for
    # deduplication) from its store time, and commands find it by that time too.
    done = (F.greatest(F.col("deliver_ts"), F.col("store_ts")) < F.lit(cutoff)) & (
        F.coalesce(F.col("stamp_batch"), F.lit(-1)) <= F.lit(progress.stamp_batch)
    )
    _with_retries(DeltaTable.forPath(spark, lay.schedule).delete, done)
    metrics = DeltaTable.forPath(spark, lay.schedule).history(1).first()
    deleted = 0
    if metrics is not None and metrics["operation"] == "DELETE":
        deleted = int((metrics["operationMetrics"] or {}).get("numDeletedRows", 0))
    return f"schedule: pruned {deleted} rows delivered or cancelled before {cutoff}"


def _stamping_behind(spark: SparkSession, cfg: EngineConfig, cutoff: datetime) -> str | None:
    """Why stamping may not have stamped every ``commitlog`` row sent before ``cutoff``."""
    lay = layout(cfg)
    plan = newest_plan(lay)
    if plan is None:
        return _NOT_STAMPED
    started = _commit_time(spark, lay.commitlog, plan.start.version)
    # A row's store time is taken a moment before its commit: keep a margin.
    if started is not None and started >= cutoff + STORE_SLACK:
        return None  # every version committed before the cutoff precedes the newest batch
    # The newest batch ends at its end position (exclusive); later versions that only
    # compact (OPTIMIZE) bring nothing to stamp.
    later = (
        DeltaTable.forPath(spark, lay.commitlog)
        .history()
        .where(F.col("version") >= plan.end.version)
        .select("version", "operation")
        .collect()
    )
    fresh = [r for r in later if r["operation"] != "OPTIMIZE"]
    if not fresh and highest_batch(ArrowDelta(lay.schedule)) >= plan.batch:
        return None  # the newest batch reached the end of commitlog, and it landed
    return f"stamping has not stamped every message sent before {cutoff} yet"


def vacuum_blocker(
    spark: SparkSession,
    cfg: EngineConfig,
    name: str,
    cutoff: datetime,
    vacuum_topics: bool = False,
) -> str | None:
    """Why ``name`` must not be vacuumed now (``None``: it may be): the engine may still read
    a version whose files a VACUUM with this cutoff would delete.

    Example:
        >>> vacuum_blocker(spark, cfg, "commitlog", now - timedelta(days=7))  # doctest: +SKIP
        'stamping has not read past version 12, committed before the retention ...'
    """
    lay = layout(cfg)
    if name.startswith("topics/") and not vacuum_topics:
        return (
            "a consumer group's Spark stream (consume_stream) may still read its older "
            "versions: --vacuum-topics once none is stopped for longer than the retention"
        )
    if name == "commitlog":
        plan = newest_plan(lay)
        if plan is None:
            return None if latest_version(lay.commitlog) < 0 else _NOT_STAMPED
        needed = plan.start.version
        committed = _commit_time(spark, lay.commitlog, needed)
        if committed is not None and committed < cutoff:
            return (
                f"stamping has not read past version {needed}, committed before the retention "
                f"({committed.isoformat()}): a restart reads it again"
            )
    elif name in ("schedule", "commands"):
        _, pending = read_checkpoint(spark, lay)
        if pending is not None and pending.watermark < cutoff:
            return (
                f"delivery round {pending.round}, planned at {pending.watermark.isoformat()}, "
                "waits to be replayed from the versions it pinned"
            )
    return None


_NOT_STAMPED = "stamping has not started on this lakehouse: the engine reads it from its start"


def _commit_time(spark: SparkSession, path: str, version: int) -> datetime | None:
    """When ``version`` of the table was committed (``None``: no such version)."""
    row = (
        DeltaTable.forPath(spark, path)
        .history()
        .where(F.col("version") == version)
        .select(F.unix_millis("timestamp").alias("ms"))
        .first()
    )
    return None if row is None else from_millis(int(row["ms"]))


def _vacuum(spark: SparkSession, path: str, retention_h: float, full: bool) -> None:
    """VACUUM: from the Delta log (``LITE``, seconds) unless ``full`` or the log no longer
    reaches the last vacuum (then Delta asks for a full one)."""
    hours = math.ceil(retention_h)
    statement = f"VACUUM delta.`{path}` RETAIN {hours} HOURS"
    if not full:
        try:
            _with_retries(lambda: spark.sql(f"{statement} LITE").collect())
            return
        except Exception as err:
            if "VACUUM_LITE" not in str(err):
                raise
    _with_retries(lambda: spark.sql(statement).collect())


def _optimize(spark: SparkSession, path: str, order: str | None) -> None:
    builder = DeltaTable.forPath(spark, path).optimize()
    if order is None:
        builder.executeCompaction()
    else:
        builder.executeZOrderBy(order)


def _with_retries(action: Callable[..., Any], *args: Any) -> None:
    for attempt in range(1, ATTEMPTS + 1):
        try:
            action(*args)
            return
        except CONCURRENT_CHANGES:
            if attempt == ATTEMPTS:
                raise
            time.sleep(0.5 * attempt)


def _detail(spark: SparkSession, path: str) -> tuple[int, int]:
    """Data files of the current version and their bytes."""
    row = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first()
    return (int(row["numFiles"] or 0), int(row["sizeInBytes"] or 0)) if row else (0, 0)


def _stored(path: str) -> dict[str, int]:
    """Data files in storage under the table's folder (not its log): bytes by path.

    Listed by Arrow's filesystem in one call (a Hadoop listing from Python paid a Py4J round
    trip per file and field: 27-35 s for a table of 2,000 files, against well under one).
    """
    store = store_for(path)
    root = store.arrow_path(path).rstrip("/")
    listing = store.filesystem.get_file_info(
        pafs.FileSelector(root, recursive=True, allow_not_found=True)
    )
    found: dict[str, int] = {}
    for info in listing:
        relative = info.path[len(root) :]
        if info.type != pafs.FileType.File or "/_delta_log/" in relative + "/":
            continue
        if relative.endswith(".parquet"):
            found[relative] = int(info.size or 0)
    return found


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


__all__ = [
    "ATTEMPTS",
    "ORDER_BY",
    "TableReport",
    "maintain",
    "prune_schedule",
    "tables_to_maintain",
    "vacuum_blocker",
]
