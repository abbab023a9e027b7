"""Start-up checks and repairs of the delivery stage, run by the engine before its first round.

* the stamping and delivery checkpoints must match the tables they guard (a lost checkpoint
  would stamp or deliver everything again: the engine refuses to start and says why);
* RocketMQ's ``correctDeliverTimestamp``: a row due later than its level now allows becomes
  due now.

Example:
    >>> check_checkpoints(spark, cfg, lay, progress, plan, stamped=True)  # doctest: +SKIP
    >>> now, floor = clock.now(), progress.watermark  # doctest: +SKIP
    >>> correct_deliver_timestamps(spark, cfg, lay, now, floor)  # doctest: +SKIP
    0
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import pyarrow as pa
import pyarrow.dataset as ds
from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.core.config import EngineConfig
from engine.core.errors import CheckpointError
from engine.deliver.checkpoint import Plan, Progress
from engine.deliver.due import TS
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.delta_log import (
    CONCURRENT_CHANGES,
    WRITE_ATTEMPTS,
    latest_version,
    list_topics,
)
from engine.lakehouse.storage.layout import Layout


def check_checkpoints(
    spark: SparkSession,
    cfg: EngineConfig,
    layout: Layout,
    progress: Progress,
    plan: Plan | None,
    stamped: bool,
) -> None:
    """Refuse to start when a checkpoint is missing but the tables it guards are not empty.

    Args:
        stamped: whether the stamping log says this lakehouse was stamped before.

    Raises:
        CheckpointError: saying which checkpoint is missing and what to do.
    """
    # Looks at the tables (their statistics) only when the stamping log is missing.
    tables = (layout.schedule, layout.quarantine)
    if not stamped and max(ArrowDelta(t).max_of("stamp_batch") for t in tables) >= 0:
        raise CheckpointError(
            f"{layout.schedule} holds stamped rows but the stamping checkpoint "
            f"{layout.checkpoint('stamp')} is missing: restore it, or start from an "
            "empty lakehouse (stamping again would schedule every message twice)"
        )
    fresh = progress.round < 0 and plan is None
    # Empty topic tables (made by a streaming consumer before any delivery) are fine.
    delivered = [
        name
        for name in (list_topics(cfg) if fresh else [])
        if not spark.read.format("delta").load(layout.topic(name)).isEmpty()
    ]
    if delivered:
        raise CheckpointError(
            f"topic tables exist under {layout.topics} but the delivery checkpoint "
            f"{layout.delay_offset} is empty: restore it, or start from an empty "
            "lakehouse (delivering again from the start would duplicate every message)"
        )


def correct_deliver_timestamps(
    spark: SparkSession, cfg: EngineConfig, layout: Layout, now: datetime, floor: datetime
) -> int:
    """RocketMQ's correctDeliverTimestamp, applied once at start.

    A waiting row whose ``deliver_ts`` is later than ``now`` + its level's *current* delay
    (the level table was shortened, or the clock moved back) becomes due now. Its new
    ``deliver_ts`` is ``max(now, floor + 1 ms)`` where ``floor`` is the committed watermark,
    so the next round is sure to pick it up.

    Returns:
        How many rows were corrected.
    """
    due_at = max(now, floor + timedelta(milliseconds=1))
    levels = cfg.levels
    limits = [
        (q, now + timedelta(milliseconds=levels.delay_ms(q))) for q in range(levels.max_level + 1)
    ]
    beyond = now + timedelta(milliseconds=levels.delay_ms(levels.max_level))
    if not _any_too_late(layout, limits, levels.max_level, beyond, floor):
        return 0  # the usual start: an Arrow look at the files' statistics, no Spark job
    too_late = F.lit(False)
    for queue_id, limit in limits:
        too_late = too_late | (
            (F.col("queue_id") == queue_id) & (F.col("deliver_ts") > F.lit(limit))
        )
    too_late = too_late | (
        (F.col("queue_id") > levels.max_level) & (F.col("deliver_ts") > F.lit(beyond))
    )
    # Rows at or below the committed watermark may be delivered already: never move them.
    too_late = too_late & (F.col("deliver_ts") > F.lit(floor))
    table = DeltaTable.forPath(spark, layout.schedule)
    before = latest_version(layout.schedule)
    for attempt in range(1, WRITE_ATTEMPTS + 1):
        try:
            table.update(condition=too_late, set={"deliver_ts": F.lit(due_at)})
            break
        except CONCURRENT_CHANGES:
            # `delayq maintain` compacted or pruned the same files: nothing was committed,
            # and the update finds the same rows again.
            if attempt == WRITE_ATTEMPTS:
                raise
            time.sleep(0.5 * attempt)
    last = table.history(1).select("version", "operation", "operationMetrics").first()
    if last is None or last["version"] == before or last["operation"] != "UPDATE":
        return 0
    return int(last["operationMetrics"].get("numUpdatedRows", "0"))


def _any_too_late(
    layout: Layout,
    limits: list[tuple[int, datetime]],
    max_level: int,
    beyond: datetime,
    floor: datetime,
) -> bool:
    """Whether any ``schedule`` row is due later than its level allows (and after ``floor``):
    the same condition as the update's, read with delta-rs; files whose statistics rule it
    out are skipped, so a backlog of far-ahead timers (queue -1) costs nothing."""
    table = ArrowDelta(layout.schedule)
    version = table.latest()
    if version < 0:
        return False
    queue, deliver = ds.field("queue_id"), ds.field("deliver_ts")
    too_late = (queue > max_level) & (deliver > pa.scalar(beyond, TS))
    for queue_id, limit in limits:
        too_late = too_late | ((queue == queue_id) & (deliver > pa.scalar(limit, TS)))
    too_late = too_late & (deliver > pa.scalar(floor, TS))
    return bool(table.dataset(version).count_rows(filter=too_late) > 0)
