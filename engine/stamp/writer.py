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

import uuid

from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from engine.core.clock import Clock
from engine.core.config import EngineConfig
from engine.lakehouse.delta_log import append
from engine.lakehouse.layout import Layout
from engine.stamp.transform import check, quarantined_rows, scheduled_rows

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
        """Stamp one micro-batch; safe to call again with the same ``batch_id``.

        One Spark job in the common case: the ``schedule`` append counts the refused rows
        as it goes (an :class:`~pyspark.sql.Observation`), and only a batch that has some
        reads its input again to write them to ``quarantine``.
        """
        now = self.clock.now()
        checked = check(batch, self.cfg)
        spark = batch.sparkSession
        if self._holds(spark, self.layout.schedule, batch_id):
            # Replayed after a crash that came after the schedule append: finish the rest.
            rejected = not self._holds(spark, self.layout.quarantine, batch_id) and _any_refused(
                checked
            )
        else:
            counts = Observation(f"delayq-stamp-{uuid.uuid4().hex}")
            observed = checked.observe(counts, F.count(F.col("reason")).alias("rejected"))
            scheduled = scheduled_rows(observed, self.cfg, batch_id, now)
            # One sorted run per queue, cut every stamp.max_rows_per_file rows: each file
            # then spans a narrow deliver_ts range, which data skipping exploits. A batch
            # read as one partition needs no shuffle: its one task writes it sorted.
            if batch.rdd.getNumPartitions() > 1:
                scheduled = scheduled.repartition("queue_id")
            ordered = scheduled.sortWithinPartitions("queue_id", "deliver_ts")
            self._append(ordered, self.layout.schedule, batch_id, self.cfg.stamp_file_rows)
            # (a missing metric would be a Spark bug: look at the rows rather than guess)
            seen = counts.get.get("rejected")
            rejected = bool(seen) if seen is not None else _any_refused(checked)
        if rejected:
            self._append(quarantined_rows(checked, batch_id, now), self.layout.quarantine, batch_id)

    def _holds(self, spark: SparkSession, path: str, batch_id: int) -> bool:
        """Whether the table already holds this batch (a replay of a batch it received)."""
        if path not in self._written:
            self._written[path] = highest_batch(spark, path)
        return batch_id <= self._written[path]

    def _append(self, df: DataFrame, path: str, batch_id: int, file_rows: int = 0) -> None:
        if self._holds(df.sparkSession, path, batch_id):
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


def _any_refused(checked: DataFrame) -> bool:
    """Whether :func:`~engine.stamp.transform.check`'s output has a refused row (one job)."""
    return not checked.where(F.col("reason").isNotNull()).isEmpty()


def highest_batch(spark: SparkSession, path: str) -> int:
    """The highest ``stamp_batch`` in a table (-1 when empty); Delta answers from file stats."""
    row = spark.read.format("delta").load(path).agg(F.max("stamp_batch")).first()
    return -1 if row is None or row[0] is None else int(row[0])
