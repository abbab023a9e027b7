"""Dead letters: list, show with history, resend to the original topic, purge.

A group's dead letters are the topic table ``dlq_<group>`` (queryable as
``<database>.dlq_<group>``). Resending sends a new message to the original topic, not
delayed, with ``ORIGIN_MESSAGE_ID`` and ``DLQ_MSG_ID`` set; a dead letter already resent is
skipped unless ``again``. Purging deletes rows from the dead-letter table (Delta keeps the
old versions until ``VACUUM``).

Example:
    >>> dead_letters(spark, cfg, "billing").show()  # doctest: +SKIP
    >>> resend(spark, cfg, "billing", key="order-7")  # doctest: +SKIP
    ['5D0E...']
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.consume.lag import groups_hint
from engine.core.clock import Clock
from engine.core.config import EngineConfig
from engine.core.errors import ConsumerError
from engine.core.message import (
    ENGINE_PROPERTIES,
    PROP_DLQ_MSG_ID,
    PROP_DLQ_REASON,
    PROP_FAILURES,
    PROP_ORIGIN_MESSAGE_ID,
    PROP_RECONSUME_TIME,
    PROP_RETRY_TOPIC,
    Message,
)
from engine.core.topics import check_group, dlq_topic
from engine.lakehouse.storage.layout import layout
from engine.produce.send import send_many


def _table(spark: SparkSession, cfg: EngineConfig, group: str) -> DataFrame:
    path = layout(cfg).topic(dlq_topic(check_group(group)))
    if not DeltaTable.isDeltaTable(spark, path):
        raise ConsumerError(
            f"consumer group {group!r} has no dead letters ({path} does not exist; "
            f"{groups_hint(spark, cfg)})"
        )
    return spark.read.format("delta").load(path)


def _resent(spark: SparkSession, cfg: EngineConfig) -> DataFrame:
    """``msg_id`` of every dead letter resent so far."""
    log = spark.read.format("delta").load(layout(cfg).commitlog)
    return (
        log.where(F.col("properties")[PROP_DLQ_MSG_ID].isNotNull())
        .select(F.col("properties")[PROP_DLQ_MSG_ID].alias("msg_id"))
        .distinct()
        .withColumn("resent", F.lit(True))
    )


def dead_letters(spark: SparkSession, cfg: EngineConfig, group: str) -> DataFrame:
    """The group's dead letters, newest first.

    Columns: ``msg_id``, ``topic`` (the original), ``origin_msg_id``, ``keys``, ``body``
    (text), ``reason``, ``reconsume_times``, ``died_ts``, ``resent``.

    Raises:
        ConsumerError: when the group has no dead-letter table.
    """
    props = F.col("properties")
    return (
        _table(spark, cfg, group)
        .join(_resent(spark, cfg), "msg_id", "left")
        .select(
            "msg_id",
            props[PROP_RETRY_TOPIC].alias("topic"),
            props[PROP_ORIGIN_MESSAGE_ID].alias("origin_msg_id"),
            F.array_join("keys", " ").alias("keys"),
            F.col("body").cast("string").alias("body"),
            props[PROP_DLQ_REASON].alias("reason"),
            (props[PROP_RECONSUME_TIME].cast("int") - 1).alias("reconsume_times"),
            F.col("delivered_ts").alias("died_ts"),
            F.coalesce(F.col("resent"), F.lit(False)).alias("resent"),
        )
        .orderBy(F.col("died_ts").desc(), "msg_id")
    )


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter, with its history of failures."""

    msg_id: str
    topic: str
    origin_msg_id: str
    keys: list[str]
    body: bytes
    properties: dict[str, str]
    reason: str
    failures: list[dict[str, Any]]
    died_ts: Any

    def lines(self) -> list[str]:
        """A readable description, one line per field and per failure."""
        user = {k: v for k, v in self.properties.items() if k not in ENGINE_PROPERTIES}
        out = [
            f"dead letter   {self.msg_id}",
            f"topic         {self.topic}",
            f"first sent as {self.origin_msg_id}",
            f"keys          {' '.join(self.keys)}",
            f"body          {self.body.decode('utf-8', errors='replace')[:200]}",
            f"properties    {json.dumps(user)}",
            f"reason        {self.reason}",
            f"died          {self.died_ts}",
            f"history       {len(self.failures)} failures",
        ]
        out += [
            f"  attempt {f.get('attempt')}  {f.get('at')}  group {f.get('group')}: "
            f"{f.get('reason')}"
            for f in self.failures
        ]
        return out


def show(spark: SparkSession, cfg: EngineConfig, group: str, msg_id: str) -> DeadLetter:
    """One dead letter by its id (or the id it was first sent with).

    Raises:
        ConsumerError: when no dead letter of the group has that id.
    """
    props = F.col("properties")
    rows = (
        _table(spark, cfg, group)
        .where((F.col("msg_id") == msg_id) | (props[PROP_ORIGIN_MESSAGE_ID] == msg_id))
        .collect()
    )
    if not rows:
        raise ConsumerError(f"no dead letter {msg_id!r} in group {group!r}")
    row = rows[0]
    properties = dict(row["properties"] or {})
    return DeadLetter(
        msg_id=row["msg_id"],
        topic=properties.get(PROP_RETRY_TOPIC, ""),
        origin_msg_id=properties.get(PROP_ORIGIN_MESSAGE_ID, row["msg_id"]),
        keys=list(row["keys"] or []),
        body=bytes(row["body"] or b""),
        properties=properties,
        reason=properties.get(PROP_DLQ_REASON, ""),
        failures=json.loads(properties.get(PROP_FAILURES, "[]")),
        died_ts=row["delivered_ts"],
    )


def _select(
    df: DataFrame, msg_id: str | None, key: str | None, everything: bool, action: str
) -> DataFrame:
    chosen = [x for x in (msg_id, key) if x is not None]
    if len(chosen) + everything != 1:
        raise ConsumerError(f"{action}: give exactly one of an id, a key, or all")
    if msg_id is not None:
        return df.where(
            (F.col("msg_id") == msg_id) | (F.col("properties")[PROP_ORIGIN_MESSAGE_ID] == msg_id)
        )
    if key is not None:
        return df.where(F.array_contains("keys", key))
    return df


def resend(
    spark: SparkSession,
    cfg: EngineConfig,
    group: str,
    *,
    msg_id: str | None = None,
    key: str | None = None,
    everything: bool = False,
    again: bool = False,
    clock: Clock | None = None,
) -> list[str]:
    """Send dead letters back to their original topic, now; return the new ids.

    Give one of ``msg_id``, ``key`` or ``everything``. The new message keeps body, keys,
    tags and user properties, and starts again with reconsumeTimes 0.

    Raises:
        ConsumerError: when nothing matches, or the selection is ambiguous.
    """
    chosen = _select(_table(spark, cfg, group), msg_id, key, everything, "resend")
    if not again:
        chosen = chosen.join(_resent(spark, cfg), "msg_id", "left_anti")
    rows = chosen.orderBy("delivery_round", "deliver_ts", "msg_id").collect()
    if not rows:
        what = msg_id or key or "any"
        raise ConsumerError(
            f"no dead letter to resend for {what!r} in group {group!r}"
            + ("" if again else " (already resent ones are skipped: pass again)")
        )
    messages = []
    for row in rows:
        props = dict(row["properties"] or {})
        user = {k: v for k, v in props.items() if k not in ENGINE_PROPERTIES}
        user[PROP_ORIGIN_MESSAGE_ID] = props.get(PROP_ORIGIN_MESSAGE_ID, row["msg_id"])
        user[PROP_DLQ_MSG_ID] = row["msg_id"]
        messages.append(
            Message(
                topic=props.get(PROP_RETRY_TOPIC, ""),
                body=bytes(row["body"] or b""),
                keys=list(row["keys"] or []),
                tags=row["tags"],
                properties=user,
            )
        )
    return send_many(spark, cfg, messages, clock, engine=True)


def purge(
    spark: SparkSession,
    cfg: EngineConfig,
    group: str,
    *,
    msg_id: str | None = None,
    everything: bool = False,
) -> int:
    """Delete dead letters (one by id, or all); return how many were deleted."""
    chosen = _select(_table(spark, cfg, group), msg_id, None, everything, "purge")
    count = chosen.count()
    if not count:
        raise ConsumerError(f"no dead letter {msg_id!r} in group {group!r}")
    table = DeltaTable.forPath(spark, layout(cfg).topic(dlq_topic(check_group(group))))
    if everything:
        table.delete()
    else:
        wanted = F.lit(msg_id)
        table.delete(
            (F.col("msg_id") == wanted) | (F.col("properties")[PROP_ORIGIN_MESSAGE_ID] == wanted)
        )
    return count
