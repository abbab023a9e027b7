"""Stamping: turn new ``commitlog`` rows into ``schedule`` rows (or quarantine them).

A stamped row keeps every message column and gains ``queue_id`` (the clamped level,
0 = not delayed, -1 = timer), ``deliver_ts = store_ts + delay(level)`` (RocketMQ's
tagsCode) or ``deliver_at`` for a timer message, and the ``stamp_batch`` that wrote it.
Rows that break a rule go to ``quarantine`` with the reason.

:func:`stamp` is a pure transform; :class:`StampWriter` is the ``foreachBatch`` function of
the stamping stream. Both writes are idempotent per micro-batch: a batch is written to a
table only if its id is above the highest ``stamp_batch`` the table holds (looked up once,
then tracked), so a batch Spark replays after a crash stores nothing twice. This replaces
Delta's ``txnAppId``/``txnVersion``, whose check costs about 0.4 s per commit.
"""

from __future__ import annotations

from datetime import datetime

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.clock import Clock
from engine.config import EngineConfig
from engine.levels import LevelTable
from engine.producer import rejection_reason
from engine.tables import Layout
from schemas import COMMITLOG, column_names

STAMP_APP_ID = "delayq-stamp"
#: The queue of timer messages (an absolute deliver time instead of a level).
TIMER_QUEUE = -1


def queue_of(levels: LevelTable, level: Column) -> Column:
    """The queue a requested level lands in: 0 when not delayed, else clamped to 1..max."""
    return (
        F.when(level.isNull() | (level <= 0), F.lit(0))
        .otherwise(F.least(level, F.lit(levels.max_level)))
        .cast("int")
    )


def delay_ms_of(levels: LevelTable, queue: Column) -> Column:
    """The delay in milliseconds of a queue id (0 for queue 0; ids past the table use the max)."""
    table = F.array(*[F.lit(ms) for ms in (0, *levels.delays_ms)])
    index = F.least(F.greatest(queue, F.lit(0)), F.lit(levels.max_level)) + 1
    return F.element_at(table, index).cast("long")


def stamp(
    df: DataFrame, cfg: EngineConfig, batch_id: int, now: datetime
) -> tuple[DataFrame, DataFrame]:
    """Split ``commitlog`` rows into stamped ``schedule`` rows and ``quarantine`` rows.

    Args:
        df: rows with the ``commitlog`` schema.
        cfg: supplies the level table and the validation limits.
        batch_id: the stamping micro-batch, recorded as ``stamp_batch``.
        now: the stamping time, recorded as ``stamped_ts`` / ``quarantined_ts``.

    Returns:
        ``(scheduled, quarantined)`` with the ``schedule`` and ``quarantine`` schemas.
    """
    message = [F.col(c) for c in column_names(COMMITLOG)]
    checked = df.select(*message, rejection_reason(cfg).alias("reason"))
    timer = F.col("deliver_at").isNotNull()
    level_queue = queue_of(cfg.levels, F.col("delay_level"))
    queue = F.when(timer, F.lit(TIMER_QUEUE)).otherwise(level_queue)
    delayed = F.timestamp_millis(F.unix_millis("store_ts") + delay_ms_of(cfg.levels, level_queue))
    deliver = F.when(timer, F.col("deliver_at")).otherwise(delayed)
    scheduled = checked.where(F.col("reason").isNull()).select(
        *message,
        queue.alias("queue_id"),
        deliver.alias("deliver_ts"),
        F.lit(batch_id).cast("long").alias("stamp_batch"),
        F.lit(now).alias("stamped_ts"),
        F.lit(0).alias("revision"),
    )
    quarantined = checked.where(F.col("reason").isNotNull()).select(
        *message,
        F.col("reason"),
        F.lit(batch_id).cast("long").alias("stamp_batch"),
        F.lit(now).alias("quarantined_ts"),
    )
    return scheduled, quarantined


class StampWriter:
    """The stamping stream's ``foreachBatch``: stamp, then append idempotently.

    Example:
        >>> (spark.readStream.format("delta").load(lay.commitlog)          # doctest: +SKIP
        ...     .writeStream.foreachBatch(StampWriter(cfg, lay, clock)).start())
    """

    def __init__(self, cfg: EngineConfig, layout: Layout, clock: Clock) -> None:
        self.cfg = cfg
        self.layout = layout
        self.clock = clock
        self._written: dict[str, int] = {}  # table path -> highest stamp_batch it holds

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        """Stamp one micro-batch; safe to call again with the same ``batch_id``."""
        batch = batch.persist()
        try:
            scheduled, quarantined = stamp(batch, self.cfg, batch_id, self.clock.now())
            counts = {
                row["ok"]: row["n"]
                for row in batch.groupBy(rejection_reason(self.cfg).isNull().alias("ok"))
                .agg(F.count(F.lit(1)).alias("n"))
                .collect()
            }
            good, bad = counts.get(True, 0), counts.get(False, 0)
            if good:
                # One sorted run per queue, cut every stamp.max_rows_per_file rows: each
                # file then spans a narrow deliver_ts range, which data skipping exploits.
                # A batch that fits in one file needs no shuffle: one task writes it.
                spread = (
                    scheduled.coalesce(1)
                    if good <= self.cfg.stamp_file_rows
                    else scheduled.repartition("queue_id")
                )
                ordered = spread.sortWithinPartitions("queue_id", "deliver_ts")
                self._append(ordered, self.layout.schedule, batch_id, self.cfg.stamp_file_rows)
            if bad:
                self._append(quarantined, self.layout.quarantine, batch_id)
        finally:
            batch.unpersist()

    def _append(self, df: DataFrame, path: str, batch_id: int, file_rows: int = 0) -> None:
        if path not in self._written:
            self._written[path] = highest_batch(df.sparkSession, path)
        if batch_id <= self._written[path]:
            return  # a replayed batch that reached this table before the crash
        try:
            (
                df.write.format("delta")
                .mode("append")
                .option("userMetadata", f"{STAMP_APP_ID} batch {batch_id}")
                .option("maxRecordsPerFile", file_rows)
                .save(path)
            )
        except BaseException:
            # The commit may have landed although the call failed: look it up again.
            self._written.pop(path, None)
            raise
        self._written[path] = batch_id


def highest_batch(spark: SparkSession, path: str) -> int:
    """The highest ``stamp_batch`` in a table (-1 when empty); Delta answers from file stats."""
    row = spark.read.format("delta").load(path).agg(F.max("stamp_batch")).first()
    return -1 if row is None or row[0] is None else int(row[0])
