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

from collections.abc import Sequence
from datetime import datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.core.clock import Clock
from engine.core.config import EngineConfig
from engine.lakehouse.arrow_delta import ArrowDelta
from engine.lakehouse.layout import Layout
from engine.stamp.dedup import SeenIds, Taken, duplicate_reasons, from_micros, taken_until
from engine.stamp.transform import check, stamped
from schemas import QUARANTINE, SCHEDULE, column_names

STAMP_APP_ID = "delayq-stamp"
#: The 64-bit hash of ``msg_id`` (a ``schedule`` column): the deduplication index's key.
ID_HASH = "msg_id_hash"
#: Ids are kept this long past the window, for rows stored a while before they are stamped
#: (older ones make the writer read the ids back from ``schedule``).
EXPIRY_SLACK = timedelta(minutes=15)


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
        self._seen: SeenIds | None = None  # ids stamped in the dedup window, read when needed

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        """Stamp one micro-batch; safe to call again with the same ``batch_id``."""
        try:
            self._stamp(batch, batch_id)
        except BaseException:
            # A retried batch must decide duplicates as the first try did: rebuild the ids
            # from `schedule` (batches before this one) instead of trusting the memory.
            self._seen = None
            raise

    def _stamp(self, batch: DataFrame, batch_id: int) -> None:
        spark = batch.sparkSession
        now = self.clock.now()
        stamped_rows = stamped(check(batch, self.cfg), self.cfg, batch_id, now)
        dedup = self.cfg.dedup_window_ms > 0
        rows = stamped_rows.toArrow()
        if dedup:
            rows = self._mark_duplicates(spark, rows, batch_id, now)
        refused = pc.is_valid(rows["reason"])
        scheduled = rows.filter(pc.invert(refused))
        # One sorted run per queue: each file then spans a narrow deliver_ts range, which
        # the rounds' file skipping exploits.
        scheduled = scheduled.sort_by([("queue_id", "ascending"), ("deliver_ts", "ascending")])
        self._append(
            spark,
            scheduled.select(column_names(SCHEDULE)),
            self.layout.schedule,
            batch_id,
            self.cfg.stamp_file_rows,
        )
        if dedup and self._seen is not None and scheduled.num_rows:
            self._seen.add(scheduled[ID_HASH].to_numpy(), taken_until(scheduled))
        refused_rows = rows.filter(refused)
        quarantined = refused_rows.append_column("quarantined_ts", refused_rows["stamped_ts"])
        self._append(
            spark, quarantined.select(column_names(QUARANTINE)), self.layout.quarantine, batch_id
        )

    def _mark_duplicates(
        self, spark: SparkSession, rows: pa.Table, batch_id: int, now: datetime
    ) -> pa.Table:
        """``rows`` with each later copy of an already stamped ``msg_id`` refused as a duplicate."""
        valid = pc.is_null(rows["reason"])
        candidates = rows.filter(valid)
        if candidates.num_rows == 0:
            return rows
        window = timedelta(milliseconds=self.cfg.dedup_window_ms)
        # Only copies taken until this or later can make a row of the batch a duplicate.
        needed = pc.min(candidates["store_ts"]).as_py() - window
        # Never forget what this batch needs; keep some slack for rows stamped late.
        bound = min(needed, now - window - EXPIRY_SLACK)
        if self._seen is None or needed < self._seen.complete_from:
            # A restart, a retried batch, or rows stored long before the batch: read the
            # taken ids back from `schedule`, so the decision is the one the data gives.
            self._seen = seen_ids(spark, self._tables[self.layout.schedule], batch_id, bound)
        elif bound > self._seen.complete_from + window / 8:
            self._seen.expire(bound)  # now and then: it goes through every id
        reasons = duplicate_reasons(
            candidates,
            candidates[ID_HASH].to_numpy(),
            self._seen,
            lambda ids: self._last_stored(ids, batch_id, needed),
            window,
        )
        if reasons.null_count == len(reasons):
            return rows
        # Put each candidate's reason back at its row (refused rows keep their own).
        positions = np.flatnonzero(valid.to_numpy(zero_copy_only=False))
        merged = np.array(rows["reason"].to_pylist(), dtype=object)
        merged[positions] = reasons.to_numpy(zero_copy_only=False)
        index = rows.column_names.index("reason")
        return rows.set_column(index, "reason", pa.array(merged.tolist(), pa.string()))

    def _last_stored(self, ids: Sequence[str], batch_id: int, needed: datetime) -> dict[str, Taken]:
        """Each id's latest copy stamped by an earlier batch and taken until ``needed`` or
        later (ids without one are left out)."""
        table = self._tables[self.layout.schedule]
        version = table.latest()
        if version < 0 or not ids:
            return {}
        store, deliver = pc.field("store_ts"), pc.field("deliver_ts")
        found = table.dataset(version).to_table(
            columns=["msg_id", "store_ts", "deliver_ts"],
            # The time bounds change no answer; they let the files' statistics skip the rest.
            filter=pc.field("msg_id").isin(pa.array(list(ids), pa.string()))
            & (pc.field("stamp_batch") < batch_id)
            & (pc.field("revision").is_null() | (pc.field("revision") == 0))
            & ((store >= needed) | (deliver >= needed)),
        )
        until = pa.array(taken_until(found), pa.int64())
        latest = (
            found.append_column("until", until)
            .group_by("msg_id")
            .aggregate([("store_ts", "max"), ("until", "max")])
        )
        return {
            msg_id: Taken(stored, from_micros(int(us)))
            for msg_id, stored, us in zip(
                latest["msg_id"].to_pylist(),
                latest["store_ts_max"].to_pylist(),
                latest["until_max"].to_pylist(),
                strict=True,
            )
        }

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


def seen_ids(spark: SparkSession, table: ArrowDelta, batch_id: int, since: datetime) -> SeenIds:
    """The ids stamped by batches before ``batch_id`` and taken until ``since`` or later.

    Read with delta-rs from ``msg_id_hash`` and the two times (24 bytes a row, no Spark job);
    rows stamped before the column existed are hashed by Spark.

    Example:
        >>> since = clock.now() - timedelta(hours=2)
        >>> table = ArrowDelta(lay.schedule)  # doctest: +SKIP
        >>> len(seen_ids(spark, table, 12, since))  # doctest: +SKIP
        4200
    """
    seen = SeenIds(complete_from=since)
    version = table.latest()
    if version < 0:
        return seen
    store, deliver, revision = pc.field("store_ts"), pc.field("deliver_ts"), pc.field("revision")
    at = pa.scalar(since, pa.timestamp("us", tz="UTC"))
    chosen = (
        (pc.field("stamp_batch") < batch_id)
        & (revision.is_null() | (revision == 0))
        & ((store >= at) | (deliver >= at))
    )
    rows = table.dataset(version).to_table(
        columns=[ID_HASH, "store_ts", "deliver_ts"], filter=chosen
    )
    if rows[ID_HASH].null_count:  # rows stamped by an older version: Spark hashes them
        older = (
            spark.read.format("delta")
            .option("versionAsOf", version)
            .load(table.path)
            .where(
                F.col(ID_HASH).isNull()
                & (F.col("stamp_batch") < batch_id)
                & (F.coalesce(F.col("revision"), F.lit(0)) == 0)
                & ((F.col("store_ts") >= F.lit(since)) | (F.col("deliver_ts") >= F.lit(since)))
            )
            .select(F.xxhash64("msg_id").alias(ID_HASH), "store_ts", "deliver_ts")
            .toArrow()
        )
        hashed = rows.filter(pc.is_valid(rows[ID_HASH]))
        rows = pa.concat_tables([hashed, older.cast(rows.schema)])
    seen.add(np.asarray(rows[ID_HASH].to_numpy(), dtype=np.int64), taken_until(rows))
    return seen


def highest_batch(spark: SparkSession, path: str) -> int:
    """The highest ``stamp_batch`` in a table (-1 when empty); Delta answers from file stats."""
    row = spark.read.format("delta").load(path).agg(F.max("stamp_batch")).first()
    return -1 if row is None or row[0] is None else int(row[0])
