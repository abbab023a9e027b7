"""The retry policy, as pure transforms: what a failed message becomes.

A failed (nacked) message goes back through ``commitlog`` to ``retry_<group>`` with delay
level 3 + reconsumeTimes (RocketMQ's ``10s 30s 1m ... 2h``) or the group's own
``retry_delays``, and reconsumeTimes + 1. One that already came back
``max_reconsume_times`` times goes to ``dlq_<group>`` instead, with the reason and its
history of failures in its properties. Both are ordinary topic tables.

Example:
    >>> failed = consumer_columns(nacked_rows)  # doctest: +SKIP
    >>> rows = sendback_rows(failed, "billing", cfg.group("billing"), now)  # doctest: +SKIP
    >>> rows.select("kind", "sendback.topic").show()  # doctest: +SKIP
"""

from __future__ import annotations

from datetime import datetime

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from engine.core.config import RETRY_FIRST_LEVEL, EngineConfig, GroupConfig
from engine.core.errors import ConfigError
from engine.core.message import (
    ENGINE_PROPERTIES,
    FAILURES_TYPE,
    PROP_DLQ_REASON,
    PROP_FAILURES,
    PROP_ORIGIN_MESSAGE_ID,
    PROP_RECONSUME_TIME,
    PROP_RETRY_TOPIC,
)
from engine.core.topics import RETRY_PREFIX, dlq_topic, retry_topic
from schemas import COMMITLOG


def consumer_columns(df: DataFrame) -> DataFrame:
    """Add what a consumer sees to topic rows that carry a ``table`` column.

    ``real_topic`` is the original topic (from ``RETRY_TOPIC`` for a retried message),
    ``reconsume_times`` and ``origin_msg_id`` come from the engine's properties.
    """
    props = F.col("properties")
    # Only the engine writes retry tables: elsewhere these are a producer's own properties.
    retried = F.col("table").startswith(RETRY_PREFIX)
    return df.select(
        *[F.col(c) for c in df.columns],
        F.coalesce(F.when(retried, props[PROP_RETRY_TOPIC]), F.col("topic")).alias("real_topic"),
        F.coalesce(F.when(retried, props[PROP_RECONSUME_TIME].try_cast("int")), F.lit(0)).alias(
            "reconsume_times"
        ),
        F.coalesce(props[PROP_ORIGIN_MESSAGE_ID], F.col("msg_id")).alias("origin_msg_id"),
    )


def sendback_rows(failed: DataFrame, group: str, settings: GroupConfig, now: datetime) -> DataFrame:
    """The ``commitlog`` rows that send failed messages back, with ``kind`` and ``reason``.

    Pure over ``failed`` (rows of :func:`consumer_columns` plus ``reason``, one per
    ``msg_id``): a message
    that came back fewer than ``max_reconsume_times`` times goes to ``retry_<group>``,
    due after its retry delay; others go to ``dlq_<group>`` at once. A non-null
    ``delay_ms`` column (a nack with its own delay) makes either due that long after
    ``now``. Ids are derived from (group, message, attempt), so computing this twice gives
    the same rows.
    """
    n = F.col("reconsume_times")
    dead = n >= F.lit(settings.max_reconsume_times)
    now_lit = F.lit(now).cast("timestamp")
    failure = F.struct(
        F.lit(group).alias("group"),
        n.alias("attempt"),
        F.coalesce(F.col("reason"), F.lit("")).alias("reason"),
        F.lit(now.isoformat()).alias("at"),
    )
    earlier = F.from_json(F.col("properties")[PROP_FAILURES], FAILURES_TYPE)
    history = F.when(earlier.isNull(), F.array(failure)).otherwise(
        F.concat(earlier, F.array(failure))
    )
    user_props = F.map_filter(
        F.coalesce(F.col("properties"), F.create_map().cast("map<string,string>")),
        lambda k, _v: ~k.isin(*ENGINE_PROPERTIES),
    )
    engine_props = F.create_map(
        F.lit(PROP_RETRY_TOPIC), F.col("real_topic"),
        F.lit(PROP_ORIGIN_MESSAGE_ID), F.col("origin_msg_id"),
        F.lit(PROP_RECONSUME_TIME), (n + 1).cast("string"),
        F.lit(PROP_FAILURES), F.to_json(history),
    )  # fmt: skip
    dead_props = F.create_map(F.lit(PROP_DLQ_REASON), F.coalesce(F.col("reason"), F.lit("")))
    properties = F.when(dead, F.map_concat(user_props, engine_props, dead_props)).otherwise(
        F.map_concat(user_props, engine_props)
    )
    level: Column = F.lit(None).cast("int")
    deliver_at: Column = F.lit(None).cast("timestamp")
    if settings.retry_delays is None:
        level = F.when(~dead, n + RETRY_FIRST_LEVEL)
    else:
        delays = F.array(*[F.lit(ms) for ms in settings.retry_delays])
        delay_ms = F.element_at(delays, F.least(n, F.lit(len(settings.retry_delays) - 1)) + 1)
        deliver_at = F.when(~dead, F.timestamp_millis(F.unix_millis(now_lit) + delay_ms))
    if "delay_ms" in failed.columns:  # a nack with its own delay: retry or dead after it
        own = F.col("delay_ms").isNotNull()
        level = F.when(~own, level)
        deliver_at = F.when(
            own, F.timestamp_millis(F.unix_millis(now_lit) + F.col("delay_ms"))
        ).otherwise(deliver_at)
    target = F.when(dead, F.lit(dlq_topic(group))).otherwise(F.lit(retry_topic(group)))
    new_id = F.upper(
        F.md5(F.concat_ws(":", F.lit(group), F.col("msg_id"), n.cast("string"), target))
    )
    message = {
        "msg_id": new_id,
        "topic": target,
        "keys": F.col("keys"),
        "tags": F.col("tags"),
        "properties": properties,
        "body": F.col("body"),
        "delay_level": level,
        "born_ts": F.col("born_ts"),
        "store_ts": now_lit,
        "deliver_at": deliver_at,
    }
    # keys keep their type (a cast cannot narrow containsNull).
    sendback = F.struct(
        *[
            (message[f.name] if f.name == "keys" else message[f.name].cast(f.dataType)).alias(
                f.name
            )
            for f in COMMITLOG
        ]
    )
    return failed.select(
        F.when(dead, F.lit("dead")).otherwise(F.lit("retry")).alias("kind"),
        F.col("table").alias("topic"),
        "delivery_round",
        "deliver_ts",
        "msg_id",
        F.col("reason"),
        sendback.alias("sendback"),
    )


def check_retry_delays(cfg: EngineConfig, group: str, settings: GroupConfig) -> None:
    """Fail at start when a retry delay exceeds what the engine accepts."""
    longest = max(settings.retry_delays or (0,))
    if longest > cfg.max_delay_ms:
        raise ConfigError(
            f"consumers.groups.{group}.retry_delays",
            settings.retry_delays,
            f"longer than messages.max_delay={cfg.max_delay_ms // 1000}s",
        )
