"""Recurring schedules: create, update, pause, resume, delete and list them.

A schedule is a message template (topic, body, keys, tags, properties) and a
:class:`~engine.recur.spec.Recurrence`. Each change appends a revision to the ``recurring``
table (``RECURRING``, a plain Delta table: ``SELECT * FROM delta.`<lakehouse>/recurring```
shows the history); the newest revision of a name is the schedule. The engine fires it
(:mod:`engine.recur.fire`): each occurrence is one message into ``commitlog``, due at the
occurrence, with the id ``<name>:<occurrence in epoch ms>``.

A change applies to the occurrences after those the engine has sent (it sends them 10 s
ahead): an update, a pause or a delete is seen within a second, and what was sent before it
is delivered as sent. No Spark session is needed.

Example:
    >>> create_schedule(cfg, "nightly", "reports", "run", cron="0 2 * * *",
    ...                 time_zone="Europe/Berlin")  # doctest: +SKIP
    RecurringSchedule(name='nightly', revision=1, state='active', ...)
    >>> pause_schedule(cfg, "nightly").state  # doctest: +SKIP
    'paused'
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_schema

from engine.core.clock import Clock, SystemClock, to_millis
from engine.core.config import EngineConfig
from engine.core.errors import ConfigError, ScheduleError
from engine.core.levels import parse_duration_ms
from engine.core.message import Message, validate
from engine.lakehouse.delta.arrow_delta import ArrowDelta, create_table
from engine.lakehouse.storage.layout import layout
from engine.recur.policy import CATCH_UP, DEFAULT_CATCH_UP, DEFAULT_CATCH_UP_WINDOW
from engine.recur.spec import Recurrence
from schemas import RECURRING

ACTIVE, PAUSED, DELETED = "active", "paused", "deleted"
CREATE, UPDATE, PAUSE, RESUME, DELETE = "create", "update", "pause", "resume", "delete"
#: What a schedule's name may hold: it is part of its messages' ids.
NAME = re.compile(r"[A-Za-z0-9_.-]{1,80}")


@dataclass(frozen=True)
class RecurringSchedule:
    """One revision of a recurring schedule.

    Attributes:
        name: the schedule's name (letters, digits, ``_ . -``).
        revision: 1 for the first, one more for each change.
        state: ``active``, ``paused`` or ``deleted``.
        action: the change that made this revision.
        effective: when it was made (changes take effect from then).
        topic: the topic each occurrence's message goes to.
        body: the message body.
        recurrence: when it fires.
        catch_up: after downtime: ``skip``, ``latest`` or ``all`` missed occurrences.
        catch_up_window: how far back missed occurrences are considered.
        keys: the message keys.
        tags: the message tag.
        properties: the message properties.
    """

    name: str
    revision: int
    state: str
    action: str
    effective: datetime
    topic: str
    body: bytes
    recurrence: Recurrence
    catch_up: str = DEFAULT_CATCH_UP
    catch_up_window: timedelta = timedelta(days=1)
    keys: tuple[str, ...] = ()
    tags: str | None = None
    properties: Mapping[str, str] = field(default_factory=dict)

    def message_id(self, occurrence: datetime) -> str:
        """The id of the message an occurrence sends: the schedule's name and the occurrence
        in epoch milliseconds (the same for every revision: an occurrence is sent once).

        Example:
            >>> schedule.message_id(datetime(2026, 1, 1, tzinfo=UTC))  # doctest: +SKIP
            'nightly:1767225600000'
        """
        return f"{self.name}:{to_millis(occurrence)}"

    def next_times(
        self, after: datetime, count: int = 5, within: timedelta = timedelta(days=3660)
    ) -> list[datetime]:
        """The next ``count`` occurrences after ``after``, within ``within`` of it (none
        unless active).

        Example:
            >>> schedule.next_times(now, 2)  # doctest: +SKIP
            [datetime(2026, 1, 2, 1, 0, tzinfo=UTC), datetime(2026, 1, 3, 1, 0, tzinfo=UTC)]
        """
        if self.state != ACTIVE:
            return []
        return self.recurrence.first(after, count, within)


def recurring_table(cfg: EngineConfig) -> ArrowDelta:
    """The ``recurring`` table, made if missing (no Spark job)."""
    path = layout(cfg).recurring
    create_table(path, to_arrow_schema(RECURRING, timezone="UTC"))
    return ArrowDelta(path)


def create_schedule(
    cfg: EngineConfig,
    name: str,
    topic: str,
    body: bytes | str,
    *,
    cron: str | None = None,
    every: str | None = None,
    at: Sequence[datetime | str] | str | None = None,
    time_zone: str = "UTC",
    start: datetime | str | None = None,
    end: datetime | str | None = None,
    jitter: str | int | None = None,
    catch_up: str = DEFAULT_CATCH_UP,
    catch_up_window: str = DEFAULT_CATCH_UP_WINDOW,
    keys: Sequence[str] | str | None = None,
    tags: str | None = None,
    properties: Mapping[str, str] | None = None,
    clock: Clock | None = None,
) -> RecurringSchedule:
    """Create a recurring schedule that sends a message to ``topic`` at each occurrence.

    Give exactly one of ``cron`` (five fields), ``every`` (a rate such as ``15m``) and
    ``at`` (ISO 8601 times). ``time_zone`` is an IANA name; ``jitter`` delays each message by
    up to that much (``30s``); ``catch_up`` says what fires after downtime: ``skip`` (none
    of the missed occurrences), ``latest`` (the newest, once) or ``all`` (each one within
    ``catch_up_window``, 10 a second).

    Raises:
        ScheduleError: a bad field, or a schedule of that name exists (not deleted).
        InvalidMessageError: a bad message field.

    Example:
        >>> made = create_schedule(cfg, "quarterly", "ticks", "tick", every="15m")  # doctest: +SKIP
        >>> made.revision  # doctest: +SKIP
        1
    """
    given = {
        "name": name, "topic": topic, "body": body, "cron": cron, "every": every, "at": at,
        "time_zone": time_zone, "start": start, "end": end, "jitter": jitter,
        "catch_up": catch_up, "catch_up_window": catch_up_window, "keys": keys, "tags": tags,
        "properties": properties,
    }  # fmt: skip
    return create_schedules(cfg, [given], clock)[0]


def create_schedules(
    cfg: EngineConfig, schedules: Sequence[Mapping[str, Any]], clock: Clock | None = None
) -> list[RecurringSchedule]:
    """Create many schedules in one commit: each a mapping of :func:`create_schedule`'s
    arguments (``name``, ``topic``, ``body``, ``cron``/``every``/``at``, ...). All or none.

    Raises:
        ScheduleError: naming the schedule (by its place) and the bad field.
        InvalidMessageError: a bad message field.

    Example:
        >>> specs = [{"name": f"s{i}", "topic": "t", "body": "b", "every": "1m"} for i in range(3)]
        >>> len(create_schedules(cfg, specs))  # doctest: +SKIP
        3
    """
    now = (clock or SystemClock()).now()
    table = recurring_table(cfg)
    existing = read_schedules(table)
    made: list[RecurringSchedule] = []
    for spec in schedules:
        made.append(revise(cfg, existing, CREATE, spec, now))
        existing[made[-1].name] = made[-1]  # (a name twice in one call: the second exists)
    _append(table, made)
    return made


def _made(
    cfg: EngineConfig, spec: Mapping[str, Any], now: datetime, revision: int
) -> RecurringSchedule:
    """A first revision from :func:`create_schedule`'s arguments, checked."""
    unknown = sorted(set(spec) - _CREATE_FIELDS)
    if unknown:
        raise ScheduleError("schedule", ", ".join(unknown), "not a schedule field")
    recurrence = Recurrence.parse(
        cron=spec.get("cron"),
        every=spec.get("every"),
        at=spec.get("at"),
        time_zone=spec.get("time_zone") or "UTC",
        start=spec.get("start"),
        end=spec.get("end"),
        jitter=spec.get("jitter"),
    )
    template: list[Any] = [spec.get(k) for k in ("topic", "body", "keys", "tags", "properties")]
    message = Message(*template)
    fields = validate(message, cfg, now)
    return RecurringSchedule(
        name=spec["name"],
        revision=revision,
        state=ACTIVE,
        action=CREATE,
        effective=now,
        topic=fields["topic"],
        body=fields["body"],
        recurrence=recurrence,
        catch_up=_catch_up(spec.get("catch_up") or DEFAULT_CATCH_UP),
        catch_up_window=timedelta(
            milliseconds=_window(spec.get("catch_up_window") or DEFAULT_CATCH_UP_WINDOW)
        ),
        keys=tuple(fields["keys"]),
        tags=fields["tags"],
        properties=fields["properties"],
    )


#: What :func:`create_schedule` takes (besides the lakehouse and the clock).
_CREATE_FIELDS = frozenset(
    {"name", "topic", "body", "cron", "every", "at", "time_zone", "start", "end", "jitter",
     "catch_up", "catch_up_window", "keys", "tags", "properties"}
)  # fmt: skip


def update_schedule(
    cfg: EngineConfig, name: str, clock: Clock | None = None, **changes: Any
) -> RecurringSchedule:
    """Change a schedule: any of :func:`create_schedule`'s arguments but the name (a new
    ``cron``, ``every`` or ``at`` replaces the old one with the same time zone unless
    ``time_zone`` is given too).

    Raises:
        ScheduleError: no such schedule, or a bad field.

    Example:
        >>> update_schedule(cfg, "nightly", cron="0 3 * * *").revision  # doctest: +SKIP
        2
    """
    table = recurring_table(cfg)
    schedule = _updated(cfg, _existing(table, name), changes, (clock or SystemClock()).now())
    _append(table, schedule)
    return schedule


def _updated(
    cfg: EngineConfig, old: RecurringSchedule, changes: Mapping[str, Any], now: datetime
) -> RecurringSchedule:
    """The revision :func:`update_schedule` makes of ``old``, checked."""
    known = _CREATE_FIELDS - {"name"}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ScheduleError("update", ", ".join(unknown), f"not a schedule field ({sorted(known)})")
    rec = old.recurrence
    when = {k: changes[k] for k in ("cron", "every", "at") if changes.get(k) is not None}
    if not when:
        when = {rec.kind: rec.expression}
    recurrence = Recurrence.parse(
        **when,
        time_zone=changes.get("time_zone", rec.time_zone),
        start=changes.get("start", rec.start),
        end=changes.get("end", rec.end),
        jitter=changes.get("jitter", rec.jitter_ms),
    )
    message = Message(
        changes.get("topic", old.topic),
        changes.get("body", old.body),
        changes.get("keys", list(old.keys)),
        changes.get("tags", old.tags),
        changes.get("properties", dict(old.properties)),
    )
    fields = validate(message, cfg, now)
    window = changes.get("catch_up_window")
    return replace(
        old,
        revision=old.revision + 1,
        action=UPDATE,
        effective=now,
        topic=fields["topic"],
        body=fields["body"],
        recurrence=recurrence,
        catch_up=_catch_up(changes.get("catch_up", old.catch_up)),
        catch_up_window=old.catch_up_window
        if window is None
        else timedelta(milliseconds=_window(window)),
        keys=tuple(fields["keys"]),
        tags=fields["tags"],
        properties=fields["properties"],
    )


def revise(
    cfg: EngineConfig,
    current: Mapping[str, RecurringSchedule],
    action: str,
    spec: Mapping[str, Any],
    now: datetime,
) -> RecurringSchedule:
    """The revision a change makes, given each schedule's newest revision (``current``):
    ``create`` (``spec`` as :func:`create_schedule`'s arguments), ``update`` (the fields
    that change), ``pause``, ``resume`` or ``delete``. Writes nothing.

    Raises:
        ScheduleError: naming the bad field (the action, the name, a schedule field).
        InvalidMessageError: a bad message field.

    Example:
        >>> revise(cfg, {}, "create", {"name": "n", "topic": "t", "body": "b",
        ...        "every": "1m"}, now).revision  # doctest: +SKIP
        1
    """
    name = spec.get("name")
    _check_name(name)
    assert isinstance(name, str)
    latest = current.get(name)
    if action == CREATE:
        if latest is not None and latest.state != DELETED:
            raise ScheduleError(
                "name", name, "a schedule of that name exists (update or delete it)"
            )
        return _made(cfg, spec, now, (latest.revision + 1) if latest else 1)
    if action not in _STATES and action != UPDATE:
        raise ScheduleError("action", action, "one of create, update, pause, resume, delete")
    if latest is None or latest.state == DELETED:
        raise ScheduleError("name", name, "no such schedule")
    if action == UPDATE:
        changes = {k: v for k, v in spec.items() if k != "name"}
        return _updated(cfg, latest, changes, now)
    return replace(
        latest, revision=latest.revision + 1, action=action, state=_STATES[action], effective=now
    )


#: The state each change of state leaves a schedule in.
_STATES = {PAUSE: PAUSED, RESUME: ACTIVE, DELETE: DELETED}


def pause_schedule(cfg: EngineConfig, name: str, clock: Clock | None = None) -> RecurringSchedule:
    """Stop firing a schedule until :func:`resume_schedule` (occurrences meanwhile are not
    fired later).

    Raises:
        ScheduleError: no such schedule.
    """
    return _change(cfg, name, PAUSE, PAUSED, clock)


def resume_schedule(cfg: EngineConfig, name: str, clock: Clock | None = None) -> RecurringSchedule:
    """Fire a paused schedule again, from now.

    Raises:
        ScheduleError: no such schedule.
    """
    return _change(cfg, name, RESUME, ACTIVE, clock)


def delete_schedule(cfg: EngineConfig, name: str, clock: Clock | None = None) -> RecurringSchedule:
    """Delete a schedule (its history stays in the ``recurring`` table).

    Raises:
        ScheduleError: no such schedule.
    """
    return _change(cfg, name, DELETE, DELETED, clock)


def list_schedules(cfg: EngineConfig, deleted: bool = False) -> list[RecurringSchedule]:
    """The schedules (their newest revisions), by name.

    Example:
        >>> [s.name for s in list_schedules(cfg)]  # doctest: +SKIP
        ['every-15m', 'nightly']
    """
    schedules = read_schedules(recurring_table(cfg))
    return [s for _, s in sorted(schedules.items()) if deleted or s.state != DELETED]


def read_schedules(table: ArrowDelta, version: int | None = None) -> dict[str, RecurringSchedule]:
    """The newest revision of each schedule in ``table`` (at ``version``: as it was then)."""
    return {name: revs[-1] for name, revs in read_revisions(table, version).items()}


def read_revisions(
    table: ArrowDelta, version: int | None = None
) -> dict[str, list[RecurringSchedule]]:
    """Every revision of each schedule, oldest first (at ``version``, or the newest)."""
    if version is None:
        version = table.latest()
    if version < 0:
        return {}
    rows = table.dataset(version).to_table().to_pylist()
    found: dict[str, dict[int, RecurringSchedule]] = {}
    # A revision written twice (two writers at once): the later change wins, as in the view.
    for row in sorted(rows, key=_precedence):
        found.setdefault(row["name"], {})[int(row["revision"])] = _from_row(row)
    return {name: [revs[r] for r in sorted(revs)] for name, revs in found.items()}


def _precedence(row: Mapping[str, Any]) -> tuple[int, datetime, str, str]:
    """The order of revisions: by number, then (two of one number) by time, action, state."""
    return (int(row["revision"]), row["effective_ts"], row["action"] or "", row["state"] or "")


def _change(
    cfg: EngineConfig, name: str, action: str, state: str, clock: Clock | None
) -> RecurringSchedule:
    table = recurring_table(cfg)
    old = _existing(table, name)
    now = (clock or SystemClock()).now()
    schedule = replace(old, revision=old.revision + 1, action=action, state=state, effective=now)
    _append(table, schedule)
    return schedule


def revision_rows(schedules: Sequence[RecurringSchedule], schema: pa.Schema) -> pa.Table:
    """Revisions as ``recurring`` rows."""
    return pa.Table.from_pylist([_row(s) for s in schedules], schema=schema)


def _existing(table: ArrowDelta, name: str) -> RecurringSchedule:
    _check_name(name)
    old = read_schedules(table).get(name)
    if old is None or old.state == DELETED:
        raise ScheduleError("name", name, "no such schedule")
    return old


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ScheduleError("name", name, "1 to 80 letters, digits, '_', '.' or '-'")


def _catch_up(value: object) -> str:
    if value not in CATCH_UP:
        raise ScheduleError("catch_up", value, f"one of {', '.join(CATCH_UP)}")
    return str(value)


#: The longest catch-up window (a year).
MAX_CATCH_UP_WINDOW_MS = 366 * 86_400_000


def _window(value: object) -> int:
    try:
        ms = parse_duration_ms(str(value), "catch_up_window")
    except ConfigError:
        raise ScheduleError("catch_up_window", value, "expected a duration such as 1d") from None
    if ms > MAX_CATCH_UP_WINDOW_MS:
        raise ScheduleError("catch_up_window", value, "must be at most 366d")
    return ms


def _append(table: ArrowDelta, schedules: RecurringSchedule | list[RecurringSchedule]) -> None:
    """Append revisions in one commit."""
    many = schedules if isinstance(schedules, list) else [schedules]
    table.append(revision_rows(many, table.schema()))


def _row(schedule: RecurringSchedule) -> dict[str, Any]:
    rec = schedule.recurrence
    return {
        "name": schedule.name,
        "revision": schedule.revision,
        "action": schedule.action,
        "state": schedule.state,
        "effective_ts": schedule.effective,
        "topic": schedule.topic,
        "body": schedule.body,
        "keys": list(schedule.keys),
        "tags": schedule.tags,
        "properties": list(schedule.properties.items()),
        "kind": rec.kind,
        "expression": rec.expression,
        "time_zone": rec.time_zone,
        "start_ts": rec.start,
        "end_ts": rec.end,
        "jitter_ms": rec.jitter_ms,
        "catch_up": schedule.catch_up,
        "catch_up_window_ms": schedule.catch_up_window // timedelta(milliseconds=1),
    }


def _from_row(row: Mapping[str, Any]) -> RecurringSchedule:
    recurrence = Recurrence(
        row["kind"],
        row["expression"],
        row["time_zone"] or "UTC",
        row["start_ts"],
        row["end_ts"],
        int(row["jitter_ms"] or 0),
    )
    return RecurringSchedule(
        name=row["name"],
        revision=int(row["revision"]),
        state=row["state"],
        action=row["action"],
        effective=row["effective_ts"],
        topic=row["topic"],
        body=bytes(row["body"] or b""),
        recurrence=recurrence,
        catch_up=row["catch_up"] or DEFAULT_CATCH_UP,
        catch_up_window=timedelta(milliseconds=int(row["catch_up_window_ms"] or 0)),
        keys=tuple(row["keys"] or ()),
        tags=row["tags"],
        properties=dict(row["properties"] or []),
    )


__all__ = [
    "ACTIVE",
    "DELETED",
    "PAUSED",
    "RecurringSchedule",
    "create_schedule",
    "create_schedules",
    "delete_schedule",
    "list_schedules",
    "pause_schedule",
    "read_revisions",
    "read_schedules",
    "recurring_table",
    "resume_schedule",
    "revise",
    "revision_rows",
    "update_schedule",
]
