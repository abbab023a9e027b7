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

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from pyspark.sql.pandas.types import to_arrow_schema

from engine.core.arrow_lists import entry_rows
from engine.core.clock import epoch_micros, from_micros, from_millis, to_millis
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.storage.layout import Layout
from schemas import COMMAND_RESULTS

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class CommandTables:
    """The tables a round's resolver reads and writes, opened from the driver in Arrow.

    A Spark job per lookup cost the round 0.3-0.6 s each, and a cancel took five of them;
    these reads and appends take milliseconds on a small lakehouse.

    Example:
        >>> tables = CommandTables.of(Layout("/lake"))  # doctest: +SKIP
        >>> open_commands(tables, 12, 40)  # doctest: +SKIP
        [{'command_id': 'c-1', 'action': 'cancel', 'msg_id': 'm-1', ...}]
    """

    commands: ArrowDelta
    results: ArrowDelta
    schedule: ArrowDelta
    commitlog: ArrowDelta
    quarantine: ArrowDelta

    @classmethod
    def of(cls, layout: Layout, results: ArrowDelta | None = None) -> CommandTables:
        """The tables of ``layout`` (nothing is read until asked)."""
        return cls(
            ArrowDelta(layout.commands),
            results or ArrowDelta(layout.command_results),
            ArrowDelta(layout.schedule),
            ArrowDelta(layout.commitlog),
            ArrowDelta(layout.quarantine),
        )


#: The ``schedule`` table property maintenance sets when it prunes: rows of messages sent
#: before this time (ISO-8601) may be gone because they were delivered or cancelled.
PRUNED_BEFORE = "delayq.prunedBefore"
_COMMAND_COLUMNS = ["command_id", "action", "msg_id", "key", "topic", "deliver_at", "issued_ts"]
_TARGET_COLUMNS = ["msg_id", "revision", "topic", "keys", "queue_id", "deliver_ts", "stamp_batch"]
RESULTS_SCHEMA = to_arrow_schema(COMMAND_RESULTS, timezone="UTC")


def open_commands(
    tables: CommandTables, commands_version: int, round_: int
) -> list[dict[str, Any]]:
    """Commands in ``commands`` (at a version) without an outcome from a round before
    ``round_``, in the order they were issued."""
    rows = tables.commands.dataset(commands_version).to_table(columns=_COMMAND_COLUMNS)
    nameless = rows.filter(pc.is_null(rows["command_id"]))
    if nameless.num_rows:  # written by hand: an outcome could not name it
        log.warning("%d commands without a command_id are ignored", nameless.num_rows)
        rows = rows.filter(pc.is_valid(rows["command_id"]))
    decided = _results(tables.results, round_, columns=["command_id"])
    if decided is not None and decided.num_rows:
        rows = rows.filter(pc.invert(pc.is_in(rows["command_id"], value_set=decided["command_id"])))
    out = []
    for r in rows.to_pylist():
        deliver_at, issued = r.pop("deliver_at"), r.pop("issued_ts")
        r["deliver_ms"] = None if deliver_at is None else to_millis(_utc(deliver_at))
        r["issued_ms"] = None if issued is None else to_millis(_utc(issued))
        out.append(r)
    # As Spark's ORDER BY: a missing issue time first.
    out.sort(key=lambda c: (c["issued_ms"] is not None, c["issued_ms"] or 0, c["command_id"]))
    return out


def targets(
    tables: CommandTables, schedule_version: int, commands: Sequence[Mapping[str, Any]]
) -> list[Target]:
    """The ``schedule`` rows (at a version) the commands name by id or key."""
    ids = pa.array(sorted({c["msg_id"] for c in commands if c["msg_id"]}), pa.string())
    keys = pa.array(sorted({c["key"] for c in commands if c["key"]}), pa.string())
    snapshot = tables.schedule.dataset(schedule_version)
    if len(keys):
        # No pushed-down filter on a list column: pick batch by batch (memory stays flat).
        picked = []
        for batch in snapshot.to_batches(columns=_TARGET_COLUMNS):
            by_key = entry_rows(batch["keys"])[
                np.asarray(pc.is_in(pc.list_flatten(batch["keys"]), value_set=keys), dtype=bool)
            ]
            by_id = np.flatnonzero(np.asarray(pc.is_in(batch["msg_id"], value_set=ids), dtype=bool))
            hits = np.union1d(by_key, by_id)
            if len(hits):
                picked.append(batch.take(pa.array(hits, pa.int64())))
        schema = pa.schema([snapshot.schema.field(c) for c in _TARGET_COLUMNS])
        rows = pa.Table.from_batches(picked, schema)
    elif len(ids):
        rows = snapshot.to_table(columns=_TARGET_COLUMNS, filter=ds.field("msg_id").isin(ids))
    else:
        return []
    deliver_us = epoch_micros(rows["deliver_ts"])
    return [
        Target(
            r["msg_id"],
            int(r["revision"] or 0),
            r["topic"],
            tuple(r["keys"] or ()),
            int(r["queue_id"]),
            int(us),
            int(r["stamp_batch"]),
        )
        for r, us in zip(rows.to_pylist(), deliver_us.to_pylist(), strict=True)
    ]


def unstamped(
    tables: CommandTables, msg_ids: Iterable[str], known_sent: set[str]
) -> tuple[set[str], dict[str, str]]:
    """Which of ``msg_ids`` are in ``commitlog``, and the quarantine reason of those refused.

    A message a client has the id of was committed to ``commitlog`` before the command was
    issued, so an id absent from ``commitlog`` is unknown for good. ``known_sent`` ids are
    not looked up in ``commitlog`` again (it only grows).
    """
    ids = sorted(set(msg_ids))
    sent = set(ids) & known_sent
    look = sorted(set(ids) - sent)
    if look:
        sent |= set(_lookup(tables.commitlog, look, ["msg_id"])["msg_id"].to_pylist())
    found = _lookup(tables.quarantine, ids, ["msg_id", "reason"]).to_pylist()
    return sent, {r["msg_id"]: r["reason"] for r in found}


def pruned_ids(tables: CommandTables, sent: Iterable[str], round_: int) -> dict[str, bool]:
    """Of ``sent`` ids found in no ``schedule`` row, those whose rows maintenance pruned: sent
    before the ``delayq.prunedBefore`` time it records on ``schedule`` (stamping had stamped
    everything sent before it). Each with whether its last revision was taken out of delivery
    by a command (cancelled) rather than delivered.
    """
    ids = sorted(set(sent))
    cutoff = tables.schedule.table_property(PRUNED_BEFORE) if ids else None
    if cutoff is None:
        return {}
    before = datetime.fromisoformat(cutoff)
    stored = _lookup(tables.commitlog, ids, ["msg_id", "store_ts"]).to_pylist()
    gone = sorted({r["msg_id"] for r in stored if r["store_ts"] and _utc(r["store_ts"]) < before})
    outcomes = _results(
        tables.results,
        round_,
        columns=["msg_id", "revision", "result", "new_revision"],
        where=ds.field("result").isin(list(REMOVING)) & ds.field("msg_id").isin(gone),
    )
    last = dict.fromkeys(gone, 0)  # each message's last revision, and those removed
    removed: set[tuple[str, int]] = set()
    for r in [] if outcomes is None else outcomes.to_pylist():
        removed.add((r["msg_id"], int(r["revision"] or 0)))
        if r["result"] == RESCHEDULED and r["new_revision"] is not None:
            last[r["msg_id"]] = max(last[r["msg_id"]], int(r["new_revision"]))
    return {m: (m, last[m]) in removed for m in gone}


def removed_before(
    tables: CommandTables, round_: int, msg_ids: Iterable[str]
) -> set[tuple[str, int]]:
    """``(msg_id, revision)`` of rows of ``msg_ids`` taken out of delivery by rounds before
    ``round_``."""
    ids = sorted(set(msg_ids))
    rows = _results(
        tables.results,
        round_,
        columns=["msg_id", "revision"],
        where=ds.field("result").isin(list(REMOVING)) & ds.field("msg_id").isin(ids),
    )
    if rows is None:
        return set()
    return {(r["msg_id"], int(r["revision"] or 0)) for r in rows.to_pylist()}


def _results(
    results: ArrowDelta, round_: int, columns: list[str], where: ds.Expression | None = None
) -> pa.Table | None:
    """``command_results`` rows decided before ``round_`` (``None``: no table yet)."""
    version = results.latest()
    if version < 0:
        return None
    before = ds.field("round") < round_
    return results.dataset(version).to_table(
        columns=columns, filter=before if where is None else before & where
    )


def _lookup(table: ArrowDelta, ids: Sequence[str], columns: list[str]) -> pa.Table:
    """The rows of the latest snapshot whose ``msg_id`` is one of ``ids``."""
    version = table.latest()
    if version < 0 or not ids:
        return pa.table({c: pa.array([], pa.string()) for c in columns})
    return table.dataset(version).to_table(columns=columns, filter=ds.field("msg_id").isin(ids))


def _utc(when: datetime) -> datetime:
    """A timestamp read from a table as an aware UTC datetime (Delta's timestamps are UTC)."""
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


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
    pruned: Mapping[str, bool] | None = None,
    held_back: Mapping[str, tuple[int, str, int]] | None = None,
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
        pruned: of the ``sent`` ids, those whose rows maintenance deleted from ``schedule``
            (delivered or cancelled long ago), each with whether a command had removed it.
        held_back: per topic table, the cursor of a rate cap (:mod:`engine.deliver.rates`):
            its rows above it are due but not delivered yet.
    """
    sent = sent or set()
    refused = refused or {}
    pruned = pruned or {}
    live: dict[tuple[str, int], Target] = {}
    delivered: set[tuple[str, int]] = set()
    revisions: dict[str, int] = {}
    for row in rows:
        name = (row.msg_id, row.revision)
        revisions[row.msg_id] = max(revisions.get(row.msg_id, 0), row.revision)
        if name in removed:
            continue
        held = (held_back or {}).get((row.topic or "").lower())
        if held is not None and (row.deliver_us, row.msg_id, row.revision) > held:
            live[name] = row  # (due, but its topic's cap holds it back)
        elif row.deliver_us <= delivered_by[0] and row.stamp_batch <= delivered_by[1]:
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
        elif command["msg_id"] in pruned:
            how = "cancelled or moved" if pruned[command["msg_id"]] else "delivered"
            detail = f"{what} was {how} long ago (its schedule rows are pruned)"
            result = ALREADY_CANCELLED if pruned[command["msg_id"]] else ALREADY_DELIVERED
            record(command, result, None, detail=detail)
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


def results_table(results: Sequence[Mapping[str, Any]]) -> pa.Table:
    """``command_results`` rows as an Arrow table.

    Example:
        >>> results_table([]).num_rows
        0
    """
    names = RESULTS_SCHEMA.names
    return pa.Table.from_pylist([{c: r[c] for c in names} for r in results], RESULTS_SCHEMA)


def rescheduled_rows(
    tables: CommandTables,
    schedule_version: int,
    new_rows: Sequence[tuple[str, int, int, datetime]],
    stamp_batch: int,
    now: datetime,
) -> pa.Table:
    """The ``schedule`` rows a round's reschedules append: copies with a new time and revision.

    ``stamp_batch`` is the round's stamp high mark, so later rounds do not count the rows as
    newly stamped; their deliver time is after the round's watermark, so the due window
    finds them.

    Raises:
        KeyError: a source row is not in the snapshot (the resolver read it there: a bug).
    """
    ids = sorted({m for m, *_ in new_rows})
    old = tables.schedule.dataset(schedule_version).to_table(filter=ds.field("msg_id").isin(ids))
    revisions = pc.fill_null(old["revision"], 0).to_pylist()
    names = zip(old["msg_id"].to_pylist(), revisions, strict=True)
    where = {name: i for i, name in enumerate(names)}
    moved = old.take(pa.array([where[(m, source)] for m, source, _, _ in new_rows], pa.int64()))
    n = len(new_rows)
    replaced = {
        "queue_id": pa.array([RESCHEDULE_QUEUE] * n, pa.int32()),
        "deliver_ts": pa.array([t for *_, t in new_rows], pa.timestamp("us", tz="UTC")),
        "stamp_batch": pa.array([stamp_batch] * n, pa.int64()),
        "stamped_ts": pa.array([now] * n, pa.timestamp("us", tz="UTC")),
        "revision": pa.array([r for _, _, r, _ in new_rows], pa.int32()),
    }
    for name, values in replaced.items():
        i = moved.schema.get_field_index(name)
        moved = moved.set_column(i, name, values.cast(moved.schema.field(i).type))
    return moved


__all__ = [
    "ALREADY_CANCELLED",
    "ALREADY_DELIVERED",
    "CANCEL",
    "CANCELLED",
    "NOT_FOUND",
    "PENDING",
    "PRUNED_BEFORE",
    "REMOVING",
    "RESCHEDULE",
    "RESCHEDULED",
    "RESCHEDULE_QUEUE",
    "RESULTS_SCHEMA",
    "CommandTables",
    "Resolution",
    "Target",
    "open_commands",
    "pruned_ids",
    "removed_before",
    "rescheduled_rows",
    "resolve",
    "results_table",
    "targets",
    "unstamped",
]
