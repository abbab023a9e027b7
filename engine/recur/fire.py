"""Fire recurring schedules: each occurrence sends one message, exactly once, never early.

A running engine calls :meth:`Firing.run` about once a second. Each call that has something
to send is a *firing batch* ``n`` over the time span ``(H[n-1], H[n]]``, ``H[n]`` being the
clock plus :data:`LOOKAHEAD`: every occurrence in it becomes a timer message in
``commitlog``, due at the occurrence (plus its jitter), with the id
``<name>:<occurrence ms>``. The normal timer path stamps and delivers it, so it arrives on
time and never early; sent seconds ahead, the send is off the critical path.

Exactly once, across crashes and replays, as the delivery rounds do it:

1. the batch's plan (``n``, ``H[n-1]``, ``H[n]``, the clock, and the ``recurring`` versions it
   compares) is written first, put-if-absent, to ``_checkpoints/recurring``;
2. what the plan implies is computed from the plan alone (:func:`plan_batch`): the same
   messages on every replay;
3. the messages are appended to ``commitlog`` in one commit recording the ``txn``
   ``delayq-recurring``/``n``: a replay that finds it recorded appends nothing;
4. the batch is marked committed.

A change to a schedule applies to the occurrences after those already sent: a schedule
active throughout (updated) goes on from ``H[n-1]``; one made active (created, resumed)
fires from its activation and not before its last stop plus :data:`LOOKAHEAD`, past which
nothing of it was sent (:func:`_activated`). An occurrence's id does not depend on the
revision (stamping's deduplication would refuse a second copy, should writers' clocks lag).

A start after downtime finds occurrences older than :data:`GRACE` in its first span: the
schedule's ``catch_up`` says which fire (``skip``: none; ``latest``: the newest, once;
``all``: each within ``catch_up_window``, spread :data:`CATCH_UP_SPACING` apart from now).
The others are counted as skipped, in :attr:`Firing.skipped` and the log.

Example:
    >>> firing = Firing(cfg, clock)  # doctest: +SKIP
    >>> firing.run()  # doctest: +SKIP
    FireOutcome(batch=3, sent=12, skipped={})
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa

from engine.core.clock import Clock, SystemClock
from engine.core.config import EngineConfig
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.state.offset_log import OffsetLog
from engine.lakehouse.storage.layout import layout
from engine.lakehouse.storage.store import Store
from engine.recur.defs import (
    ACTIVE,
    DELETED,
    RecurringSchedule,
    read_revisions,
)
from engine.recur.policy import ALL, LATEST
from engine.recur.spec import Recurrence

log = logging.getLogger(__name__)

APP_ID = "delayq-recurring"
#: How far ahead of the clock occurrences are sent (stamped and waiting as timers by then).
LOOKAHEAD = timedelta(seconds=10)
#: An occurrence found this much past its time is *missed* (the engine was down): its
#: schedule's ``catch_up`` decides. Later ones fire, late.
GRACE = timedelta(seconds=60)
#: Missed occurrences fired by ``catch_up = all`` are due this far apart, from now.
CATCH_UP_SPACING = timedelta(milliseconds=100)
#: Firing batches kept in the log.
RETAIN = 200
#: The file each schedule's next occurrence is published in (in ``Layout.recurring_next``).
NEXT_FILE = "next.json"
#: How far ahead a schedule's next occurrence is looked for (beyond: looked for again later).
SEARCH = timedelta(days=366)


@dataclass(frozen=True)
class Span:
    """What a firing batch covers; written as its plan before anything is sent.

    Attributes:
        batch: the batch number.
        since: ``H[n-1]``: occurrences after it.
        horizon: ``H[n]``: occurrences up to it.
        now: the clock when planned (what is missed is judged against it).
        version: the ``recurring`` version whose schedules fire.
        before: the version the previous batch read (-1: none): a schedule whose newest
            revision differs changed in between.
        seen: the clock when ``before`` was read: a revision not in it was made later.
    """

    batch: int
    since: datetime
    horizon: datetime
    now: datetime
    version: int
    before: int
    seen: datetime

    def row(self, status: str) -> dict[str, Any]:
        return {
            "status": status, "batch": self.batch, "since": self.since.isoformat(),
            "horizon": self.horizon.isoformat(), "now": self.now.isoformat(),
            "version": self.version, "before": self.before, "seen": self.seen.isoformat(),
        }  # fmt: skip

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Span:
        return cls(
            int(row["batch"]),
            datetime.fromisoformat(row["since"]),
            datetime.fromisoformat(row["horizon"]),
            datetime.fromisoformat(row["now"]),
            int(row["version"]),
            int(row["before"]),
            datetime.fromisoformat(row["seen"]),
        )


@dataclass(frozen=True)
class Fired:
    """One occurrence a batch sends: its schedule (the revision), its time, when it is due."""

    schedule: RecurringSchedule
    occurrence: datetime
    deliver_at: datetime

    @property
    def msg_id(self) -> str:
        """The message's id: ``<name>:<occurrence ms>``."""
        return self.schedule.message_id(self.occurrence)


@dataclass(frozen=True)
class FireBatch:
    """What a batch does: the occurrences it sends, per schedule how many missed occurrences
    it skips."""

    fired: list[Fired] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    #: Per (name, revision) evaluated, its first occurrence after the span: for the next
    #: batch's ``upcoming``, once this one is done.
    upcoming: dict[tuple[str, int, datetime], datetime] = field(default_factory=dict)


@dataclass(frozen=True)
class FireOutcome:
    """What one :meth:`Firing.run` did (``batch`` -1: nothing to send)."""

    batch: int = -1
    sent: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


def plan_batch(
    before: Mapping[str, list[RecurringSchedule]],
    after: Mapping[str, list[RecurringSchedule]],
    span: Span,
    upcoming: dict[tuple[str, int, datetime], datetime] | None = None,
) -> FireBatch:
    """The occurrences and skips of a firing batch, from its plan alone.

    Args:
        before: each schedule's revisions as the previous batch read them.
        after: each schedule's revisions as this batch reads them.
        span: the batch's plan.
        upcoming: per revision (name, number, time), its first occurrence after the previous
            batch's horizon, where known (the batches' :attr:`FireBatch.upcoming`, merged once each
            is done). An unchanged schedule whose next occurrence is past this horizon is
            passed over without evaluating it (what makes 100,000 schedules cheap); the
            answer is the same without it.

    Example:
        >>> plan_batch({}, {"tick": [schedule]}, span).fired[0].msg_id  # doctest: +SKIP
        'tick:1767225660000'
    """
    out = FireBatch()
    upcoming = upcoming or {}
    times = _Times()
    for name, revisions in after.items():
        latest = revisions[-1]
        known = before.get(name)
        previous = known[-1] if known else None
        key = _key(latest)
        if previous is not None and _key(previous) == key:
            nxt = upcoming.get(key)
            if nxt is not None and nxt > span.horizon:
                continue  # unchanged, and nothing of it in this span
        if latest.state != ACTIVE:
            continue
        if (
            previous is not None
            and previous.state == ACTIVE
            and all(r.state == ACTIVE for r in revisions if r.revision > previous.revision)
        ):
            since = span.since  # active throughout (updated, or not): after what was sent
        else:  # made, or made active again since the previous batch read the schedules
            since = _activated(revisions)
            if span.before >= 0:  # (made after that read: a writer's clock behind the engine's)
                since = max(since, span.seen)
        _fire(latest, since, span, out, times)
        out.upcoming[key] = times.following(latest, span.horizon)
    return out


def _key(schedule: RecurringSchedule) -> tuple[str, int, datetime]:
    """A revision, also when two writers gave one number to two changes."""
    return (schedule.name, schedule.revision, schedule.effective)


def _activated(revisions: list[RecurringSchedule]) -> datetime:
    """From when a schedule made active again fires: its newest create or resume, and not
    before its newest stop (pause, delete) plus :data:`LOOKAHEAD`. A batch that sent its
    occurrences before the stop had not seen the stop, so it read the schedules before the
    stop was made and sent at most :data:`LOOKAHEAD` past that read: nothing is sent twice,
    and occurrences while it was stopped do not fire."""
    since = revisions[0].effective
    stopped: datetime | None = None
    active = False
    for r in revisions:
        if r.state == ACTIVE and not active:
            since = r.effective  # (a create or a resume)
        if r.state != ACTIVE and active:
            stopped = r.effective
        active = r.state == ACTIVE
    return since if stopped is None else max(since, stopped + LOOKAHEAD)


class _Times:
    """Occurrences within one batch, worked out once per recurrence and span: 100,000
    schedules on a few expressions cost a few evaluations, not 100,000."""

    def __init__(self) -> None:
        self._between: dict[tuple[Recurrence, datetime, datetime], list[datetime]] = {}
        self._count: dict[tuple[Recurrence, datetime, datetime], int] = {}
        self._next: dict[tuple[Recurrence, datetime], datetime] = {}

    def between(self, rec: Recurrence, after: datetime, until: datetime) -> list[datetime]:
        key = (rec, after, until)
        if key not in self._between:
            self._between[key] = rec.between(after, until)
        return self._between[key]

    def count(self, rec: Recurrence, after: datetime, until: datetime) -> int:
        key = (rec, after, until)
        if key not in self._count:
            self._count[key] = rec.count_between(after, until)
        return self._count[key]

    def following(self, schedule: RecurringSchedule, after: datetime) -> datetime:
        """The first occurrence after ``after``; without one within :data:`SEARCH`, the end
        of that search (look again once the horizon passes it)."""
        key = (schedule.recurrence, after)
        if key not in self._next:
            found = schedule.recurrence.first(after, 1, SEARCH)
            self._next[key] = found[0] if found else after + SEARCH
        return self._next[key]


def _fire(
    schedule: RecurringSchedule, since: datetime, span: Span, out: FireBatch, times_: _Times
) -> None:
    """Add ``schedule``'s occurrences in ``(since, span.horizon]``: on time, or missed."""
    missed_before = span.now - GRACE
    oldest = span.now - GRACE - schedule.catch_up_window
    rec = schedule.recurrence
    times = times_.between(rec, max(since, oldest), span.horizon)
    skipped = times_.count(rec, since, oldest) if since < oldest else 0
    missed = [t for t in times if t < missed_before]
    if missed:
        if schedule.catch_up == ALL:
            for i, t in enumerate(missed):
                out.fired.append(Fired(schedule, t, span.now + i * CATCH_UP_SPACING))
        elif schedule.catch_up == LATEST:
            t = missed[-1]
            out.fired.append(Fired(schedule, t, t))  # (due: delivered at once)
            skipped += len(missed) - 1
        else:
            skipped += len(missed)
    for t in times[len(missed) :]:
        out.fired.append(Fired(schedule, t, t + rec.jitter(schedule.message_id(t))))
    if skipped:
        out.skipped[schedule.name] = skipped


class Firing:
    """Fires the lakehouse's recurring schedules (:func:`plan_batch`), batch by batch.

    Args:
        cfg: engine configuration.
        clock: the time occurrences are judged by.
        send: appends rows (:func:`fired_rows`) to ``commitlog`` in one commit recording
            the ``txn`` (:func:`engine.produce.send.send_arrow`, without the session).
        published: called after each :meth:`publish` (the catalog names the view then).
    """

    def __init__(
        self,
        cfg: EngineConfig,
        clock: Clock | None = None,
        *,
        send: Callable[[pa.Table, Txn], object],
        published: Callable[[], object] = lambda: None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.layout = layout(cfg)
        self.log = OffsetLog(self.layout.checkpoint("recurring"))
        self.table = ArrowDelta(self.layout.recurring)
        self.commitlog = ArrowDelta(self.layout.commitlog)
        self._send = send
        self._published = published
        self._shown: tuple[int, datetime] | None = None  # (version, earliest next) published
        self._done: Span | None = None  # the last span covered (in memory, or committed)
        self._lock = threading.Lock()
        self._read: dict[int, dict[str, list[RecurringSchedule]]] = {}  # by table version
        self._upcoming: dict[tuple[str, int, datetime], datetime] = {}  # see plan_batch
        self.sent = 0
        self.skipped = 0
        self._skipped: dict[str, int] | None = None  # per schedule, as published (see _start)
        #: The newest batches that sent: (occurrences, seconds from planning to committed).
        self.timings: deque[tuple[int, float]] = deque(maxlen=100)

    def run(self) -> FireOutcome:
        """Fire what is due up to the clock plus :data:`LOOKAHEAD` (a pending plan first).

        Example:
            >>> firing.run().sent  # doctest: +SKIP
            12
        """
        with self._lock:
            started = time.monotonic()
            now = self.clock.now()  # (before the read: what the read misses is made after it)
            version = self.table.latest()
            if version < 0:
                return FireOutcome()  # no schedule was ever made
            pending = self._start()
            if pending is not None:
                return self._apply(pending)
            done = self._done
            assert done is not None
            horizon = max(now + LOOKAHEAD, done.horizon)
            span = Span(done.batch + 1, done.horizon, horizon, now, version, done.version, done.now)
            work = self._plan(span)
            if not work.fired and not work.skipped:
                # nothing to send: covered without a write (a restart plans it again)
                self._done = replace(span, batch=done.batch)
                self._upcoming.update(work.upcoming)
                self._publish(now, version)
                return FireOutcome()
            try:
                self.log.write(span.batch, [span.row("planned")], planned=True, exclusive=True)
            except BaseException:
                self._done = None  # (another writer's plan for it: the next call replays it)
                raise
            outcome = self._apply(span, work)
            self.timings.append((outcome.sent, time.monotonic() - started))
            self._publish(now, version)
            return outcome

    def _publish(self, now: datetime, version: int) -> None:
        """Write each schedule's next occurrence not sent yet (none while paused) and how
        many of its occurrences were skipped so far, for the ``schedules`` view
        (:data:`NEXT_FILE`): when the schedules changed, the engine has sent a published
        next occurrence, or some were skipped. (Counted from what is sent, it is rewritten
        right after a batch, 10 s before the occurrences fall due, not at the instant many
        may fall due together.)"""
        assert self._done is not None
        sent_to = self._done.horizon
        if self._shown is not None and self._shown[0] == version and sent_to < self._shown[1]:
            return
        times, earliest, lines = _Times(), sent_to + SEARCH, []
        skipped = self._skipped or {}
        for name, revisions in self._revisions(version).items():
            latest = revisions[-1]
            if latest.state == DELETED:
                continue
            active = latest.state == ACTIVE  # (a paused one: its skipped total, no next)
            upcoming = times.following(latest, sent_to) if active else sent_to + SEARCH
            earliest = min(earliest, upcoming)
            found = upcoming < sent_to + SEARCH
            row = {"name": name, "revision": latest.revision, "published_ts": now.isoformat(),
                   "next_fire_ts": upcoming.isoformat() if found else None,
                   "skipped_total": skipped.get(name, 0)}  # fmt: skip
            lines.append(json.dumps(row))
        text = "".join(line + "\n" for line in lines)
        self.log.store.write(self._next_path, text.encode())
        self._shown = (version, earliest)
        self._published()

    @property
    def _next_path(self) -> str:
        return f"{self.layout.recurring_next}/{NEXT_FILE}"

    def reset(self) -> None:
        """Forget what this process knows of the batches (another engine may have fired
        since): the next run reads the log again, as a start does."""
        with self._lock:
            self._done = None
            self._upcoming = {}

    def caught_up(self) -> bool:
        """Whether the schedules as they are now have been looked at and what falls due within
        the next seconds is sent (and so pending); ``delayq run --until-idle`` waits for it.
        Occurrences further ahead, not yet sent, do not count.

        Example:
            >>> firing.caught_up()  # doctest: +SKIP
            True
        """
        with self._lock:
            version = self.table.latest()
            if version < 0:
                return True
            done = self._done  # (a replayed batch's horizon can be behind: the next run's)
            ahead = self.clock.now() + LOOKAHEAD / 2
            return done is not None and done.version == version and done.horizon > ahead

    def _start(self) -> Span | None:
        """Load the last batch on the first call; a batch planned and not committed."""
        if self._done is not None:
            return None
        if self._skipped is None:  # (the totals so far: what the last engine published)
            self._skipped = _published_skips(self.log.store, self._next_path)
        last, rows, planned = self.log.latest()
        if last is not None and rows:
            self._done = Span.from_row(rows[0])
        else:
            now = self.clock.now()
            self._done = Span(-1, now, now, now, -1, -1, now)  # a first start: from now
        if planned:
            return Span.from_row(planned[0])
        return None

    def _revisions(self, version: int) -> dict[str, list[RecurringSchedule]]:
        """The schedules' revisions at ``version`` (read once; the two newest are kept)."""
        if version < 0:
            return {}
        if version not in self._read:
            self._read = {v: r for v, r in self._read.items() if v > version - 2}
            self._read[version] = read_revisions(self.table, version)
        return self._read[version]

    def _plan(self, span: Span) -> FireBatch:
        before, after = self._revisions(span.before), self._revisions(span.version)
        return plan_batch(before, after, span, self._upcoming)

    def _apply(self, span: Span, work: FireBatch | None = None) -> FireOutcome:
        """Carry out a planned batch (its plan is written): the send, then the commit. A
        failure leaves the plan to be replayed by the next call, as after a restart."""
        try:
            work = work or self._plan(span)
            recorded = self.commitlog.txn_version(APP_ID)
            if work.fired and (recorded is None or recorded < span.batch):
                self._send(fired_rows(work.fired), Txn(APP_ID, span.batch))
            self.log.write(span.batch, [span.row("committed")])
        except BaseException:
            self._done = None  # the next call reads the log again: it finds the plan
            raise
        self._upcoming.update(work.upcoming)
        if span.batch > RETAIN:
            self.log.purge(span.batch - RETAIN)
        self._done = span
        self.sent += len(work.fired)
        for name, n in work.skipped.items():
            self.skipped += n
            totals = self._skipped if self._skipped is not None else {}
            totals[name] = totals.get(name, 0) + n
            self._skipped = totals
            self._shown = None  # (published with the next run)
            log.warning("recurring schedule %s: %d missed occurrence(s) skipped", name, n)
        return FireOutcome(span.batch, len(work.fired), work.skipped)


def _published_skips(store: Store, path: str) -> dict[str, int]:
    """Per schedule, the skipped occurrences the last published file counts (none: {})."""
    data = store.read(path)
    if data is None:
        return {}
    found = {}
    for line in data.decode("utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            found[row["name"]] = int(row.get("skipped_total") or 0)
    return found


#: The ``commitlog`` columns a firing batch sends (``store_ts`` is the commit's).
_ROW_TYPES = {
    "msg_id": pa.string(),
    "topic": pa.string(),
    "keys": pa.list_(pa.string()),
    "tags": pa.string(),
    "properties": pa.map_(pa.string(), pa.string()),
    "body": pa.binary(),
    "deliver_at": pa.timestamp("us", tz="UTC"),
}


def fired_rows(fired: list[Fired]) -> pa.Table:
    """The ``commitlog`` rows of fired occurrences (their templates were checked when the
    schedules were made).

    Example:
        >>> fired_rows(batch.fired).column_names[:2]  # doctest: +SKIP
        ['msg_id', 'topic']
    """
    columns: dict[str, list[Any]] = {name: [] for name in _ROW_TYPES}
    for f in fired:
        schedule = f.schedule
        columns["msg_id"].append(f.msg_id)
        columns["topic"].append(schedule.topic)
        columns["keys"].append(list(schedule.keys))
        columns["tags"].append(schedule.tags)
        columns["properties"].append(list(schedule.properties.items()))
        columns["body"].append(schedule.body)
        columns["deliver_at"].append(f.deliver_at)
    return pa.table({name: pa.array(values, _ROW_TYPES[name]) for name, values in columns.items()})
