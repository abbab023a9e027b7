"""The delayOffset checkpoint as data: per-queue progress, a round's plan, and their rows.

The committed :class:`Progress` says what has been delivered; a :class:`Plan` written before
a round's first write fixes what that round delivers, so a replay after a crash delivers
exactly the same rows. Both are stored as ``DELAY_OFFSET`` rows in the offset log
(:class:`~engine.lakehouse.state.offset_log.OffsetLog`).

Example:
    >>> progress, plan = read_checkpoint(spark, lay)  # doctest: +SKIP
    >>> progress.round, plan  # doctest: +SKIP
    (41, None)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.core.clock import EPOCH
from engine.deliver.rates import TopicRate, state_json, state_of
from engine.lakehouse.state.offset_log import OffsetLog
from engine.lakehouse.storage.layout import Layout

COMMITTED = "committed"
PLANNED = "planned"
#: Committed rounds kept in the offset log (older files are deleted).
RETAIN_ROUNDS = 1000


@dataclass(frozen=True)
class QueueProgress:
    """One queue's progress: rows stamped and delivered so far, up to which deliver time.

    ``stamped_total - delivered_total - cancelled_total`` is what the queue holds, known
    without a scan (a reschedule counts as a cancel in the old row's queue and a new row
    stamped in the timer queue; ``rescheduled_total`` counts those new rows).
    """

    delivered_total: int = 0
    last_deliver_ts: datetime | None = None
    stamped_total: int = 0
    cancelled_total: int = 0
    rescheduled_total: int = 0


@dataclass(frozen=True)
class Progress:
    """The committed delayOffset checkpoint.

    Attributes:
        checkpoint_id: identifies this checkpoint; part of the topic writes' ``txnAppId``.
        round: the last committed round (-1 before the first).
        watermark: every row with ``deliver_ts <= watermark`` and ``stamp_batch <=
            stamp_batch`` has been delivered.
        schedule_version: the ``schedule`` version the last round read.
        stamp_batch: the highest stamping batch the last round saw.
        queues: per-queue progress.
        commands_version: the ``commands`` version the last round read.
        rates: the capped topics' state (:mod:`engine.deliver.rates`): a topic with a
            cursor has rows due by ``watermark`` still waiting.
    """

    checkpoint_id: str
    round: int = -1
    watermark: datetime = EPOCH
    schedule_version: int = -1
    stamp_batch: int = -1
    queues: Mapping[int, QueueProgress] = field(default_factory=dict)
    commands_version: int = -1
    rates: Mapping[str, TopicRate] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """What round ``round`` delivers: rows due by ``watermark`` in ``schedule_version``.

    ``commands_version`` pins the cancel/reschedule commands the round applies, ``caps``
    the delivery rate caps (:meth:`~engine.core.config.EngineConfig.rates`).
    """

    round: int
    watermark: datetime
    schedule_version: int
    commands_version: int = -1
    caps: Mapping[str, float] = field(default_factory=dict)


def _ts(value: object) -> datetime | None:
    if value is None:
        return None
    parsed = datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def read_checkpoint(spark: SparkSession, layout: Layout) -> tuple[Progress, Plan | None]:
    """Load the committed progress and a pending plan (if a round was interrupted)."""
    last, rows, plan_rows = OffsetLog(layout.delay_offset).latest()
    checkpoint_id = (rows or plan_rows or [{}])[0].get("checkpoint_id") or uuid.uuid4().hex
    progress = Progress(checkpoint_id=checkpoint_id)
    if last is not None and rows:
        head = rows[0]
        progress = replace(
            progress,
            round=int(head["round"]),
            watermark=_ts(head["watermark"]) or EPOCH,
            schedule_version=int(head["schedule_version"]),
            stamp_batch=int(head["stamp_batch"]),
            queues={
                int(r["queue_id"]): QueueProgress(
                    int(r["delivered_total"]),
                    _ts(r["last_deliver_ts"]),
                    int(r.get("stamped_total") or 0),
                    int(r.get("cancelled_total") or 0),
                    int(r.get("rescheduled_total") or 0),
                )
                for r in rows
                if r.get("queue_id") is not None
            },
            commands_version=_int(head.get("commands_version"), -1),
            rates=state_of(head.get("rates")),
        )
    plan = None
    if plan_rows:
        p = plan_rows[0]
        plan = Plan(
            int(p["round"]),
            _ts(p["watermark"]) or EPOCH,
            int(p["schedule_version"]),
            _int(p.get("commands_version"), progress.commands_version),
            _caps(p.get("rates")),
        )
    return progress, plan


def _caps(text: object) -> dict[str, float]:
    """A plan's rate caps from its ``rates`` column."""
    caps = json.loads(str(text)).get("caps", {}) if text else {}
    return {str(t): float(r) for t, r in caps.items()}


def _int(value: object, default: int) -> int:
    return default if value is None else int(str(value))


def checkpoint_rows(
    progress: Progress, plan: Plan | None, delivered: Mapping[int, int], now: datetime
) -> list[dict[str, object]]:
    """The ``DELAY_OFFSET`` rows of a committed round, or of a plan (one row)."""
    common = {
        "checkpoint_id": progress.checkpoint_id,
        "stamp_batch": progress.stamp_batch,
        "updated_ts": now.isoformat(),
    }
    rates = state_json(progress.rates)
    if plan is not None:
        return [
            {
                **common, "status": PLANNED, "queue_id": None, "round": plan.round,
                "watermark": plan.watermark.isoformat(), "schedule_version": plan.schedule_version,
                "delivered": 0, "delivered_total": 0, "last_deliver_ts": None,
                "stamped_total": 0, "cancelled_total": 0, "rescheduled_total": 0,
                "commands_version": plan.commands_version,
                "rates": json.dumps({"caps": dict(plan.caps)}) if plan.caps else None,
            }
        ]  # fmt: skip
    return [
        {
            **common, "status": COMMITTED, "queue_id": queue_id, "round": progress.round,
            "watermark": progress.watermark.isoformat(),
            "schedule_version": progress.schedule_version,
            "delivered": delivered.get(queue_id, 0), "delivered_total": q.delivered_total,
            "stamped_total": q.stamped_total, "cancelled_total": q.cancelled_total,
            "rescheduled_total": q.rescheduled_total,
            "commands_version": progress.commands_version,
            "last_deliver_ts": q.last_deliver_ts.isoformat() if q.last_deliver_ts else None,
            "rates": rates,
        }
        for queue_id, q in sorted(progress.queues.items())
    ]  # fmt: skip


def count_stamped(spark: SparkSession, layout: Layout, progress: Progress) -> Progress:
    """Fill ``stamped_total`` from ``schedule`` (once, for a checkpoint written before it)."""
    counts = (
        spark.read.format("delta")
        .option("versionAsOf", progress.schedule_version)
        .load(layout.schedule)
        .where(F.col("stamp_batch") <= progress.stamp_batch)
        .groupBy("queue_id")
        .count()
        .collect()
    )
    queues = dict(progress.queues)
    for r in counts:
        queues[r["queue_id"]] = replace(
            queues.get(r["queue_id"], QueueProgress()), stamped_total=int(r["count"])
        )
    return replace(progress, queues=queues)
