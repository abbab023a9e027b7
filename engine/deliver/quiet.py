"""When nothing can fall due: the delivery query holds its watermark and runs no batch.

An idle engine's delivery query would otherwise run a micro-batch every
``delivery.poll_interval``: a Spark job's planning and progress for nothing, most of what the
driver spends while no message is due. After each round the engine records what it knows
(:class:`Quiet`): the batch it ran, the ``schedule`` and ``commands`` versions the round read,
and the earliest time a row of that ``schedule`` version may still fall due, from the files'
``deliver_ts`` statistics (:func:`next_due_us`). The clock source
(:class:`~engine.deliver.query.ClockReader`) then keeps the last batch's offset, so Spark runs
no batch, while :func:`next_offset` says so: the planned watermark has not reached that time,
no later version of either table exists, and the hold is younger than
``delivery.idle_interval``. When that time comes before the next trigger, the batch is planned
at it, and its round shows the rows at their time.

A hold only ever postpones a batch, so it cannot make a delivery early. It cannot make one
late either, as long as the record is right: a row reaches ``schedule`` only through a new
version (stamping, a round's reschedules), and a command only through a new ``commands``
version, either of which ends the hold at the next trigger. Whatever the record says, a hold
lasts at most ``delivery.idle_interval``. No record (at start, after a failed round, a plan
left to replay, commands waiting for their messages) means no hold.

Example:
    >>> quiet = Quiet(batch_end_ms=1_000, due_us=5_000_000, schedule=7, commands=2)
    >>> next_offset(quiet, 1_000, planned_ms=1_150, reach_ms=1_200, idle_ms=1_000,
    ...             newer=lambda q: False)
    1000
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from engine.lakehouse.delta.live_files import DataFile

#: The ``schedule`` column whose statistics say when a file's rows fall due.
DELIVER_TS = "deliver_ts"


@dataclass(frozen=True)
class Quiet:
    """What the last delivery round found, as the clock source reads it.

    Attributes:
        batch_end_ms: the watermark of the delivery query's batch that ran the round (its
            offset): a record of any other batch holds nothing.
        due_us: the earliest time a row of ``schedule`` version ``schedule`` may still fall
            due (epoch µs), or ``None`` when none is left to deliver.
        schedule: the ``schedule`` version the round read.
        commands: the ``commands`` version the round read (-1: no table yet).
    """

    batch_end_ms: int
    due_us: int | None
    schedule: int
    commands: int


def next_due_us(files: Iterable[DataFile], watermark_us: int) -> int | None:
    """The earliest ``deliver_ts`` above ``watermark_us`` the files may hold (epoch µs), from
    their statistics; ``None`` when no file holds a row above it.

    A file whose rows straddle the watermark may hold one just above it: the answer is then
    ``watermark_us + 1``, as it is for a file without statistics.

    Example:
        >>> done = DataFile("a", {}, 9, low={DELIVER_TS: 10}, high={DELIVER_TS: 20})
        >>> later = DataFile("b", {}, 9, low={DELIVER_TS: 80}, high={DELIVER_TS: 90})
        >>> next_due_us([done, later], watermark_us=50)
        80
        >>> next_due_us([done], watermark_us=50) is None
        True
    """
    soonest: int | None = None
    for f in files:
        low, high = f.min(DELIVER_TS), f.max(DELIVER_TS)
        if high is not None and high <= watermark_us:
            continue  # every row delivered (or cancelled) already
        if low is None or low <= watermark_us:
            return watermark_us + 1  # (none can be sooner)
        soonest = low if soonest is None else min(soonest, low)
    return soonest


def next_offset(
    quiet: Quiet | None,
    start_ms: int,
    planned_ms: int,
    reach_ms: int,
    idle_ms: int,
    newer: Callable[[Quiet], bool],
) -> int:
    """The clock source's next offset: ``start_ms`` to hold it (no batch), else the next
    batch's watermark.

    That is ``planned_ms``, except when the next row falls due after it but before the
    next trigger would plan: then the row's time, so that this batch takes the row at its
    time (its round waits for it before its commits) instead of the next one, up to a poll
    interval late.

    Args:
        quiet: the last round's record (``None``: none, no hold).
        start_ms: the last batch's watermark, the offset kept.
        planned_ms: the watermark the next batch would take (the clock plus the lead).
        reach_ms: the latest row's time this batch may be planned at (the clock plus the
            poll interval, as far as the round will take it; ``planned_ms``: never).
        idle_ms: the longest hold (``delivery.idle_interval``; 0: never hold).
        newer: whether a later version of ``schedule`` or ``commands`` than the record's
            exists (asked last: it looks at storage).

    Example:
        >>> quiet = Quiet(batch_end_ms=1_000, due_us=5_000_000, schedule=7, commands=-1)
        >>> next_offset(quiet, 1_000, 1_150, 1_200, 1_000, newer=lambda q: False)  # held
        1000
        >>> next_offset(quiet, 1_000, 4_850, 5_000, 9_000, newer=lambda q: False)  # at 5 s
        5000
    """
    if quiet is None or quiet.batch_end_ms != start_ms:
        return planned_ms
    due_ms = None if quiet.due_us is None else -(-quiet.due_us // 1000)
    if due_ms is not None and due_ms <= planned_ms:
        return planned_ms  # (due by then: the batch runs as planned)
    soon = due_ms is not None and due_ms <= reach_ms
    if not soon and planned_ms - start_ms >= idle_ms:
        return planned_ms
    if newer(quiet):
        return planned_ms
    return due_ms if soon and due_ms is not None else start_ms


def save_quiet(path: str, quiet: Quiet | None) -> None:
    """Write ``quiet`` to the local file ``path`` at once (a reader sees the old record or the
    new one, never a part); ``None`` removes the record.

    Example:
        >>> import os, tempfile
        >>> record = os.path.join(tempfile.mkdtemp(), "quiet.json")
        >>> save_quiet(record, None)  # (none there: nothing to remove)
    """
    if quiet is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    folder = os.path.dirname(path)
    fd, part = tempfile.mkstemp(dir=folder, prefix=".quiet-")
    with os.fdopen(fd, "w") as out:
        json.dump(asdict(quiet), out)
    os.replace(part, path)


def load_quiet(path: str) -> Quiet | None:
    """The record :func:`save_quiet` wrote at ``path`` (``None``: none, or not readable).

    Example:
        >>> import os, tempfile
        >>> load_quiet(os.path.join(tempfile.mkdtemp(), "quiet.json")) is None
        True
    """
    try:
        with open(path) as src:
            return Quiet(**json.load(src))
    except (OSError, ValueError, TypeError):
        return None


__all__ = ["Quiet", "load_quiet", "next_due_us", "next_offset", "save_quiet"]
