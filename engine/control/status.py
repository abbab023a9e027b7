"""What the engine holds right now: sent, waiting to be stamped, pending per queue,
delivered, quarantined, cancelled. Counted by the delivery rounds and kept in the
checkpoint: no scan of ``schedule``, whose size grows with the backlog.

Example:
    >>> read_status(spark, cfg, layout(cfg)).line(cfg.levels.label)  # doctest: +SKIP
    'sent 17 | to stamp 0 | pending none | delivered 17 | quarantined 0'
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pyspark.sql import SparkSession

from engine.core.clock import from_micros
from engine.core.config import EngineConfig
from engine.deliver.checkpoint import Progress, read_checkpoint
from engine.deliver.rates import rate_text
from engine.lakehouse.delta.live_files import LiveFiles
from engine.lakehouse.storage.layout import Layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Status:
    """What the engine holds right now.

    Attributes:
        sent: rows in ``commitlog``.
        unstamped: rows sent but not yet stamped (and seen by a delivery round) or quarantined.
        pending: per queue, stamped rows not yet delivered.
        delivered: per queue, rows delivered so far.
        quarantined: rows refused, with a reason in ``quarantine``.
        watermark: the committed delivery watermark.
        cancelled: rows cancelled (a reschedule cancels the old row and adds a new one).
        capped: per topic table with rows due and waiting for its delivery rate cap
            (``delivery.max_rate``): how many wait, the cap (per second), and when at the
            cap the last of them goes (ISO time, UTC).
    """

    sent: int
    unstamped: int
    pending: dict[int, int]
    delivered: dict[int, int]
    quarantined: int
    watermark: str
    cancelled: int = 0
    capped: dict[str, tuple[int, float, str]] = field(default_factory=dict)

    @property
    def pending_total(self) -> int:
        """Rows stamped and waiting."""
        return sum(self.pending.values())

    @property
    def idle(self) -> bool:
        """Nothing waits: every sent row is delivered, cancelled or quarantined."""
        return self.unstamped == 0 and self.pending_total == 0

    def line(self, label: Callable[[int], str]) -> str:
        """One progress line, e.g. ``pending L1 (1s)=3 | delivered 12 | quarantined 0``."""
        waiting = " ".join(f"{label(q)}={n}" for q, n in sorted(self.pending.items()) if n)
        cancelled = f" | cancelled {self.cancelled}" if self.cancelled else ""
        capped = "".join(
            f" | {topic}: {n:,} waiting for its cap of {rate_text(rate)}, clear at {clears[11:19]}"
            for topic, (n, rate, clears) in sorted(self.capped.items())
        )
        return (
            f"sent {self.sent} | to stamp {self.unstamped} | pending {waiting or 'none'}"
            f" | delivered {sum(self.delivered.values())}{cancelled}"
            f" | quarantined {self.quarantined}{capped}"
        )


class RowCounts:
    """Row counts of Delta tables from their logs' ``numRecords`` statistics, each table's log
    followed commit by commit from one call to the next: no Spark job.

    A Spark ``count()`` answers from the same statistics, but plans a query and rebuilds the
    table's snapshot with Spark each time: about 0.4 CPU-s for a status of two tables, which
    an engine asking every second (``--until-idle``, the progress line) spent most of a core
    on. A table with a file lacking statistics, or with deletion vectors, is counted by Spark.

    Example:
        >>> counts = RowCounts()  # doctest: +SKIP
        >>> counts(spark, "/lake/commitlog")  # doctest: +SKIP
        17
    """

    def __init__(self) -> None:
        self._live: dict[str, LiveFiles] = {}
        self._by_spark: set[str] = set()  # tables the logs' statistics cannot count
        self._lock = threading.Lock()  # a running engine's loop and a caller's thread may ask

    def __call__(self, spark: SparkSession, path: str) -> int:
        """The rows of the Delta table at ``path``, as of its latest version."""
        with self._lock:
            if path not in self._by_spark:
                live = self._live.setdefault(path, LiveFiles(path))
                try:
                    version = live.latest()
                    if version < 0:  # no table (yet): Spark says so
                        return _spark_count(spark, path)
                    rows = [f.rows for f in live.files(version)]
                except OSError:  # the store, for now: Spark counts this once
                    log.debug("%s: counted by Spark this time", path, exc_info=True)
                    live.reset()
                    return _spark_count(spark, path)
                except Exception:  # deletion vectors, a feature delta-rs cannot read...
                    log.debug("%s: counted by Spark", path, exc_info=True)
                    rows = [None]
                if all(n is not None for n in rows):
                    live.retire(version)  # only the live files are kept from call to call
                    return sum(n for n in rows if n is not None)
                # A file without statistics, or what only Spark reads: Spark counts this
                # table from now on (as it did every table before).
                self._by_spark.add(path)
                del self._live[path]
        return _spark_count(spark, path)


def _spark_count(spark: SparkSession, path: str) -> int:
    # A plain count(*) on a Delta table is answered from the log's statistics.
    return int(spark.read.format("delta").load(path).count())


def read_status(
    spark: SparkSession,
    cfg: EngineConfig,
    layout: Layout,
    progress: Progress | None = None,
    counts: RowCounts | None = None,
) -> Status:
    """Compute :class:`Status` from the tables (and the given or stored checkpoint).

    ``counts`` keeps what it read of the tables' logs for the next call (an engine asking
    again and again passes the same one).
    """
    count = counts or RowCounts()
    if progress is None:
        progress, _ = read_checkpoint(spark, layout)
    # Counted by the delivery rounds and kept in the checkpoint: no scan of `schedule`,
    # whose size grows with the backlog. Rows stamped since the last round show as unstamped.
    queues = progress.queues.items()
    pending = {
        q: p.stamped_total - p.delivered_total - p.cancelled_total
        for q, p in queues
        if p.stamped_total
    }
    delivered = {q: p.delivered_total for q, p in queues if p.delivered_total}
    # Rows a reschedule added to `schedule` were not sent: they do not count as stamped sends.
    stamped_sends = sum(p.stamped_total - p.rescheduled_total for _, p in queues)
    rescheduled = sum(p.rescheduled_total for _, p in queues)
    sent = count(spark, layout.commitlog)
    quarantined = count(spark, layout.quarantine)
    return Status(
        sent=sent,
        unstamped=max(sent - stamped_sends - quarantined, 0),
        pending=pending,
        delivered=delivered,
        quarantined=quarantined,
        watermark=progress.watermark.isoformat(timespec="milliseconds"),
        cancelled=sum(p.cancelled_total for _, p in queues) - rescheduled,
        capped={
            topic: (r.waiting, r.rate, from_micros(clears).isoformat(timespec="seconds"))
            for topic, r in progress.rates.items()
            if (clears := r.clears_us()) is not None
        },
    )
