"""Delta statistics and schema conforming of the log appender (no Spark)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest

from engine.lakehouse.delta import log_append
from engine.lakehouse.delta.log_append import conform, file_stats


def _rows(n: int, seed: int) -> pa.Table:
    pick = random.Random(seed)
    start = datetime(2026, 11, 1, tzinfo=UTC)  # New York falls back at 06:00 UTC
    words = ["a", "B", "é", "z", "Ω", "日本", "", "~", "ab"]

    def maybe(value: object) -> object:
        return None if pick.random() < 0.2 else value

    return pa.table(
        {
            "word": pa.array([maybe(pick.choice(words)) for _ in range(n)], pa.string()),
            "n": pa.array([maybe(pick.randint(-5, 5)) for _ in range(n)], pa.int32()),
            "at": pa.array(
                [maybe(start + timedelta(microseconds=pick.randint(0, 10**7))) for _ in range(n)],
                pa.timestamp("us", "UTC"),
            ),
            "local": pa.array(  # an autumn night's repeated hour: fold matters
                [maybe(start + timedelta(hours=5, minutes=pick.randint(0, 100))) for _ in range(n)],
                pa.timestamp("us", "UTC"),
            ).cast(pa.timestamp("us", "America/New_York")),
            "day": pa.array(
                [maybe(start.date() + timedelta(days=pick.randint(0, 9))) for _ in range(n)]
            ),
            "long": pa.array([maybe(pick.choice(words) * 20) for _ in range(n)], pa.large_string()),
            "none": pa.nulls(n, pa.int64()),
            "body": pa.array([b"x"] * n, pa.binary()),
        }
    )


@pytest.mark.parametrize("seed", range(20))
def test_statistics_of_small_files_are_the_ones_compute_gives(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _rows(random.Random(seed).randint(1, 40), seed)
    small = file_stats(rows)
    monkeypatch.setattr(log_append, "SMALL_FILE_ROWS", 0)  # every file through pc.min_max
    assert small == file_stats(rows)
    assert small["numRecords"] == rows.num_rows
    assert "body" not in small["nullCount"] and small["nullCount"]["none"] == rows.num_rows


def test_conform_casts_only_what_differs_and_fills_a_missing_nullable_column() -> None:
    schema = pa.schema([("a", pa.int64()), ("b", pa.string()), ("c", pa.int32())])
    rows = pa.table({"b": ["x"], "a": pa.array([1], pa.int32())})
    out = conform(rows, schema, "t")
    assert out.schema == schema
    assert out.to_pylist() == [{"a": 1, "b": "x", "c": None}]
    with pytest.raises(ValueError, match="t has no column z"):
        conform(pa.table({"z": [1]}), schema, "t")
    with pytest.raises(KeyError, match="t requires column a"):
        conform(
            pa.table({"b": ["x"]}),
            pa.schema([pa.field("a", pa.int64(), False), ("b", pa.string())]),
            "t",
        )


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_small_files_round_times_outwards_to_milliseconds_before_and_after_1970(
    unit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounds at millisecond precision never cut a row off: the minimum rounds down and the
    maximum up, also before the epoch, and the few-rows path says what pc.min_max says."""
    values = [-1_500_001, -1, 0, 2_000_999, 1_764_000_000_123_456]
    at = pa.array(values, pa.timestamp("us", "UTC")).cast(pa.timestamp(unit, "UTC"), safe=False)
    rows = pa.table({"at": at})
    small = file_stats(rows)
    monkeypatch.setattr(log_append, "SMALL_FILE_ROWS", 0)
    assert small == file_stats(rows)
    if unit == "us":
        assert small["minValues"]["at"] == "1969-12-31T23:59:58.499Z"
        assert small["maxValues"]["at"] == "2025-11-24T16:00:00.124Z"
