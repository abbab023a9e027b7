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

import hashlib
import json
from datetime import datetime, timedelta
from typing import Any

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


def sendback_record(
    failed: dict[str, Any],
    group: str,
    settings: GroupConfig,
    now: datetime,
) -> tuple[str, dict[str, Any]]:
    """One failed message's way back, as :func:`sendback_rows` computes it for a DataFrame:
    its ``kind`` (``retry`` or ``dead``) and its ``commitlog`` row.

    For a consumer that holds the failed messages on the driver (no Spark job). ``failed``
    has the topic row's columns (``msg_id``, ``keys``, ``tags``, ``properties``, ``body``,
    ``born_ts``), what a consumer sees (``real_topic``, ``reconsume_times``,
    ``origin_msg_id``), the ``reason`` and an optional ``delay_ms``.

    Example:
        >>> from datetime import UTC, datetime
        >>> row = {"msg_id": "M1", "keys": [], "tags": None, "properties": {}, "body": b"x",
        ...        "born_ts": None, "real_topic": "orders", "reconsume_times": 0,
        ...        "origin_msg_id": "M1", "reason": "down"}
        >>> kind, back = sendback_record(row, "billing", GroupConfig(),
        ...                              datetime(2026, 1, 1, tzinfo=UTC))
        >>> kind, back["topic"], back["delay_level"], back["properties"]["RECONSUME_TIME"]
        ('retry', 'retry_billing', 3, '1')
    """
    n = int(failed["reconsume_times"])
    dead = n >= settings.max_reconsume_times
    reason = failed.get("reason") or ""
    failure = {"group": group, "attempt": n, "reason": reason, "at": now.isoformat()}
    properties = {
        k: v for k, v in (failed.get("properties") or {}).items() if k not in ENGINE_PROPERTIES
    }
    properties[PROP_RETRY_TOPIC] = failed["real_topic"]
    properties[PROP_ORIGIN_MESSAGE_ID] = failed["origin_msg_id"]
    properties[PROP_RECONSUME_TIME] = str(n + 1)
    history = [*_failures((failed.get("properties") or {}).get(PROP_FAILURES)), failure]
    properties[PROP_FAILURES] = json.dumps(history, separators=(",", ":"), ensure_ascii=False)
    if dead:
        properties[PROP_DLQ_REASON] = reason
    level: int | None = None
    deliver_at: datetime | None = None
    own = failed.get("delay_ms")
    if own is not None:  # a nack with its own delay: retry or dead after it
        deliver_at = now + timedelta(milliseconds=int(own))
    elif dead:
        pass
    elif settings.retry_delays is None:
        level = n + RETRY_FIRST_LEVEL
    else:
        delays = settings.retry_delays
        deliver_at = now + timedelta(milliseconds=delays[min(n, len(delays) - 1)])
    target = dlq_topic(group) if dead else retry_topic(group)
    return ("dead" if dead else "retry"), {
        "msg_id": sendback_id(group, failed["msg_id"], n, target),
        "topic": target,
        "keys": list(failed.get("keys") or []),
        "tags": failed.get("tags"),
        "properties": properties,
        "body": failed.get("body"),
        "delay_level": level,
        "born_ts": failed.get("born_ts"),
        "store_ts": now,
        "deliver_at": deliver_at,
    }


def sendback_id(group: str, msg_id: str, attempt: int, target: str) -> str:
    """The id of the copy that sends ``msg_id`` back after failed attempt ``attempt`` (as
    :func:`sendback_rows` derives it): the same every time, so a send-back is never two.

    Example:
        >>> sendback_id("billing", "M1", 0, "retry_billing")
        '5B9EF3A16137E32223D95D8BE03152C6'
    """
    key = f"{group}:{msg_id}:{attempt}:{target}"
    return hashlib.md5(key.encode("utf-8")).hexdigest().upper()


def _failures(text: str | None) -> list[dict[str, Any]]:
    """An earlier failure history as ``from_json`` reads it with :data:`FAILURES_TYPE`
    (nothing when it is not a JSON array; a field of the wrong type is null) and
    ``to_json`` writes it back (null fields left out)."""
    try:
        found = json.loads(text) if text else None
    except ValueError:
        return []
    if not isinstance(found, list):
        return []
    types = {"group": str, "attempt": int, "reason": str, "at": str}
    out = []
    for item in found:
        if not isinstance(item, dict):
            continue
        out.append(
            {
                name: item[name]
                for name, kind in types.items()
                if isinstance(item.get(name), kind) and not isinstance(item.get(name), bool)
            }
        )
    return out


def check_retry_delays(cfg: EngineConfig, group: str, settings: GroupConfig) -> None:
    """Fail at start when a retry delay exceeds what the engine accepts."""
    longest = max(settings.retry_delays or (0,))
    if longest > cfg.max_delay_ms:
        raise ConfigError(
            f"consumers.groups.{group}.retry_delays",
            settings.retry_delays,
            f"longer than messages.max_delay={cfg.max_delay_ms // 1000}s",
        )
