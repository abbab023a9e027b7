"""The injected clock: UTC-aware, millisecond precision, moves only when told."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from engine.core.clock import FakeClock, SystemClock, from_micros, from_millis, to_micros, to_millis


def test_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    assert clock.now() == clock.now()
    assert clock.advance(seconds=1.5) == datetime(2026, 1, 1, 0, 0, 1, 500_000, tzinfo=UTC)


def test_naive_times_are_refused() -> None:
    with pytest.raises(ValueError, match="naive"):
        FakeClock(datetime(2026, 1, 1))  # noqa: DTZ001 - the point of the test


def test_system_clock_is_utc_and_millisecond_precise() -> None:
    now = SystemClock().now()
    assert now.utcoffset() == timedelta(0)
    assert now.microsecond % 1000 == 0


def test_millis_round_trip() -> None:
    when = datetime(2026, 1, 1, 0, 0, 0, 123_000, tzinfo=UTC)
    assert from_millis(to_millis(when)) == when


def test_micros_round_trip_keeps_spark_precision() -> None:
    when = datetime(2026, 1, 1, 0, 0, 1, 700, tzinfo=UTC)
    assert to_micros(when) - to_micros(datetime(2026, 1, 1, tzinfo=UTC)) == 1_000_700
    assert from_micros(to_micros(when)) == when
