"""When a recurring schedule fires: a cron expression, a fixed rate, or listed times, in a
time zone.

A :class:`Recurrence` is validated once, when it is made (a bad field raises
:class:`~engine.core.errors.ScheduleError` naming it and its value), and then answers
:meth:`Recurrence.between`: its occurrences in a time span, as UTC instants.

* ``cron``: five fields, as ``crontab(5)``, evaluated in ``time_zone`` by CronSim, which
  follows Debian's cron across daylight-saving changes: a job at a time the spring-forward
  change skips (02:30 when clocks go from 02:00 to 03:00) runs at the change (03:00), a job
  at a time the fall-back change repeats (01:30 when clocks go from 02:00 back to 01:00)
  runs once, at the first; jobs that run every hour or more often run on the clock as it
  reads (both 01:30s).
* ``every``: a fixed rate in real time (``15m``, ``1h``), counted from ``start`` (else from
  the Unix epoch, so that ``15m`` fires at :00, :15, :30 and :45 UTC); daylight-saving
  changes do not move it.
* ``at``: listed instants (ISO 8601; a time without an offset is read in ``time_zone``; a
  local time that does not exist is moved forward by the gap, one that exists twice is its
  first).

Example:
    >>> every = Recurrence.parse(every="15m")
    >>> times = every.between(_utc(2026, 1, 1, 9, 1), _utc(2026, 1, 1, 9, 40))
    >>> [t.strftime("%H:%M") for t in times]
    ['09:15', '09:30']
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import islice
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from engine.core.clock import from_millis, to_millis, truncate_ms
from engine.core.errors import ConfigError, ScheduleError
from engine.core.levels import parse_duration_ms

CRON, EVERY, AT = "cron", "every", "at"
KINDS = (CRON, EVERY, AT)
#: Shortest fixed rate (a message a second per schedule).
MIN_EVERY_MS = 1000
#: Most listed times in one schedule.
MAX_AT = 1000


def _utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[arg-type, misc]


@dataclass(frozen=True)
class Recurrence:
    """When a schedule fires (validated; make it with :meth:`parse`).

    Attributes:
        kind: ``cron``, ``every`` or ``at``.
        expression: the cron expression, the rate (``15m``) or the listed times (ISO 8601,
            separated by spaces).
        time_zone: an IANA time zone (``Europe/Berlin``); ``UTC`` by default.
        start: no occurrence before it (and a rate counts from it).
        end: no occurrence after it.
        jitter_ms: each occurrence's message is due up to this much after the occurrence
            (a fixed share of it per occurrence, from its id: never early, the same on every
            replay).
    """

    kind: str
    expression: str
    time_zone: str = "UTC"
    start: datetime | None = None
    end: datetime | None = None
    jitter_ms: int = 0

    @classmethod
    def parse(
        cls,
        *,
        cron: str | None = None,
        every: str | None = None,
        at: Sequence[datetime | str] | str | None = None,
        time_zone: str = "UTC",
        start: datetime | str | None = None,
        end: datetime | str | None = None,
        jitter: str | int | None = None,
    ) -> Recurrence:
        """A recurrence from exactly one of ``cron``, ``every`` and ``at``.

        Raises:
            ScheduleError: naming the field and its value.

        Example:
            >>> Recurrence.parse(cron="30 2 * * *", time_zone="Europe/Berlin").kind
            'cron'
        """
        given = [(k, v) for k, v in ((CRON, cron), (EVERY, every), (AT, at)) if v is not None]
        if len(given) != 1:
            shown = ", ".join(k for k, _ in given) or "none"
            raise ScheduleError("when", shown, "give exactly one of cron, every and at")
        kind, value = given[0]
        zone = _zone(time_zone)
        first = _instant("start", start, zone)
        last = _instant("end", end, zone)
        if first is not None and last is not None and last <= first:
            raise ScheduleError("end", last.isoformat(), f"must be after start {first.isoformat()}")
        jitter_ms = _jitter(jitter)
        if kind == CRON:
            expression = " ".join(str(value).split())
            try:
                CronSim(expression, datetime(2026, 1, 1, tzinfo=zone))
            except CronSimError as err:
                raise ScheduleError("cron", value, str(err) or "not a cron expression") from None
        elif kind == EVERY:
            expression = str(value).strip()
            try:
                ms = parse_duration_ms(expression, "every")
            except ConfigError:
                raise ScheduleError("every", value, "expected a duration such as 15m") from None
            if ms < MIN_EVERY_MS:
                raise ScheduleError("every", value, "must be at least 1s")
        else:
            listed = value.split() if isinstance(value, str) else list(value)
            if not listed or len(listed) > MAX_AT:
                raise ScheduleError("at", value, f"give 1 to {MAX_AT} times")
            times = sorted({_instant("at", t, zone) for t in listed})  # type: ignore[type-var]
            # (two times within a millisecond are one: an occurrence's id is its millisecond)
            expression = " ".join(t.isoformat() for t in times if t is not None)
        return cls(kind, expression, time_zone, first, last, jitter_ms)

    def between(self, after: datetime, until: datetime) -> list[datetime]:
        """The occurrences in ``(after, until]``, in order, as UTC instants (``start`` and
        ``end`` included).

        Example:
            >>> Recurrence.parse(every="1h").between(_utc(2026, 1, 1), _utc(2026, 1, 1, 2))[-1]
            datetime.datetime(2026, 1, 1, 2, 0, tzinfo=datetime.timezone.utc)
        """
        span = self._clamped(after, until)
        return [] if span is None else list(self._occurrences(*span))

    def first(self, after: datetime, count: int, within: timedelta) -> list[datetime]:
        """The first ``count`` occurrences after ``after`` and within ``within`` of it, found
        without listing the rest.

        Example:
            >>> Recurrence.parse(every="1s").first(_utc(2026, 1, 1), 2, timedelta(days=366))[-1]
            datetime.datetime(2026, 1, 1, 0, 0, 2, tzinfo=datetime.timezone.utc)
        """
        span = self._clamped(after, after + within)
        return [] if span is None else list(islice(self._occurrences(*span), count))

    def count_between(self, after: datetime, until: datetime, cap: int = 100_000) -> int:
        """How many occurrences :meth:`between` would give: a fixed rate's counted without
        listing them, the others' one by one up to ``cap``.

        Example:
            >>> Recurrence.parse(every="1s").count_between(_utc(2026, 1, 1), _utc(2026, 1, 2))
            86400
        """
        span = self._clamped(after, until)
        if span is None:
            return 0
        if self.kind == EVERY:
            period = parse_duration_ms(self.expression, "every")
            anchor = to_millis(self.start) if self.start is not None else 0
            first = max(0, (to_millis(span[0]) - anchor) // period + 1)
            last = (to_millis(span[1]) - anchor) // period
            return max(0, int(last - first + 1))
        count = 0
        for _ in self._occurrences(*span):
            count += 1
            if count >= cap:
                break
        return count

    def _clamped(self, after: datetime, until: datetime) -> tuple[datetime, datetime] | None:
        """``(after, until]`` within ``start`` and ``end`` (None: nothing left)."""
        if self.start is not None and after < self.start:
            after = self.start - timedelta(microseconds=1)  # (start itself may occur)
        if self.end is not None and until > self.end:
            until = self.end
        return (after, until) if after < until else None

    def _occurrences(self, after: datetime, until: datetime) -> Iterator[datetime]:
        if self.kind == EVERY:
            period = parse_duration_ms(self.expression, "every")
            anchor = to_millis(self.start) if self.start is not None else 0
            k = max(0, (to_millis(after) - anchor) // period)
            while (ms := anchor + k * period) <= to_millis(until):
                if ms > to_millis(after):
                    yield from_millis(ms)
                k += 1
        elif self.kind == AT:
            for text in self.expression.split():
                t = datetime.fromisoformat(text).astimezone(UTC)
                if after < t <= until:
                    yield t
        else:
            zone = ZoneInfo(self.time_zone)
            for t in CronSim(self.expression, after.astimezone(zone)):
                if t > until:
                    return
                if t > after:  # (started inside a repeated hour, CronSim may give its first pass)
                    yield t.astimezone(UTC)

    def jitter(self, message_id: str) -> timedelta:
        """This occurrence's share of ``jitter_ms``: fixed by its id.

        Example:
            >>> Recurrence.parse(every="1m").jitter("any")
            datetime.timedelta(0)
        """
        if self.jitter_ms <= 0:
            return timedelta(0)
        digest = hashlib.blake2b(message_id.encode(), digest_size=8).digest()
        return timedelta(milliseconds=int.from_bytes(digest, "big") % self.jitter_ms)


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(str(name))
    except (ZoneInfoNotFoundError, ValueError):
        problem = "not an IANA time zone (such as Europe/Berlin)"
        raise ScheduleError("time_zone", name, problem) from None


def _instant(field: str, value: datetime | str | None, zone: ZoneInfo) -> datetime | None:
    """An aware UTC instant; a naive time is read in ``zone``."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ScheduleError(field, value, "expected an ISO 8601 time") from None
    if not isinstance(value, datetime):
        raise ScheduleError(field, value, "expected a datetime or an ISO 8601 time")
    if value.tzinfo is None:
        value = _local(value, zone)
    return truncate_ms(value.astimezone(UTC))  # (message ids and deliver times are in ms)


def _local(naive: datetime, zone: ZoneInfo) -> datetime:
    """A wall-clock time in ``zone``: its first instant when it occurs twice, and moved
    forward by the gap when a spring-forward change skips it (``fold=0`` reads a skipped
    time with the offset before the change)."""
    return naive.replace(tzinfo=zone, fold=0)


#: The longest jitter (a day): an occurrence's message is due at most this much after it.
MAX_JITTER_MS = 86_400_000


def _jitter(value: str | int | None) -> int:
    if value is None or value == 0:
        return 0
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ScheduleError("jitter", value, "expected a duration such as 30s")
    if isinstance(value, int):
        if value < 0:
            raise ScheduleError("jitter", value, "must not be negative")
        ms = value
    else:
        try:
            ms = parse_duration_ms(value, "jitter")
        except ConfigError:
            raise ScheduleError("jitter", value, "expected a duration such as 30s") from None
    if ms > MAX_JITTER_MS:
        raise ScheduleError("jitter", value, "must be at most 1d")
    return ms
