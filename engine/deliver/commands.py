"""Cancel and reschedule, decided inside the delivery round (the resolver).

A client appends a command to ``commands`` (:mod:`engine.control.commands`). The delivery
stage, the only writer of progress, applies commands inside a round, from the same pinned
``schedule`` snapshot it delivers from. So a cancel and a delivery of one message are decided
in one place, once:

* the message's row is still pending: ``cancelled`` (or ``rescheduled``). The round writes
  the outcome *before* its topic writes and leaves the row out of them, and every later
  round leaves it out too;
* the row was delivered by an earlier round: ``already_delivered``. Nothing changes;
* the message is sent but not stamped yet: a command by id waits for it. An id that is not
  in ``commitlog`` (or was quarantined) answers ``not_found`` at once. A command by key
  applies to what is stamped when it runs.

A reschedule keeps the message id. It records the old row as ``rescheduled`` and appends a
copy to ``schedule`` with ``revision + 1``, queue -1 (timer) and the new deliver time (a time
already past is due in the next round). Nothing is deleted anywhere: ``commands``,
``command_results`` and every revision in ``schedule`` form the audit trail.

Each round's writes are idempotent (``txnAppId``/``txnVersion = round``) and a replayed
round recomputes the same outcomes from the same snapshots, so a crash never applies a
command twice. :func:`resolve` is a pure function of its inputs.

Example:
    >>> resolution = resolve(commands, rows, set(), (0, -1), 1, watermark_us, now)  # doctest: +SKIP
    >>> [r["result"] for r in resolution.results]  # doctest: +SKIP
    ['cancelled']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.core.clock import from_micros, from_millis
from engine.lakehouse.layout import Layout
from schemas import COMMAND_RESULTS, column_names

CANCEL = "cancel"
RESCHEDULE = "reschedule"
CANCELLED = "cancelled"
RESCHEDULED = "rescheduled"
ALREADY_DELIVERED = "already_delivered"
ALREADY_CANCELLED = "already_cancelled"
NOT_FOUND = "not_found"
#: No engine has answered yet (it is not running, or the wait was too short).
PENDING = "pending"
#: Outcomes that take a ``schedule`` row out of delivery.
REMOVING = (CANCELLED, RESCHEDULED)
#: The queue of rescheduled rows (they have an absolute deliver time, like timers).
RESCHEDULE_QUEUE = -1


@dataclass(frozen=True)
class Target:
    """A ``schedule`` row a command may touch (light columns only).

    ``deliver_us`` keeps ``deliver_ts`` to the microsecond (a ``deliver_at`` sent as a
    Spark timestamp may carry them): compared with a watermark, a truncated time could call
    a pending row delivered. ``source`` is the revision in the round's snapshot a row
    written by this round's reschedule copies its columns from.
    """

    msg_id: str
    revision: int
    topic: str | None
    keys: tuple[str, ...]
    queue_id: int
    deliver_us: int
    stamp_batch: int
    source: int | None = None


@dataclass(frozen=True)
class Resolution:
    """What a round decides for its open commands.

    Attributes:
        results: ``command_results`` rows to write.
        new_rows: ``(msg_id, source_revision, new_revision, new_deliver_ts)`` per row a
            reschedule appends to ``schedule``; the source is the snapshot row it copies.
        removed: ``(msg_id, revision)`` of rows taken out of delivery by this round.
        removed_per_queue: how many of them per queue.
        waiting: commands by id whose message is sent but not stamped yet.
    """

    results: list[dict[str, Any]]
    new_rows: list[tuple[str, int, int, datetime]]
    removed: list[tuple[str, int]]
    removed_per_queue: dict[int, int]
    waiting: int


def open_commands(
    spark: SparkSession, layout: Layout, commands_version: int, round_: int
) -> list[Mapping[str, Any]]:
    """Commands in ``commands`` (at a version) without an outcome from a round before ``round_``."""
    decided = (
        spark.read.format("delta")
        .load(layout.command_results)
        .where(F.col("round") < round_)
        .select("command_id")
    )
    rows = (
        spark.read.format("delta")
        .option("versionAsOf", commands_version)
        .load(layout.commands)
        .join(decided, "command_id", "left_anti")
        .select(
            "command_id",
            "action",
            "msg_id",
            "key",
            "topic",
            F.unix_millis("deliver_at").alias("deliver_ms"),
            F.unix_millis("issued_ts").alias("issued_ms"),
        )
        .orderBy("issued_ms", "command_id")
        .collect()
    )
    return [r.asDict() for r in rows]


def targets(
    spark: SparkSession,
    layout: Layout,
    schedule_version: int,
    commands: Sequence[Mapping[str, Any]],
) -> list[Target]:
    """The ``schedule`` rows (at a version) the commands name by id or key."""
    ids = sorted({c["msg_id"] for c in commands if c["msg_id"]})
    keys = sorted({c["key"] for c in commands if c["key"]})
    match = F.lit(False)
    if ids:
        match = match | F.col("msg_id").isin(ids)
    if keys:
        match = match | F.arrays_overlap(F.col("keys"), F.array(*[F.lit(k) for k in keys]))
    rows = (
        spark.read.format("delta")
        .option("versionAsOf", schedule_version)
        .load(layout.schedule)
        .where(match)
        .select(
            "msg_id",
            F.coalesce("revision", F.lit(0)).alias("revision"),
            "topic",
            "keys",
            "queue_id",
            F.unix_micros("deliver_ts").alias("deliver_us"),
            "stamp_batch",
        )
        .collect()
    )
    return [
        Target(
            r["msg_id"],
            int(r["revision"]),
            r["topic"],
            tuple(r["keys"] or ()),
            int(r["queue_id"]),
            int(r["deliver_us"]),
            int(r["stamp_batch"]),
        )
        for r in rows
    ]


def unstamped(
    spark: SparkSession, layout: Layout, msg_ids: Iterable[str], known_sent: set[str]
) -> tuple[set[str], dict[str, str]]:
    """Which of ``msg_ids`` are in ``commitlog``, and the quarantine reason of those refused.

    A message a client has the id of was committed to ``commitlog`` before the command was
    issued, so an id absent from ``commitlog`` is unknown for good. ``known_sent`` ids are
    not looked up in ``commitlog`` again (it only grows).
    """
    ids = sorted(set(msg_ids))
    sent = set(ids) & known_sent
    if set(ids) - sent:
        sent |= {
            r["msg_id"]
            for r in spark.read.format("delta")
            .load(layout.commitlog)
            .where(F.col("msg_id").isin(sorted(set(ids) - sent)))
            .select("msg_id")
            .collect()
        }
    refused = {
        r["msg_id"]: r["reason"]
        for r in spark.read.format("delta")
        .load(layout.quarantine)
        .where(F.col("msg_id").isin(ids))
        .select("msg_id", "reason")
        .collect()
    }
    return sent, refused


def removed_before(
    spark: SparkSession,
    layout: Layout,
    round_: int,
    msg_ids: Iterable[str] | None = None,
    after: datetime | None = None,
) -> DataFrame:
    """``(msg_id, revision)`` of rows taken out of delivery by rounds before ``round_``.

    Args:
        spark: a Delta-enabled session.
        layout: the lakehouse.
        round_: only outcomes decided before this round.
        msg_ids: only these messages.
        after: only rows that were due after this time.
    """
    rows = (
        spark.read.format("delta")
        .load(layout.command_results)
        .where((F.col("round") < round_) & F.col("result").isin(*REMOVING))
    )
    if msg_ids is not None:
        rows = rows.where(F.col("msg_id").isin(sorted(set(msg_ids))))
    if after is not None:
        rows = rows.where(F.col("deliver_ts") > F.lit(after))
    return rows.select("msg_id", "revision")


def resolve(
    commands: Sequence[Mapping[str, Any]],
    rows: Sequence[Target],
    removed: set[tuple[str, int]],
    delivered_by: tuple[int, int],
    round_: int,
    watermark_us: int,
    now: datetime,
    sent: set[str] | None = None,
    refused: Mapping[str, str] | None = None,
) -> Resolution:
    """Decide what each open command does; a pure function of its inputs.

    Args:
        commands: open commands, in the order they were issued.
        rows: the ``schedule`` rows they name, from the round's snapshot.
        removed: rows already cancelled or rescheduled by earlier rounds.
        delivered_by: ``(watermark_us, stamp_batch)`` of the committed progress: a row
            with ``deliver_ts`` and ``stamp_batch`` both at or below them is delivered.
        round_: the deciding round.
        watermark_us: the round's watermark; a reschedule into the past is due 1 ms after.
        now: ``decided_ts`` of the results.
        sent: ids (of commands by id that match no row) found in ``commitlog``: such a
            command waits for its message to be stamped.
        refused: the quarantine reason of those ids the engine refused.
    """
    sent = sent or set()
    refused = refused or {}
    live: dict[tuple[str, int], Target] = {}
    delivered: set[tuple[str, int]] = set()
    revisions: dict[str, int] = {}
    for row in rows:
        name = (row.msg_id, row.revision)
        revisions[row.msg_id] = max(revisions.get(row.msg_id, 0), row.revision)
        if name in removed:
            continue
        if row.deliver_us <= delivered_by[0] and row.stamp_batch <= delivered_by[1]:
            delivered.add(name)
        else:
            live[name] = row
    out = Resolution([], [], [], {}, 0)
    waiting = 0

    def record(command: Mapping[str, Any], result: str, row: Target | None, **extra: Any) -> None:
        out.results.append(
            {
                "command_id": command["command_id"],
                "action": command["action"],
                "result": result,
                "msg_id": row.msg_id if row else command["msg_id"],
                "revision": row.revision if row else None,
                "topic": row.topic if row else command["topic"],
                "queue_id": row.queue_id if row else None,
                "deliver_ts": from_micros(row.deliver_us) if row else None,
                "new_revision": extra.get("new_revision"),
                "new_deliver_ts": extra.get("new_deliver_ts"),
                "detail": extra.get("detail"),
                "round": round_,
                "decided_ts": now,
            }
        )

    for command in commands:
        chosen = _chosen(command)
        hits = [r for name, r in sorted(live.items()) if chosen(r)]
        for row in hits:
            del live[(row.msg_id, row.revision)]
            out.removed.append((row.msg_id, row.revision))
            out.removed_per_queue[row.queue_id] = out.removed_per_queue.get(row.queue_id, 0) + 1
            if command["action"] == RESCHEDULE:
                new_revision = revisions[row.msg_id] = revisions[row.msg_id] + 1
                due_ms = max(int(command["deliver_ms"]), watermark_us // 1000 + 1)
                new_ts = from_millis(due_ms)
                source = row.revision if row.source is None else row.source
                out.new_rows.append((row.msg_id, source, new_revision, new_ts))
                # The new row can be cancelled or moved again by a later command.
                live[(row.msg_id, new_revision)] = Target(
                    row.msg_id, new_revision, row.topic, row.keys, RESCHEDULE_QUEUE,
                    due_ms * 1000, -1, source,
                )  # fmt: skip
                record(command, RESCHEDULED, row, new_revision=new_revision, new_deliver_ts=new_ts)
            else:
                record(command, CANCELLED, row)
        if hits:
            continue
        what = f"message {command['msg_id']}" if command["msg_id"] else f"key {command['key']!r}"
        if any(chosen(r) for r in rows if (r.msg_id, r.revision) in delivered):
            record(command, ALREADY_DELIVERED, None, detail=f"{what} was delivered")
        elif any(chosen(r) for r in rows):
            record(command, ALREADY_CANCELLED, None, detail=f"{what} was cancelled or moved")
        elif command["msg_id"] in refused:
            detail = f"{what} was quarantined: {refused[command['msg_id']]}"
            record(command, NOT_FOUND, None, detail=detail)
        elif command["msg_id"] in sent:
            waiting += 1  # sent, not stamped yet: ask again next round
        elif command["msg_id"]:
            record(
                command, NOT_FOUND, None, detail=f"no message was sent with id {command['msg_id']}"
            )
        else:
            record(command, NOT_FOUND, None, detail=f"no scheduled {what}")
    return Resolution(out.results, out.new_rows, out.removed, out.removed_per_queue, waiting)


def _chosen(command: Mapping[str, Any]) -> Any:
    if command["msg_id"]:
        return lambda r: r.msg_id == command["msg_id"]
    key, topic = command["key"], command["topic"]
    return lambda r: key in r.keys and (topic is None or (r.topic or "").lower() == topic.lower())


def results_frame(spark: SparkSession, results: Sequence[Mapping[str, Any]]) -> DataFrame:
    """``command_results`` rows as a DataFrame."""
    names = column_names(COMMAND_RESULTS)
    return spark.createDataFrame([tuple(r[c] for c in names) for r in results], COMMAND_RESULTS)


def rescheduled_rows(
    spark: SparkSession,
    layout: Layout,
    schedule_version: int,
    new_rows: Sequence[tuple[str, int, int, datetime]],
    stamp_batch: int,
    now: datetime,
) -> DataFrame:
    """The ``schedule`` rows a round's reschedules append: copies with a new time and revision.

    ``stamp_batch`` is the round's stamp high mark, so later rounds do not count the rows as
    newly stamped; their deliver time is after the round's watermark, so the due window
    finds them.
    """
    moves = spark.createDataFrame(
        list(new_rows), "msg_id string, _old int, _revision int, _deliver_ts timestamp"
    )
    old = (
        spark.read.format("delta")
        .option("versionAsOf", schedule_version)
        .load(layout.schedule)
        .withColumn("_old", F.coalesce("revision", F.lit(0)))
    )
    moved = old.join(F.broadcast(moves), ["msg_id", "_old"])
    replaced = {
        "queue_id": F.lit(RESCHEDULE_QUEUE).cast("int"),
        "deliver_ts": F.col("_deliver_ts"),
        "stamp_batch": F.lit(stamp_batch).cast("long"),
        "stamped_ts": F.lit(now).cast("timestamp"),
        "revision": F.col("_revision"),
    }
    return moved.select(*[replaced.get(c, F.col(c)).alias(c) for c in old.columns if c[0] != "_"])


__all__ = [
    "ALREADY_CANCELLED",
    "ALREADY_DELIVERED",
    "CANCEL",
    "CANCELLED",
    "NOT_FOUND",
    "PENDING",
    "REMOVING",
    "RESCHEDULE",
    "RESCHEDULED",
    "RESCHEDULE_QUEUE",
    "Resolution",
    "Target",
    "open_commands",
    "removed_before",
    "rescheduled_rows",
    "resolve",
    "results_frame",
    "targets",
    "unstamped",
]
