"""RocketMQ-style fixed delay levels.

A level table comes from a string such as ``"1s 5s 10s 30s 1m 2m"``: level ``i`` (1-based)
is the ``i``-th entry. Level ``<= 0`` (or none) means "not delayed"; a level above the
maximum is clamped to the maximum.

Example:
    >>> table = parse_levels("1s 5s 10s")
    >>> table.max_level, table.delay_ms(2), table.delay_ms(99)
    (3, 5000, 10000)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.core.errors import ConfigError

#: RocketMQ 4.x's ``messageDelayLevel`` default: 18 levels.
DEFAULT_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"

_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_TOKEN = re.compile(r"^(\d+)(ms|s|m|h|d)$")


def parse_duration_ms(token: str, key: str = "duration") -> int:
    """Parse one duration such as ``"5s"``, ``"2m"``, ``"250ms"`` into milliseconds.

    Raises:
        ConfigError: naming ``key`` and the token when it does not parse.
    """
    match = _TOKEN.match(token.strip())
    if not match:
        raise ConfigError(key, token, "expected a number followed by one of ms, s, m, h, d")
    return int(match.group(1)) * _UNIT_MS[match.group(2)]


@dataclass(frozen=True)
class LevelTable:
    """The delay of each level, in milliseconds; ``delays_ms[0]`` is level 1."""

    delays_ms: tuple[int, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.delays_ms:
            raise ConfigError("levels", self.source, "at least one level is required")
        for i, delay in enumerate(self.delays_ms, start=1):
            if delay <= 0:
                raise ConfigError("levels", self.source, f"level {i} must be a positive delay")

    @property
    def max_level(self) -> int:
        """The highest level; higher requests are clamped to it."""
        return len(self.delays_ms)

    def clamp(self, level: int | None) -> int:
        """Map a requested level to the level used: 0 for "not delayed", else 1..max."""
        if level is None or level <= 0:
            return 0
        return min(level, self.max_level)

    def delay_ms(self, level: int | None) -> int:
        """Delay for a requested level after clamping (0 when not delayed)."""
        used = self.clamp(level)
        return 0 if used == 0 else self.delays_ms[used - 1]

    def label(self, level: int) -> str:
        """Human label of a level, e.g. ``"L3 (10s)"``; ``"L0 (now)"`` for not delayed."""
        if level < 0:
            return "timer"
        if level == 0:
            return "L0 (now)"
        tokens = self.source.split()
        if len(tokens) == self.max_level:
            return f"L{level} ({tokens[self.clamp(level) - 1]})"
        return f"L{level} ({self.delay_ms(level)}ms)"


def parse_levels(text: str, key: str = "levels") -> LevelTable:
    """Parse a RocketMQ level string; a bad token fails naming the key and the token.

    Args:
        text: space-separated durations, e.g. ``"1s 5s 10s 30s 1m"``.
        key: the configuration key the string came from, for the error message.

    Raises:
        ConfigError: when the string is empty or a token does not parse.
    """
    tokens = text.split()
    if not tokens:
        raise ConfigError(key, text, "at least one level is required")
    delays = []
    for token in tokens:
        try:
            delays.append(parse_duration_ms(token, key))
        except ConfigError:
            raise ConfigError(
                key, text, f"bad token {token!r}: expected e.g. 5s, 2m, 1h, 1d"
            ) from None
    return LevelTable(tuple(delays), source=" ".join(tokens))
