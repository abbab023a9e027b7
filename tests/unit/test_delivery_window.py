"""Delivery windows: stamping spreads a message over its window, the same way every time."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest

from engine.core.config import EngineConfig
from engine.core.errors import InvalidMessageError
from engine.core.message import Message, validate
from engine.stamp.transform import stamp

T0 = datetime(2026, 11, 29, 12, tzinfo=UTC)


def commitlog(n: int, window_ms: str | None, at: datetime = T0) -> pa.Table:
    props = [[("DELAYQ_WINDOW_MS", window_ms)] if window_ms else None] * n
    return pa.table(
        {
            "msg_id": [f"id-{i}" for i in range(n)],
            "topic": ["orders"] * n,
            "properties": pa.array(props, pa.map_(pa.string(), pa.string())),
            "body": [b"x"] * n,
            "store_ts": pa.array([T0] * n, pa.timestamp("us", tz="UTC")),
            "deliver_at": pa.array([at] * n, pa.timestamp("us", tz="UTC")),
        }
    )


def test_messages_due_at_one_instant_spread_evenly_over_their_window_never_before_it() -> None:
    rows, refused = stamp(commitlog(10_000, "10000"), EngineConfig(), 1, T0)
    assert refused.num_rows == 0
    times = rows["deliver_ts"].to_pylist()
    assert min(times) >= T0 and max(times) < T0 + timedelta(seconds=10)
    per_second = Counter(int((t - T0).total_seconds()) for t in times)
    assert sorted(per_second) == list(range(10))
    assert all(850 <= n <= 1150 for n in per_second.values()), per_second
    again, _ = stamp(commitlog(10_000, "10000"), EngineConfig(), 2, T0)
    assert again["deliver_ts"] == rows["deliver_ts"], "a replayed batch stamps the same times"


def test_messages_without_a_window_keep_their_time() -> None:
    rows, _ = stamp(commitlog(100, None), EngineConfig(), 1, T0)
    assert set(rows["deliver_ts"].to_pylist()) == {T0}


def test_a_bad_window_is_quarantined_naming_the_property_and_value() -> None:
    _, refused = stamp(commitlog(1, "5m"), EngineConfig(), 1, T0)
    assert refused["reason"].to_pylist() == [
        "property DELAYQ_WINDOW_MS '5m' is not a whole number of milliseconds from 1 to 86400000"
    ]


def test_a_window_given_by_the_producer_is_stored_as_its_property_and_checked() -> None:
    fields = validate(Message("orders", "x", delay="1m", window="30s"), EngineConfig(), T0)
    assert fields["properties"] == {"DELAYQ_WINDOW_MS": "30000"}
    for bad in ("2d", "soon", "0s"):
        with pytest.raises(InvalidMessageError) as err:
            validate(Message("orders", "x", window=bad), EngineConfig(), T0)
        assert (err.value.field, err.value.value) == ("window", bad)
    with pytest.raises(InvalidMessageError, match="DELAYQ_WINDOW_MS"):
        validate(Message("orders", "x", properties={"DELAYQ_WINDOW_MS": "-1"}), EngineConfig())
