"""The stamping stream's ``foreachBatch``: stamp, then append to ``schedule`` / ``quarantine``.

One Spark job per micro-batch: the batch is checked and stamped by Spark
(:mod:`engine.stamp.transform`) and collected as Arrow; the valid rows, sorted by queue and
deliver time, go to ``schedule`` and the refused ones to ``quarantine``, each in one delta-rs
commit (:mod:`engine.lakehouse.arrow_delta`), about 20 ms where a Spark Delta write takes
about a second here.

Both writes are idempotent per micro-batch: a batch is written to a table only if its id is
above the highest ``stamp_batch`` the table holds (looked up once, then tracked), so a batch
Spark replays after a crash stores nothing twice.

Example:
    >>> (spark.readStream.format("delta").load(lay.commitlog)          # doctest: +SKIP
    ...     .writeStream.foreachBatch(StampWriter(cfg, lay, clock)).start())
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.core.clock import Clock
from engine.core.config import EngineConfig
from engine.lakehouse.arrow_delta import ArrowDelta
from engine.lakehouse.layout import Layout
from engine.stamp.transform import check, stamped
from schemas import QUARANTINE, SCHEDULE, column_names

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
        self._tables = {
            layout.schedule: ArrowDelta(layout.schedule),
            layout.quarantine: ArrowDelta(layout.quarantine),
        }
        self._written: dict[str, int] = {}  # table path -> highest stamp_batch it holds

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        """Stamp one micro-batch; safe to call again with the same ``batch_id``."""
        spark = batch.sparkSession
        now = self.clock.now()
        rows = stamped(check(batch, self.cfg), self.cfg, batch_id, now).toArrow()
        refused = pc.is_valid(rows["reason"])
        scheduled = rows.filter(pc.invert(refused)).select(column_names(SCHEDULE))
        # One sorted run per queue: each file then spans a narrow deliver_ts range, which
        # the rounds' file skipping exploits.
        scheduled = scheduled.sort_by([("queue_id", "ascending"), ("deliver_ts", "ascending")])
        self._append(spark, scheduled, self.layout.schedule, batch_id, self.cfg.stamp_file_rows)
        refused_rows = rows.filter(refused)
        quarantined = refused_rows.append_column("quarantined_ts", refused_rows["stamped_ts"])
        self._append(
            spark, quarantined.select(column_names(QUARANTINE)), self.layout.quarantine, batch_id
        )

    def _holds(self, spark: SparkSession, path: str, batch_id: int) -> bool:
        """Whether the table already holds this batch (a replay of a batch it received)."""
        if path not in self._written:
            self._written[path] = highest_batch(spark, path)
        return batch_id <= self._written[path]

    def _append(
        self, spark: SparkSession, rows: pa.Table, path: str, batch_id: int, file_rows: int = 0
    ) -> None:
        if rows.num_rows == 0 or self._holds(spark, path, batch_id):
            return  # nothing to store, or a replayed batch that reached this table before
        try:
            self._tables[path].append(
                rows, metadata=f"{STAMP_APP_ID} batch {batch_id}", file_rows=file_rows
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
