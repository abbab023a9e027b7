"""Cancel and reschedule scheduled messages: the client side.

A client appends a command to ``commands`` (:func:`cancel`, :func:`reschedule`) and waits
for its outcome in ``command_results``, which the delivery round writes when it decides the
command (see :mod:`engine.deliver.commands` for the rules). A command nobody answered within
the wait stays queued and applies when an engine runs.

Example:
    >>> cancel(spark, cfg, msg_id).status                         # doctest: +SKIP
    'cancelled'
    >>> reschedule(spark, cfg, msg_id, delay="2h").status         # doctest: +SKIP
    'rescheduled'
"""

from __future__ import annotations

import getpass
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from pyspark.sql import SparkSession

from engine.control.endpoint import caller
from engine.core.clock import Clock, SystemClock, from_millis
from engine.core.config import EngineConfig
from engine.core.errors import InvalidMessageError
from engine.core.message import deliver_time
from engine.core.topics import check_topic
from engine.deliver.commands import CANCEL, PENDING, REMOVING, RESCHEDULE
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.live_files import LiveFiles
from engine.lakehouse.delta.tables import ensure_tables
from engine.lakehouse.storage.layout import layout
from schemas import COMMANDS, column_names

DEFAULT_WAIT_S = 30.0


@dataclass(frozen=True)
class Outcome:
    """What a command did to one message row."""

    result: str
    msg_id: str | None
    topic: str | None = None
    deliver_ts: datetime | None = None
    new_deliver_ts: datetime | None = None
    detail: str = ""


@dataclass(frozen=True)
class CommandResult:
    """The answer to a command.

    Attributes:
        command_id: the command's id in ``commands``/``command_results``.
        action: ``cancel`` or ``reschedule``.
        status: ``cancelled`` or ``rescheduled`` when any message was, else the one outcome
            (``already_delivered``, ``already_cancelled``, ``not_found``), or ``pending``
            when no engine answered within the wait (the command stays queued).
        outcomes: one per message row touched.
    """

    command_id: str
    action: str
    status: str
    outcomes: tuple[Outcome, ...] = field(default_factory=tuple)

    @property
    def count(self) -> int:
        """Messages cancelled or rescheduled."""
        return sum(o.result in REMOVING for o in self.outcomes)

    def line(self) -> str:
        """A one-line summary, e.g. ``cancelled 3 message(s) (command 9F...)``."""
        if self.status in REMOVING:
            text = f"{self.status} {self.count} message(s)"
        else:
            details = sorted({o.detail for o in self.outcomes if o.detail})
            text = self.status + (f": {'; '.join(details)}" if details else "")
        return f"{text} (command {self.command_id})"


def issue(
    spark: SparkSession,
    cfg: EngineConfig,
    action: str,
    *,
    msg_id: str | None = None,
    key: str | None = None,
    topic: str | None = None,
    deliver_at: datetime | None = None,
    clock: Clock | None = None,
) -> str:
    """Append one command to ``commands`` and return its id (no validation; see cancel)."""
    spec = {"msg_id": msg_id, "key": key, "topic": topic, "deliver_at": deliver_at}
    return issue_many(spark, cfg, action, [spec], clock=clock)[0]


def issue_many(
    spark: SparkSession,
    cfg: EngineConfig,
    action: str,
    targets: Sequence[Mapping[str, Any]],
    *,
    clock: Clock | None = None,
) -> list[str]:
    """Append one command per target (``msg_id``, ``key``, ``topic``, ``deliver_at``) to
    ``commands`` in one commit; return their ids in the same order (no validation)."""
    lay = ensure_tables(spark, cfg, migrate=False)
    issued_ts = (clock or SystemClock()).now()
    issued_by = caller() or f"{getpass.getuser()}@{socket.gethostname()}"
    ids, rows = [], []
    for target in targets:
        command_id = uuid.uuid4().hex.upper()
        rows.append(
            {
                "command_id": command_id,
                "action": action,
                "msg_id": target.get("msg_id"),
                "key": target.get("key"),
                "topic": target.get("topic"),
                "deliver_at": target.get("deliver_at"),
                "issued_ts": issued_ts,
                "issued_by": issued_by,
            }
        )
        ids.append(command_id)
    # One commit written from here (Parquet and a Delta log entry): no Spark job.
    ArrowDelta(lay.commands).append(pa.Table.from_pylist(rows, schema=_COMMAND_ROW))
    return ids


_TIME = pa.timestamp("us", tz="UTC")
_COMMAND_ROW = pa.schema(
    [
        (c, _TIME if c in ("deliver_at", "issued_ts") else pa.string())
        for c in column_names(COMMANDS)
    ]
)


def result_of(
    spark: SparkSession, cfg: EngineConfig, command_id: str, action: str
) -> CommandResult:
    """The outcome of a command so far (``pending`` while no engine has decided it)."""
    return results_of(spark, cfg, [command_id], action)[0]


def results_of(
    spark: SparkSession, cfg: EngineConfig, command_ids: Sequence[str], action: str
) -> list[CommandResult]:
    """The outcomes of commands so far, in the order of ``command_ids`` (one read, Arrow)."""
    results_table = ArrowDelta(layout(cfg).command_results)
    version = results_table.latest()
    found: dict[str, list[Outcome]] = {}
    if version >= 0:
        columns = ["command_id", "result", "msg_id", "topic", "detail", "deliver_ts",
                   "new_deliver_ts"]  # fmt: skip
        rows = results_table.dataset(version).to_table(
            columns=columns, filter=ds.field("command_id").isin(list(command_ids))
        )
        for name in ("deliver_ts", "new_deliver_ts"):  # in whole ms, as they were shown
            millis = pc.divide(pc.cast(rows[name], pa.int64()), 1000)
            rows = rows.set_column(rows.schema.get_field_index(name), name, millis)
        order = [("command_id", "ascending", "at_start"), ("msg_id", "ascending", "at_start")]
        for r in rows.sort_by(order).to_pylist():
            found.setdefault(r["command_id"], []).append(
                Outcome(
                    r["result"],
                    r["msg_id"],
                    r["topic"],
                    _ts(r["deliver_ts"]),
                    _ts(r["new_deliver_ts"]),
                    r["detail"] or "",
                )
            )
    results = []
    for command_id in command_ids:
        outcomes = tuple(found.get(command_id, ()))
        if not outcomes:
            results.append(CommandResult(command_id, action, PENDING))
            continue
        removing = [o.result for o in outcomes if o.result in REMOVING]
        status = removing[0] if removing else outcomes[0].result
        results.append(CommandResult(command_id, action, status, outcomes))
    return results


def wait_for(
    spark: SparkSession,
    cfg: EngineConfig,
    command_id: str,
    action: str,
    wait_s: float,
    poll_s: float = 0.02,
) -> CommandResult:
    """Poll ``command_results`` until the command is decided or ``wait_s`` has passed."""
    return wait_for_many(spark, cfg, [command_id], action, wait_s, poll_s)[0]


def wait_for_many(
    spark: SparkSession,
    cfg: EngineConfig,
    command_ids: Sequence[str],
    action: str,
    wait_s: float,
    poll_s: float = 0.02,
    progress: Callable[[int, int], None] | None = None,
) -> list[CommandResult]:
    """Poll ``command_results`` until every command is decided or ``wait_s`` has passed.

    Every ``poll_s`` the table's next log file is probed (no read); the results are read
    when it has a new version. ``progress(decided, total)`` is called after each read.
    """
    _check_wait(wait_s)
    deadline = time.monotonic() + wait_s
    probe = LiveFiles(layout(cfg).command_results)
    read = -2
    while True:
        version = probe.latest()
        if version != read:
            read = version
            results = results_of(spark, cfg, command_ids, action)
            decided = sum(r.status != PENDING for r in results)
            if progress is not None:
                progress(decided, len(results))
            if decided == len(results):
                return results
        if time.monotonic() >= deadline:
            return results
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))


def cancel(
    spark: SparkSession,
    cfg: EngineConfig,
    msg_id: str | None = None,
    *,
    key: str | None = None,
    topic: str | None = None,
    wait: float = DEFAULT_WAIT_S,
    clock: Clock | None = None,
) -> CommandResult:
    """Cancel a scheduled message by id, or every pending message with ``key``.

    Args:
        spark: a Delta-enabled session.
        cfg: the lakehouse.
        msg_id: the message id :func:`~engine.produce.send.send` returned.
        key: cancel every pending message carrying this key (instead of ``msg_id``).
        topic: with ``key``, only messages for this topic.
        wait: seconds to wait for the engine's answer (0: do not wait).
        clock: the issuing clock (``issued_ts``).

    Returns:
        The outcome; ``status`` is ``pending`` if no engine answered within ``wait``
        (the command stays queued and is applied when an engine runs).

    Raises:
        InvalidMessageError: when neither or both of ``msg_id`` and ``key`` are given,
            or a value is not valid.
    """
    _target(msg_id, key)
    _check_wait(wait)
    if topic is not None:
        if key is None:
            raise InvalidMessageError("topic", topic, "only a cancel by key takes a topic")
        check_topic(topic)
    command_id = issue(spark, cfg, CANCEL, msg_id=msg_id, key=key, topic=topic, clock=clock)
    return wait_for(spark, cfg, command_id, CANCEL, wait)


def reschedule(
    spark: SparkSession,
    cfg: EngineConfig,
    msg_id: str,
    *,
    deliver_at: datetime | int | str | None = None,
    delay: timedelta | str | None = None,
    wait: float = DEFAULT_WAIT_S,
    clock: Clock | None = None,
) -> CommandResult:
    """Move a scheduled message to a new deliver time (earlier or later).

    Args:
        spark: a Delta-enabled session.
        cfg: the lakehouse and ``messages.max_delay``.
        msg_id: the message id.
        deliver_at: the new absolute time (ms, ISO-8601 with zone, or aware datetime).
        delay: or a delay from now (``"90s"``, ``"2d"``, a timedelta).
        wait: seconds to wait for the engine's answer.
        clock: the issuing clock; ``delay`` counts from it.

    Raises:
        InvalidMessageError: without exactly one of ``deliver_at`` and ``delay``, or with a
            time beyond ``messages.max_delay``.
    """
    _target(msg_id, None)
    _check_wait(wait)
    if (deliver_at is None) == (delay is None):
        raise InvalidMessageError("deliver_at", deliver_at, "give one of deliver_at and delay")
    when = deliver_time(deliver_at, delay, cfg, (clock or SystemClock()).now())
    command_id = issue(spark, cfg, RESCHEDULE, msg_id=msg_id, deliver_at=when, clock=clock)
    return wait_for(spark, cfg, command_id, RESCHEDULE, wait)


def cancel_many(
    spark: SparkSession,
    cfg: EngineConfig,
    msg_ids: Sequence[str],
    *,
    wait: float = DEFAULT_WAIT_S,
    clock: Clock | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[CommandResult]:
    """Cancel many messages by id: one command each, issued in one commit, each decided
    once by the engine as :func:`cancel` is; the results in the order of ``msg_ids``.

    Raises:
        InvalidMessageError: an id is empty (nothing is issued then).

    Example:
        >>> [r.status for r in cancel_many(spark, cfg, ["A1", "B2"])]  # doctest: +SKIP
        ['cancelled', 'not_found']
    """
    for msg_id in msg_ids:
        _target(msg_id, None)
    _check_wait(wait)
    ids = issue_many(spark, cfg, CANCEL, [{"msg_id": m} for m in msg_ids], clock=clock)
    return wait_for_many(spark, cfg, ids, CANCEL, wait, progress=progress)


def reschedule_many(
    spark: SparkSession,
    cfg: EngineConfig,
    moves: Sequence[tuple[str, datetime | int | str | None, timedelta | str | None]],
    *,
    wait: float = DEFAULT_WAIT_S,
    clock: Clock | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[CommandResult]:
    """Reschedule many messages: ``(msg_id, deliver_at, delay)`` each (one of the two
    times), issued in one commit; the results in the same order.

    Raises:
        InvalidMessageError: a move is invalid; it names the message (nothing is issued).

    Example:
        >>> moves = [("A1", None, "2h"), ("B2", "2026-12-01T09:00:00Z", None)]
        >>> [r.status for r in reschedule_many(spark, cfg, moves)]  # doctest: +SKIP
        ['rescheduled', 'rescheduled']
    """
    _check_wait(wait)
    now = (clock or SystemClock()).now()
    targets = []
    for msg_id, deliver_at, delay in moves:
        _target(msg_id, None)
        if (deliver_at is None) == (delay is None):
            raise InvalidMessageError(
                "deliver_at", deliver_at, f"give one of deliver_at and delay for {msg_id}"
            )
        try:
            when = deliver_time(deliver_at, delay, cfg, now)
        except InvalidMessageError as err:
            if len(moves) == 1:
                raise
            raise InvalidMessageError(err.field, err.value, f"{err} (message {msg_id})") from None
        targets.append({"msg_id": msg_id, "deliver_at": when})
    ids = issue_many(spark, cfg, RESCHEDULE, targets, clock=clock)
    return wait_for_many(spark, cfg, ids, RESCHEDULE, wait, progress=progress)


def _target(msg_id: str | None, key: str | None) -> None:
    if (msg_id is None) == (key is None):
        raise InvalidMessageError("msg_id", msg_id, "give a message id or a key (one of them)")
    for name, value in (("msg_id", msg_id), ("key", key)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise InvalidMessageError(name, value, "must be a non-empty string")


def _check_wait(wait_s: float) -> None:
    if not isinstance(wait_s, int | float) or wait_s < 0:
        raise InvalidMessageError("wait", wait_s, "must be a number of seconds >= 0")


def _ts(ms: int | None) -> datetime | None:
    return from_millis(ms) if ms is not None else None
