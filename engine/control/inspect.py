"""What is scheduled, what comes due, and what happened to a message.

Everything here reads; nothing writes. "Pending" means stamped, not yet delivered by
the committed progress (``deliver_ts > watermark OR stamp_batch > stamp high mark``), and
not cancelled or moved by a command (see :mod:`engine.deliver.commands`).
Messages sent but not yet stamped are in ``commitlog`` only (``Status.unstamped``).

Example:
    >>> pending(spark, cfg).where("topic = 'orders'").show()        # doctest: +SKIP
    >>> forecast(spark, cfg, now).show()                            # doctest: +SKIP
    >>> history(spark, cfg, key="order-1").show(truncate=False)     # doctest: +SKIP
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from engine.core.config import EngineConfig
from engine.core.errors import DelayQError
from engine.deliver.checkpoint import Progress, read_checkpoint
from engine.deliver.commands import REMOVING, RESCHEDULED
from engine.deliver.rates import cursors
from engine.lakehouse.delta.delta_log import list_topics
from engine.lakehouse.storage.layout import layout
from engine.stamp.dedup import DUPLICATE


def pending(spark: SparkSession, cfg: EngineConfig, progress: Progress | None = None) -> DataFrame:
    """``schedule`` rows not yet delivered nor cancelled (same columns as ``schedule``)."""
    lay = layout(cfg)
    if progress is None:
        progress, _ = read_checkpoint(spark, lay)
    removed = (
        spark.read.format("delta")
        .load(lay.command_results)
        .where(F.col("result").isin(*REMOVING))
        .select(F.col("msg_id").alias("_rm_id"), F.col("revision").alias("_rm_rev"))
    )
    rows = spark.read.format("delta").load(lay.schedule)
    match = (F.col("msg_id") == F.col("_rm_id")) & (
        F.coalesce(F.col("revision"), F.lit(0)) == F.col("_rm_rev")
    )
    waiting = F.lit(False)
    for topic, (us, msg_id, rev) in cursors(progress.rates).items():
        at = F.unix_micros(F.col("deliver_ts"))
        above = (at > F.lit(us)) | (
            (at == F.lit(us))
            & (
                (F.col("msg_id") > F.lit(msg_id))
                | ((F.col("msg_id") == F.lit(msg_id)) & (F.coalesce("revision", F.lit(0)) > rev))
            )
        )
        waiting = waiting | ((F.lower("topic") == F.lit(topic)) & above)
    return rows.where(
        (F.col("deliver_ts") > F.lit(progress.watermark))
        | (F.col("stamp_batch") > F.lit(progress.stamp_batch))
        | waiting  # (due, held back by the topic's rate cap)
    ).join(F.broadcast(removed), match, "left_anti")


def forecast(spark: SparkSession, cfg: EngineConfig, now: datetime, minutes: int = 60) -> DataFrame:
    """Pending messages per minute over the next ``minutes`` (overdue ones in ``now``'s minute),
    by when they will be delivered: rows waiting for their topic's rate cap at the cap (the
    n-th of a topic's waiting rows n / cap after the cap lets its next one go).

    Returns:
        ``minute`` (start of the minute, UTC) and ``due`` (count), in time order.
    """
    horizon = now + timedelta(minutes=minutes)
    progress, _ = read_checkpoint(spark, layout(cfg))
    rows = pending(spark, cfg, progress).withColumn("_at", F.col("deliver_ts"))
    capped = {t: r for t, r in progress.rates.items() if r.cursor is not None and r.rate}
    if capped:
        topic = F.lower("topic")
        waits = topic.isin(*capped) & (F.col("deliver_ts") <= F.lit(progress.watermark))
        order = Window.partitionBy(topic, waits).orderBy(
            "deliver_ts", "msg_id", F.coalesce("revision", F.lit(0))
        )
        nth = F.row_number().over(order) - 1
        start = F.create_map(*[F.lit(x) for t, r in capped.items() for x in (t, r.tat_ns / 1e9)])
        rate = F.create_map(*[F.lit(x) for t, r in capped.items() for x in (t, r.rate)])
        at_cap = F.timestamp_seconds(start[topic] + nth / rate[topic])
        rows = rows.withColumn("_at", F.when(waits, at_cap).otherwise(F.col("deliver_ts")))
    rows = rows.where(F.col("_at") < F.lit(horizon))
    minute = F.date_trunc("minute", F.greatest(F.col("_at"), F.lit(now)))
    return (
        rows.groupBy(minute.alias("minute")).agg(F.count(F.lit(1)).alias("due")).orderBy("minute")
    )


def history(
    spark: SparkSession, cfg: EngineConfig, msg_id: str | None = None, key: str | None = None
) -> DataFrame:
    """Every event of a message (or of all messages with a key), in time order.

    Events: ``sent`` (stored in ``commitlog``), ``stamped`` (with its queue and deliver
    time; a reschedule's new row shows as ``stamped`` with its revision), ``quarantined``
    (with the reason), ``duplicate`` (a later copy of a message id already stamped: not
    delivered again), what a command decided (``cancelled``, ``rescheduled``,
    ``already_delivered``, ...) and ``delivered`` (with the topic table).

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

    # Events at the same instant keep their logical order: sent, then per revision
    # stamped before what a command decided about it, delivered last.
    revision = 2 * F.coalesce(F.col("revision"), F.lit(0))

    def events(
        path: str, event: Column, at: str, detail: Column, seq: Column, where: Column = match
    ) -> DataFrame:
        return (
            spark.read.format("delta")
            .load(path)
            .where(where)
            .select(
                "msg_id",
                event.alias("event"),
                F.col(at).alias("at"),
                "topic",
                detail.cast("string").alias("detail"),
                seq.alias("_seq"),
            )
        )

    parts = [
        events(lay.commitlog, F.lit("sent"), "store_ts", _asked(), F.lit(0)),
        events(lay.schedule, F.lit("stamped"), "stamped_ts", _stamped(), 1 + revision),
        events(lay.quarantine, _refused(), "quarantined_ts", F.col("reason"), F.lit(1)),
    ]
    ids = sorted({r["msg_id"] for r in parts[0].select("msg_id").collect() if r["msg_id"]})
    by_id = F.col("msg_id").isin(ids)
    parts.append(
        events(lay.command_results, F.col("result"), "decided_ts", _decided(), 2 + revision, by_id)
    )
    topics = {
        r["topic"].lower() for r in parts[0].select("topic").distinct().collect() if r["topic"]
    }
    for name in sorted(topics & set(list_topics(cfg))):
        detail = F.concat(F.lit(f"{cfg.database}.{name}, round "), F.col("delivery_round"))
        delivered = events(lay.topic(name), F.lit("delivered"), "delivered_ts", detail, F.lit(1e9))
        parts.append(delivered)
    result = parts[0]
    for part in parts[1:]:
        result = result.unionByName(part)
    return result.orderBy("msg_id", "at", "_seq").drop("_seq")


def _refused() -> Column:
    # A later copy of a message id already stamped is a duplicate, not bad input.
    duplicate = F.col("reason").startswith(DUPLICATE)
    return F.when(duplicate, F.lit("duplicate")).otherwise(F.lit("quarantined"))


def _asked() -> Column:
    return (
        F.when(F.col("deliver_at").isNotNull(), F.concat(F.lit("deliver at "), F.col("deliver_at")))
        .when(F.col("delay_level") > 0, F.concat(F.lit("delay level "), F.col("delay_level")))
        .otherwise(F.lit("not delayed"))
    )


def _stamped() -> Column:
    text = F.concat(F.lit("queue "), F.col("queue_id"), F.lit(", due "), F.col("deliver_ts"))
    revision = F.coalesce(F.col("revision"), F.lit(0))
    return F.when(revision > 0, F.concat(text, F.lit(", revision "), revision)).otherwise(text)


def _decided() -> Column:
    command = F.concat(F.lit("command "), F.col("command_id"), F.lit(", round "), F.col("round"))
    moved = F.concat(
        F.lit("to "), F.col("new_deliver_ts"), F.lit(" (revision "), F.col("new_revision"),
        F.lit("), "), command,
    )  # fmt: skip
    return (
        F.when(F.col("result") == RESCHEDULED, moved)
        .when(F.col("detail").isNotNull(), F.concat(F.col("detail"), F.lit(", "), command))
        .otherwise(command)
    )
