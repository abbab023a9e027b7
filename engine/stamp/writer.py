"""The stamping stream's ``foreachBatch``: stamp, then append to ``schedule`` / ``quarantine``.

Both writes are idempotent per micro-batch: a batch is written to a table only if its id is
above the highest ``stamp_batch`` the table holds (looked up once, then tracked), so a batch
Spark replays after a crash stores nothing twice. This replaces Delta's
``txnAppId``/``txnVersion``, whose check costs about 0.4 s per commit.

Example:
    >>> (spark.readStream.format("delta").load(lay.commitlog)          # doctest: +SKIP
    ...     .writeStream.foreachBatch(StampWriter(cfg, lay, clock)).start())
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.core.clock import Clock
from engine.core.config import EngineConfig
from engine.core.message import rejection_reason
from engine.lakehouse.delta_log import append
from engine.lakehouse.layout import Layout
from engine.stamp.transform import stamp

STAMP_APP_ID = "delayq-stamp"


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
            append(
                df,
                path,
                metadata=f"{STAMP_APP_ID} batch {batch_id}",
                max_records_per_file=file_rows,
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
