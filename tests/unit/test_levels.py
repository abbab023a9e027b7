"""Level tables: parsing, clamping, and errors that name the bad token."""

from __future__ import annotations

import pytest

from engine.core.errors import ConfigError
from engine.core.levels import DEFAULT_LEVELS, parse_duration_ms, parse_levels


def test_default_table_is_rocketmq_18_levels() -> None:
    table = parse_levels(DEFAULT_LEVELS)
    assert table.max_level == 18
    assert table.delay_ms(1) == 1_000
    assert table.delay_ms(5) == 60_000
    assert table.delay_ms(18) == 2 * 3_600_000


@pytest.mark.parametrize(
    ("token", "ms"),
    [("250ms", 250), ("5s", 5_000), ("2m", 120_000), ("1h", 3_600_000), ("1d", 86_400_000)],
)
def test_units(token: str, ms: int) -> None:
    assert parse_duration_ms(token) == ms


@pytest.mark.parametrize("level", [None, 0, -1, -100])
def test_level_zero_or_below_is_not_delayed(level: int | None) -> None:
    table = parse_levels("1s 2s 3s")
    assert table.clamp(level) == 0
    assert table.delay_ms(level) == 0


def test_level_above_max_is_clamped_to_max() -> None:
    table = parse_levels("1s 2s 3s")
    assert table.clamp(99) == 3
    assert table.delay_ms(99) == 3_000


@pytest.mark.parametrize("text", ["1s 5x 10s", "1s -5s", "1s five", "1.5s"])
def test_bad_token_fails_naming_it(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_levels(text)
    bad = next(t for t in text.split() if t not in {"1s", "10s"})
    assert repr(bad) in str(err.value)
    assert "levels" in str(err.value)


def test_empty_or_zero_levels_fail() -> None:
    with pytest.raises(ConfigError):
        parse_levels("   ")
    with pytest.raises(ConfigError, match="level 2 must be a positive delay"):
        parse_levels("1s 0s")


def test_labels_show_the_configured_token() -> None:
    table = parse_levels("1s 2m")
    assert table.label(0) == "L0 (now)"
    assert table.label(2) == "L2 (2m)"
