"""How late a round's rows were delivered, counted into fixed buckets.

A row's lateness is its ``delivered_ts`` (the round's write time, the column of that name in
its topic table) minus its ``deliver_ts``; never negative, since a round delivers only rows
due at or before its watermark. A round keeps counts per bucket, not the values, so the
engine's running totals (and the metrics built on them) stay the same size however many rows
it delivers.

Example:
    >>> from datetime import UTC, datetime, timedelta
    >>> noon = datetime(2026, 1, 1, 12, tzinfo=UTC)
    >>> due = pa.array([noon + timedelta(milliseconds=900)], pa.timestamp("us", "UTC"))
    >>> late = Lateness.of(due, noon + timedelta(seconds=1))
    >>> late.n, late.counts[:3], round(late.total_s, 3), round(late.max_s, 3)
    (1, (0, 1, 0), 0.1, 0.1)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pyarrow as pa

from engine.core.clock import epoch_micros, to_micros

#: Upper bounds of the buckets in seconds (a row counts in the first bound it is at or below;
#: anything later in a last, unbounded bucket), as Prometheus histograms count them.
LATENESS_BOUNDS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)


@dataclass(frozen=True)
class Lateness:
    """Rows per lateness bucket, with their count and summed lateness.

    Attributes:
        counts: rows per bucket of :data:`LATENESS_BOUNDS`, plus one for later ones (not
            cumulative).
        total_s: the rows' lateness summed, in seconds.
        n: the rows.
        max_s: the latest row's lateness, in seconds.
    """

    counts: tuple[int, ...] = (0,) * (len(LATENESS_BOUNDS) + 1)
    total_s: float = 0.0
    n: int = 0
    max_s: float = 0.0

    @classmethod
    def of(cls, deliver_ts: pa.Array | pa.ChunkedArray, delivered: datetime) -> Lateness:
        """The lateness of rows due at ``deliver_ts``, delivered at ``delivered``.

        Example:
            >>> from datetime import UTC
            >>> Lateness.of(pa.array([], pa.timestamp("us", "UTC")), datetime.now(UTC)).n
            0
        """
        if len(deliver_ts) == 0:
            return cls()
        due_us = np.asarray(epoch_micros(deliver_ts))
        late_s = np.maximum(to_micros(delivered) - due_us, 0) / 1e6
        buckets = np.searchsorted(np.asarray(LATENESS_BOUNDS), late_s, side="left")
        counts = np.bincount(buckets, minlength=len(LATENESS_BOUNDS) + 1)
        return cls(
            tuple(int(c) for c in counts), float(late_s.sum()), len(late_s), float(late_s.max())
        )

    def __add__(self, other: Lateness) -> Lateness:
        return Lateness(
            tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
            self.total_s + other.total_s,
            self.n + other.n,
            max(self.max_s, other.max_s),
        )

    def quantile(self, q: float) -> float:
        """The lateness (seconds) ``q`` of the rows were delivered within, estimated from the
        buckets as Prometheus' ``histogram_quantile`` does (linearly within the bucket it
        falls in) and never above :attr:`max_s`; 0 without rows.

        Example:
            >>> Lateness((0, 0, 10) + (0,) * (len(LATENESS_BOUNDS) - 2), 1.5, 10, 0.2).quantile(0.5)
            0.175
        """
        if self.n == 0:
            return 0.0
        rank = q * self.n
        below = 0
        for i, count in enumerate(self.counts):
            if count and below + count >= rank:
                low = LATENESS_BOUNDS[i - 1] if i > 0 else 0.0
                high = LATENESS_BOUNDS[i] if i < len(LATENESS_BOUNDS) else self.max_s
                return min(low + (high - low) * (rank - below) / count, self.max_s)
            below += count
        return self.max_s

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, rows at or below it)`` per bound and ``+Inf``, as Prometheus lists them.

        Example:
            >>> Lateness((1, 2) + (0,) * (len(LATENESS_BOUNDS) - 1), 0.2, 3).cumulative()[:2]
            [('0.05', 1), ('0.1', 3)]
        """
        running = np.cumsum(self.counts).tolist()
        names = [f"{b:g}" for b in LATENESS_BOUNDS] + ["+Inf"]
        return list(zip(names, (int(c) for c in running), strict=True))


__all__ = ["LATENESS_BOUNDS", "Lateness"]
