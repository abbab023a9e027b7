"""What is scheduled, what comes due, and what happened to a message.

Everything here reads; nothing writes. "Pending" means stamped and not yet delivered by
the committed progress: ``deliver_ts > watermark OR stamp_batch > stamp high mark``.
Messages sent but not yet stamped are in ``commitlog`` only (``Status.unstamped``).

Example:
    >>> pending(spark, cfg).where("topic = 'orders'").show()        # doctest: +SKIP
    >>> forecast(spark, cfg, now).show()                            # doctest: +SKIP
    >>> history(spark, cfg, key="order-1").show(truncate=False)     # doctest: +SKIP
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.config import EngineConfig
from engine.delivery import Progress, read_checkpoint
from engine.errors import DelayQError
from engine.tables import layout, list_topics


def pending(spark: SparkSession, cfg: EngineConfig, progress: Progress | None = None) -> DataFrame:
    """``schedule`` rows not yet delivered (same columns as ``schedule``)."""
    lay = layout(cfg)
    if progress is None:
        progress, _ = read_checkpoint(spark, lay)
    return (
        spark.read.format("delta")
        .load(lay.schedule)
        .where(
            (F.col("deliver_ts") > F.lit(progress.watermark))
            | (F.col("stamp_batch") > F.lit(progress.stamp_batch))
        )
    )


def forecast(spark: SparkSession, cfg: EngineConfig, now: datetime, minutes: int = 60) -> DataFrame:
    """Pending messages per minute over the next ``minutes`` (overdue ones in ``now``'s minute).

    Returns:
        ``minute`` (start of the minute, UTC) and ``due`` (count), in time order.
    """
    horizon = now + timedelta(minutes=minutes)
    rows = pending(spark, cfg).where(F.col("deliver_ts") < F.lit(horizon))
    minute = F.date_trunc("minute", F.greatest(F.col("deliver_ts"), F.lit(now)))
    return (
        rows.groupBy(minute.alias("minute")).agg(F.count(F.lit(1)).alias("due")).orderBy("minute")
    )


def history(
    spark: SparkSession, cfg: EngineConfig, msg_id: str | None = None, key: str | None = None
) -> DataFrame:
    """Every event of a message (or of all messages with a key), in time order.

    Events: ``sent`` (stored in ``commitlog``), ``stamped`` (with its queue and deliver
    time), ``quarantined`` (with the reason) and ``delivered`` (with the topic table).

    Raises:
        DelayQError: when neither or both of ``msg_id`` and ``key`` are given.
    """
    if (msg_id is None) == (key is None):
        raise DelayQError("history needs a message id or a key (one of them)")
    match = (
        F.col("msg_id") == F.lit(msg_id)
        if msg_id is not None
        else F.array_contains(F.col("keys"), F.lit(key))
    )
    lay = layout(cfg)

    def events(path: str, event: str, at: str, detail: Column) -> DataFrame:
        return (
            spark.read.format("delta")
            .load(path)
            .where(match)
            .select(
                "msg_id",
                F.lit(event).alias("event"),
                F.col(at).alias("at"),
                "topic",
                detail.cast("string").alias("detail"),
            )
        )

    parts = [
        events(lay.commitlog, "sent", "store_ts", _asked()),
        events(lay.schedule, "stamped", "stamped_ts", _stamped()),
        events(lay.quarantine, "quarantined", "quarantined_ts", F.col("reason")),
    ]
    topics = {
        r["topic"].lower() for r in parts[0].select("topic").distinct().collect() if r["topic"]
    }
    for name in sorted(topics & set(list_topics(spark, cfg))):
        detail = F.concat(F.lit(f"{cfg.database}.{name}, round "), F.col("delivery_round"))
        parts.append(events(lay.topic(name), "delivered", "delivered_ts", detail))
    result = parts[0]
    for part in parts[1:]:
        result = result.unionByName(part)
    order = F.when(F.col("event") == "sent", 0).when(F.col("event") == "delivered", 2).otherwise(1)
    return result.orderBy("msg_id", "at", order)


def _asked() -> Column:
    return (
        F.when(F.col("deliver_at").isNotNull(), F.concat(F.lit("deliver at "), F.col("deliver_at")))
        .when(F.col("delay_level") > 0, F.concat(F.lit("delay level "), F.col("delay_level")))
        .otherwise(F.lit("not delayed"))
    )


def _stamped() -> Column:
    return F.concat(F.lit("queue "), F.col("queue_id"), F.lit(", due "), F.col("deliver_ts"))
