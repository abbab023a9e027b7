"""A mass of rows due at one instant, written ahead by Spark tasks and shown at that instant.

Many messages due at the same moment (a sale opening, a batch of timers, a backlog scheduled
for one time) make the round that reaches it long: it reads and writes every row after the
moment, so the last of them is late by the whole round. Their rows are known well before,
though: once stamped, they wait in ``schedule``. With ``delivery.mode = streaming``, the
delivery stage therefore looks ahead after each round (:func:`mass_due`): when ``schedule``'s
file statistics show more than ``delivery.driver_round_rows`` rows due within
:data:`SPREAD_US` of one instant ``T``, between :data:`SOONEST_S` and :data:`HORIZON_S` from
now, Spark tasks write their topic files ahead (:func:`~engine.deliver.tasks.deliver_on_executors`
in a background thread), unseen. The rounds before stop at the window's start ``X`` (just
before the first of those rows), and the round ``(X, T]`` then only commits the written files
(and the few rows stamped since, written on the driver), once the clock reaches ``T``.

That round's rows, its number and its ``delivered_ts`` (``T``) are fixed when the files are
written, so it takes a number ahead of the rounds that run meanwhile (:func:`ahead_round`):
round numbers stay increasing in commit order (what consumers' positions rely on), with a
gap. Its plan, written before its first commit as every round's, is an ordinary one
(``(X, T]`` at the ``schedule`` version it reads), so a crash after it is replayed exactly as
any round. The files are dropped (left to ``VACUUM``), and the rows delivered by ordinary
rounds, when anything could make them differ from what the round would read then: a cancel or
reschedule sent meanwhile, a failed job, a round number reached, a clock far past ``T``.

With a delivery rate cap (:mod:`engine.deliver.rates`), rounds run on the driver, and a mass
of a capped topic's rows is read ahead instead (:class:`ReadAhead`, in the same background
thread, any ``delivery.mode``): the round reaching ``T`` takes those rows as a backlog already
in order, reads the rest as usual, and files holding nothing but them are not read again.
Only a replay reads them again; its rows are the same.

Example:
    >>> mass_due([], now_us=0, rows_over=10) is None
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa
import pyarrow.dataset as ds

from engine.deliver.lateness import Lateness
from engine.deliver.rates import Backlog, read_ahead
from engine.deliver.tasks import Written
from engine.lakehouse.delta.live_files import DataFile, Part, files_dataset
from engine.lakehouse.storage.store import Store

#: How far ahead a mass of rows is looked for.
HORIZON_S = 30
#: How soon at the earliest: the tasks need the time to write its files.
SOONEST_S = 5
#: The widest spread of deliver times written ahead as one instant (a row is then shown up
#: to this much after its time, far less than a round reading it would take).
SPREAD_US = 10_000


@dataclass(frozen=True)
class Ahead:
    """A round written ahead, waiting for its instant.

    Attributes:
        after: the window's start ``X`` (the rounds before it stop there).
        until: its instant ``T``: the round's watermark and its rows' ``delivered_ts``.
        round: the round's number.
        batch: the highest stamping batch in that version (rows stamped since are the
            round's extra rows, written on the driver).
        commands_version: the ``commands`` version then (a later one drops the round).
        results_version: the ``command_results`` version then (likewise).
        jobs: the tasks' work, one job per layer (a mass stamped in several batches is
            written as it comes): the written files, the summary and lateness.
    """

    after: datetime
    until: datetime
    round: int
    batch: int
    commands_version: int
    results_version: int
    jobs: tuple[Future[Written], ...]

    def failed(self) -> bool:
        """Whether a job of it failed (or was cancelled)."""
        return any(j.done() and (j.cancelled() or j.exception() is not None) for j in self.jobs)

    @property
    def job_group(self) -> str:
        """The Spark job group its jobs run in (cancelled with it)."""
        return job_group(self.round)

    def written(self) -> Written:
        """Every job's files and summary as one, new at each call (waits for the jobs).

        Raises:
            Exception: what a job raised.
        """
        combined = Written(summary=[], files=0, rows=0, lateness=Lateness())
        for job in self.jobs:  # (a new one each time: the jobs' own are left as they are)
            combined.absorb(job.result())
        return combined


@dataclass(frozen=True)
class ReadAhead:
    """Rows of capped topics due in ``(after, until]``, stamped up to ``batch``, being read
    before the round that reaches them.

    Attributes:
        after: the window's start (the rounds before it stop there).
        until: its end.
        batch: the highest stamping batch the read takes.
        commands_version: the ``commands`` version then (a later one drops the read).
        results_version: the ``command_results`` version then (likewise).
        job: the rows as a backlog per topic (:func:`~engine.deliver.rates.read_ahead`), and
            the files (Arrow paths) the read took every row of.
    """

    after: datetime
    until: datetime
    batch: int
    commands_version: int
    results_version: int
    job: Future[tuple[dict[str, Backlog], frozenset[str]]]


def read_rows(
    parts: Iterable[Part], schema: pa.Schema, store: Store, rows: ds.Expression
) -> tuple[dict[str, Backlog], frozenset[str]]:
    """The rows of ``parts`` that ``rows`` selects, as a backlog per topic, and the files all
    of whose rows it selected (by their Arrow paths).

    Example:
        >>> read_rows([], schema, store, ds.field("topic") == "t")  # doctest: +SKIP
        (pyarrow.Table ..., frozenset())
    """
    tables, whole = [], set()
    for part in parts:
        found = files_dataset([part], schema, store).to_table(filter=rows)
        if part.rows and found.num_rows == part.rows:
            whole.add(part.path)
        tables.append(found)
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    return read_ahead(table), frozenset(whole)


def mass_due(
    files: Iterable[DataFile],
    *,
    now_us: int,
    rows_over: int,
    soonest_s: float = SOONEST_S,
    horizon_s: float = HORIZON_S,
    spread_us: int = SPREAD_US,
) -> tuple[int, int] | None:
    """The earliest instant with more than ``rows_over`` rows due at it, as ``(after, until)``
    in epoch µs (rows due in ``(after, until]``), from ``schedule`` files' statistics; ``None``
    when there is none between ``soonest_s`` and ``horizon_s`` from ``now_us``.

    Only files whose deliver times all fall within ``spread_us`` count (a file of one
    instant's rows); files with the same highest deliver time add up.

    Example:
        >>> f = DataFile("a", {}, 50, low={"deliver_ts": 9_000_000},
        ...              high={"deliver_ts": 9_001_000})
        >>> mass_due([f, f], now_us=0, rows_over=60)
        (8999999, 9001000)
    """
    soonest = now_us + int(soonest_s * 1e6)
    latest = now_us + int(horizon_s * 1e6)
    rows: dict[int, int] = {}
    first: dict[int, int] = {}
    for f in files:
        low, high = f.min("deliver_ts"), f.max("deliver_ts")
        if low is None or high is None or not soonest < low <= high <= latest:
            continue
        if high - low > spread_us:
            continue
        rows[high] = rows.get(high, 0) + (f.rows or 0)
        first[high] = min(first.get(high, low), low)
    for until in sorted(rows):
        if rows[until] > rows_over:
            return first[until] - 1, until
    return None


def job_group(round_: int) -> str:
    """The Spark job group of a round written ahead.

    Example:
        >>> job_group(303)
        'delayq-ahead-303'
    """
    return f"delayq-ahead-{round_}"


def ahead_round(last: int, until: datetime, now: datetime, poll_ms: int) -> int:
    """The number of a round written ahead for ``until``: above any round the running engine
    can commit before it (twice one a poll interval, and 100 more).

    Example:
        >>> from datetime import UTC, timedelta
        >>> t = datetime(2026, 1, 1, tzinfo=UTC)
        >>> ahead_round(41, t + timedelta(seconds=10), t, 200)
        242
    """
    seconds = max(0.0, (until - now).total_seconds())
    return last + 2 * math.ceil(seconds * 1000 / max(1, poll_ms)) + 101


__all__ = [
    "HORIZON_S",
    "SOONEST_S",
    "SPREAD_US",
    "Ahead",
    "ReadAhead",
    "ahead_round",
    "job_group",
    "mass_due",
    "read_rows",
]
