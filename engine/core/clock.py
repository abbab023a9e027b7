"""Time comes from here and nowhere else.

Logic takes a :class:`Clock` (or a ``now`` value); only :class:`SystemClock` reads the
wall clock. All times are timezone-aware UTC.

Example:
    >>> clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    >>> clock.advance(seconds=5).isoformat()
    '2026-01-01T00:00:05+00:00'
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc


class Clock(Protocol):
    """Something that says what time it is (UTC, timezone-aware)."""

    def now(self) -> datetime:
        """Return the current time."""
        ...


class SystemClock:
    """The wall clock, truncated to milliseconds (the precision Delta timestamps keep)."""

    def now(self) -> datetime:
        """Return the current UTC time, truncated to milliseconds."""
        return truncate_ms(datetime.now(UTC))


class FakeClock:
    """A clock that only moves when told to; for tests and replays."""

    def __init__(self, start: datetime) -> None:
        _require_aware(start)
        self._now = truncate_ms(start)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        """Return the fake current time."""
        with self._lock:
            return self._now

    def advance(self, seconds: float = 0.0, millis: int = 0) -> datetime:
        """Move the clock forward and return the new time."""
        with self._lock:
            self._now = self._now + timedelta(seconds=seconds, milliseconds=millis)
            return self._now

    def set(self, when: datetime) -> None:
        """Jump to ``when`` (may go backwards, to test clock moves)."""
        _require_aware(when)
        with self._lock:
            self._now = truncate_ms(when)


def truncate_ms(when: datetime) -> datetime:
    """Drop sub-millisecond digits so Python and Delta agree on a timestamp."""
    return when.replace(microsecond=(when.microsecond // 1000) * 1000)


def to_millis(when: datetime) -> int:
    """Milliseconds since the epoch for an aware datetime."""
    _require_aware(when)
    return (when - EPOCH) // timedelta(milliseconds=1)


def from_millis(ms: int) -> datetime:
    """The aware UTC datetime for milliseconds since the epoch."""
    return EPOCH + timedelta(milliseconds=ms)


def to_micros(when: datetime) -> int:
    """Microseconds since the epoch for an aware datetime (Spark's timestamp precision)."""
    _require_aware(when)
    return (when - EPOCH) // timedelta(microseconds=1)


def from_micros(us: int) -> datetime:
    """The aware UTC datetime for microseconds since the epoch."""
    return EPOCH + timedelta(microseconds=us)


def epoch_micros(times: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """A timestamp column as microseconds since the epoch (int64), :func:`to_micros` of each.

    Example:
        >>> epoch_micros(pa.array([EPOCH + timedelta(seconds=1)])).to_pylist()
        [1000000]
    """
    return pc.cast(pc.cast(times, pa.timestamp("us", tz="UTC")), pa.int64())


def _require_aware(when: datetime) -> None:
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"naive datetime {when!r}: all engine times are timezone-aware UTC")


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
