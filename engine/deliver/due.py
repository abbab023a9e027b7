"""What a delivery round delivers, in Arrow: its candidates, their summary, the topic rows.

A round ``k`` reads one ``schedule`` snapshot (version ``V_k``) and looks at the rows::

    deliver_ts <= W_k  AND  (deliver_ts > W_{k-1}  OR  stamp_batch > S_{k-1})

(due since the last round, or stamped since then and already due), plus, for its progress
only, the rows stamped since then that are not due yet. Both reads are Arrow scans of the
snapshot's files (:mod:`engine.lakehouse.delta.arrow_delta`); each file's Delta statistics skip the
files that cannot match, so a round's reads stay proportional to new and due rows however
many rows wait far ahead. A file whose statistics show every row stamped since the last
round and not due yet is counted from them (:func:`counted_summary`), not read: millions of
timers stamped while no round ran (a restart) cost the first round nothing. The same
snapshot and bounds give the same rows, which is what a replayed round relies on.

Example:
    >>> window = Window(after=w_prev, until=w_now, stamped_after=41)  # doctest: +SKIP
    >>> found = read_candidates(schedule.dataset(v), window, removed=set())  # doctest: +SKIP
    >>> found.deliver.num_rows, found.summary[0]["n"]  # doctest: +SKIP
    (12, 12)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from engine.core.clock import from_micros, to_micros
from engine.deliver.rates import Key, above, lowered_topic
from engine.lakehouse.delta.live_files import DataFile
from schemas import TOPIC, column_names

#: The columns a round needs of rows it does not deliver (counted for its progress only).
SUMMARY_COLUMNS = ("topic", "queue_id", "stamp_batch", "deliver_ts")

#: The Arrow type of the tables' timestamps (Spark's precision, UTC).
TS = pa.timestamp("us", tz="UTC")
#: The ``schedule`` columns whose file statistics choose the files a round reads.
WINDOW_STATS = ("deliver_ts", "stamp_batch")


@dataclass(frozen=True)
class Window:
    """The bounds of one round: ``(after, until]`` in deliver time, and stamping batches
    above ``stamped_after``; with ``batches`` ``(low, high)``, only the rows stamped in
    batches above ``low`` and up to ``high`` (``None``: no bound), for a round whose rows are
    written in parts (:mod:`engine.deliver.ahead`); with ``written`` ``(start, batch)``, not
    the rows due after ``start`` stamped up to ``batch`` (written ahead already); with
    ``held`` ``((topic, cursor), ...)``, rows of those topic tables above their cursor
    instead of those due after ``after`` (rows a rate cap left waiting,
    :mod:`engine.deliver.rates`); with ``read`` ``(after_us, until_us, batch, topics)``, not
    the rows of those topic tables due in ``(after_us, until_us]`` stamped up to ``batch``
    (read ahead of the round)."""

    after: datetime
    until: datetime
    stamped_after: int
    batches: tuple[int | None, int | None] | None = None
    written: tuple[datetime, int] | None = None
    #: Files :meth:`counted` accepts are counted from their statistics, not read.
    by_stats: bool = False
    held: tuple[tuple[str, Key], ...] = ()
    read: tuple[int, int, int, tuple[str, ...]] | None = None

    @property
    def floor(self) -> datetime:
        """Every row of this window stamped by ``stamped_after`` is due after this time:
        ``after``, or just before a held topic's cursor when earlier (rows at the cursor's
        own time may wait).

        Example:
            >>> from engine.core.clock import from_micros as us
            >>> Window(us(9), us(20), 4, held=(("t", (5, "a", 0)),)).floor == us(4)
            True
        """
        lowest = min((key[0] - 1 for _, key in self.held), default=None)
        if lowest is None or lowest >= to_micros(self.after):
            return self.after
        return from_micros(lowest)

    def counted(self, f: DataFile) -> bool:
        """Whether ``f``'s statistics show that every row of it is stamped since the last
        round and not due in this one (rows :meth:`new_not_due` would read only to count
        them): with :attr:`by_stats`, :func:`counted_summary` counts them instead.

        Example:
            >>> from engine.core.clock import from_micros as us
            >>> f = DataFile("f", {"queue_id": 1}, 2, {"deliver_ts": 9, "stamp_batch": 5},
            ...              {"deliver_ts": 9, "stamp_batch": 5},
            ...              nulls={"deliver_ts": 0, "stamp_batch": 0})
            >>> Window(us(0), us(8), 4, by_stats=True).counted(f)
            True
        """
        if not self.by_stats or self.batches is not None or f.rows is None:
            return False
        if f.partition.get("queue_id") is None or f.max("stamp_batch") is None:
            return False
        if any(f.nulls.get(c) != 0 for c in WINDOW_STATS):
            return False  # (a null compares as neither: such rows are not counted)
        low, bottom = f.min("deliver_ts"), f.min("stamp_batch")
        return (
            low is not None
            and bottom is not None
            and low > to_micros(self.until)
            and bottom > self.stamped_after
        )

    def due(self) -> ds.Expression:
        """Rows this round delivers (before cancels and reschedules take theirs out)."""
        deliver, batch = ds.field("deliver_ts"), ds.field("stamp_batch")
        until, after = pa.scalar(self.until, TS), pa.scalar(self.after, TS)
        recent = deliver > after
        if self.held:
            topic = lowered_topic()
            recent = recent & ~topic.isin([t for t, _ in self.held])
            for name, key in self.held:
                recent = recent | ((topic == name) & above(key))
        due = (deliver <= until) & (recent | (batch > self.stamped_after))
        if self.read is not None:
            start_us, end_us, read_upto, topics = self.read
            band = (deliver > pa.scalar(start_us, pa.int64()).cast(TS)) & (
                deliver <= pa.scalar(end_us, pa.int64()).cast(TS)
            )
            read = lowered_topic().isin(list(topics)) & band & batch.is_valid()
            due = due & ~(read & (batch <= read_upto))
        low, high = self.batches or (None, None)
        if low is not None:
            due = due & (batch > low)
        if high is not None:
            due = due & (batch <= high)
        if self.written is not None:  # (a row without a batch was not written ahead)
            start, upto = self.written
            due = due & ~((deliver > pa.scalar(start, TS)) & batch.is_valid() & (batch <= upto))
        return due

    def may_hold(self, f: DataFile) -> bool:
        """Whether a ``schedule`` file's statistics allow rows :meth:`due` or
        :meth:`new_not_due` would read (unknown statistics allow anything)."""
        if self.counted(f):
            return False  # (counted from its statistics)
        low, high, top = f.min("deliver_ts"), f.max("deliver_ts"), f.max("stamp_batch")
        if self.batches is not None:
            # (rows not due yet count only above stamped_after, which is at least ``low``
            # where a round has a bound; a window with ``high`` has no such rows)
            above, upto = self.batches
            bottom = f.min("stamp_batch")
            if (above is not None and top is not None and top <= above) or (
                upto is not None and bottom is not None and bottom > upto
            ):
                return False
        if self.written is not None and low is not None and top is not None:
            start, upto = self.written  # (every row of the file written ahead already?)
            if low > to_micros(start) and top <= upto <= self.stamped_after:
                return False
        until, after = to_micros(self.until), to_micros(self.floor)
        stamped = top is None or top > self.stamped_after
        due = (low is None or low <= until) and (high is None or high > after or stamped)
        return due or (stamped and (high is None or high > until))

    def passed(self, f: DataFile) -> bool:
        """Whether no round after this one can read a row of the file (every row due by
        ``after`` and stamped by ``stamped_after``): the file can be forgotten."""
        high, top = f.max("deliver_ts"), f.max("stamp_batch")
        return (
            high is not None
            and top is not None
            and (high <= to_micros(self.floor) and top <= self.stamped_after)
        )

    def follows(self, other: Window) -> bool:
        """Whether this window starts no earlier than ``other`` (files ``other`` passed
        stay passed)."""
        return self.floor >= other.floor and self.stamped_after >= other.stamped_after

    def new_not_due(self) -> ds.Expression:
        """Rows stamped since the last round that are not due yet (counted, not delivered)."""
        return (ds.field("stamp_batch") > self.stamped_after) & (
            ds.field("deliver_ts") > pa.scalar(self.until, TS)
        )


@dataclass(frozen=True)
class Candidates:
    """What a round found.

    Attributes:
        deliver: the rows to deliver (due, not taken out by a cancel or reschedule), with
            every ``schedule`` column.
        summary: one entry per ``topic, queue_id, _due, _new, _removed``: ``n`` rows, the
            highest ``max_batch`` and ``max_deliver_ms`` (deliver time, epoch ms).
        files: files the scans read (after the statistics skipped the others).
        rows: rows those files held.
    """

    deliver: pa.Table
    summary: list[dict[str, Any]]
    files: int
    rows: int


def read_candidates(
    dataset: ds.FileSystemDataset,
    window: Window,
    removed: Iterable[tuple[str, int]] = (),
) -> Candidates:
    """Read a round's candidates from a ``schedule`` snapshot.

    Args:
        dataset: the snapshot (:meth:`~engine.lakehouse.delta.arrow_delta.ArrowDelta.dataset`).
        window: the round's bounds.
        removed: ``(msg_id, revision)`` of rows cancels and reschedules took out of delivery
            (a missing revision counts as 0).

    Example:
        >>> found = read_candidates(snapshot, Window(w0, w1, 3))  # doctest: +SKIP
        >>> [r["n"] for r in found.summary if r["_due"]]  # doctest: +SKIP
        [12]
    """
    due_filter, later_filter = window.due(), window.new_not_due()
    fragments = list(dataset.get_fragments(filter=due_filter | later_filter))
    files = ds.FileSystemDataset(fragments, dataset.schema, dataset.format, dataset.filesystem)
    rows_read = sum(f.count_rows() for f in fragments)
    due = files.to_table(filter=due_filter)
    later = files.to_table(filter=later_filter, columns=list(SUMMARY_COLUMNS))
    is_new = pc.greater(due["stamp_batch"], window.stamped_after)
    is_removed = removed_mask(due, removed)
    summary = summary_of(due, is_new, is_removed, due=True) + summary_of(
        later, pa.repeat(True, later.num_rows), pa.repeat(False, later.num_rows), due=False
    )
    deliver = due.filter(pc.invert(is_removed))
    return Candidates(deliver, summary, len(fragments), rows_read)


def counted_summary(files: Iterable[DataFile], window: Window) -> list[dict[str, Any]]:
    """The summary entries of the files ``window`` counts from their statistics
    (:meth:`Window.counted`): per queue, the rows and the highest stamping batch. They are
    not due, so no topic or deliver time is needed (``None``).

    Example:
        >>> from engine.core.clock import from_micros as us
        >>> f = DataFile("f", {"queue_id": 1}, 2, {"deliver_ts": 9, "stamp_batch": 5},
        ...              {"deliver_ts": 9, "stamp_batch": 5},
        ...              nulls={"deliver_ts": 0, "stamp_batch": 0})
        >>> counted_summary([f, f], Window(us(0), us(8), 4, by_stats=True))[0]["n"]
        4
    """
    per_queue: dict[int, dict[str, Any]] = {}
    for f in files:
        if not window.counted(f):
            continue
        queue, rows, top = int(f.partition["queue_id"]), f.rows or 0, f.max("stamp_batch") or 0
        entry = per_queue.setdefault(
            queue,
            {
                "topic": None, "queue_id": queue, "_due": False, "_new": True,
                "_removed": False, "n": 0, "max_batch": top, "max_deliver_ms": None,
            },
        )  # fmt: skip
        entry["n"] += rows
        entry["max_batch"] = max(entry["max_batch"], top)
    return list(per_queue.values())


def removed_mask(rows: pa.Table, removed: Iterable[tuple[str, int]]) -> pa.ChunkedArray | pa.Array:
    """Which ``rows`` are ``(msg_id, revision)`` pairs in ``removed``."""
    pairs = {f"{msg_id}\x00{int(revision or 0)}" for msg_id, revision in removed}
    if not pairs or rows.num_rows == 0:
        return pa.repeat(False, rows.num_rows)
    zero = pa.scalar(0, rows.schema.field("revision").type)
    revision = pc.cast(pc.coalesce(rows["revision"], zero), pa.string())
    keys = pc.binary_join_element_wise(rows["msg_id"], revision, "\x00")
    return pc.fill_null(pc.is_in(keys, value_set=pa.array(sorted(pairs))), False)


def removed_marks(
    results: ds.Dataset, before_round: int, after: datetime, removing: Iterable[str]
) -> set[tuple[str, int]]:
    """``(msg_id, revision)`` that rounds before ``before_round`` took out of delivery, among
    rows due after ``after`` (earlier ones are no longer candidates).

    Args:
        results: a ``command_results`` snapshot.
        before_round: only outcomes decided before this round.
        after: only rows that were due after this time.
        removing: the outcomes that take a row out of delivery.
    """
    chosen = (
        (ds.field("round") < before_round)
        & ds.field("result").isin(list(removing))
        & (ds.field("deliver_ts") > pa.scalar(after, TS))
    )
    found = results.to_table(filter=chosen, columns=["msg_id", "revision"])
    pairs = zip(found["msg_id"].to_pylist(), found["revision"].to_pylist(), strict=True)
    return {(msg_id, int(revision or 0)) for msg_id, revision in pairs}


def summary_of(
    rows: pa.Table,
    is_new: pa.ChunkedArray | pa.Array,
    is_removed: pa.ChunkedArray | pa.Array,
    *,
    due: bool,
) -> list[dict[str, Any]]:
    """The :attr:`Candidates.summary` entries of ``rows``: one per ``topic, queue_id, _new,
    _removed``, with ``_due`` as given.

    Example:
        >>> rows = pa.table({"topic": ["t"], "queue_id": [1], "stamp_batch": [4],
        ...                  "deliver_ts": pa.array([2000], TS)})
        >>> summary_of(rows, pa.array([True]), pa.array([False]), due=True)[0]["n"]
        1
    """
    if rows.num_rows == 0:
        return []
    micros = pc.cast(pc.cast(rows["deliver_ts"], TS), pa.int64())  # exact, unlike floats
    keyed = pa.table(
        {
            "topic": rows["topic"],
            "queue_id": rows["queue_id"],
            "_new": is_new,
            "_removed": is_removed,
            "stamp_batch": rows["stamp_batch"],
            "deliver_us": micros,
        }
    )
    keys = ["topic", "queue_id", "_new", "_removed"]
    grouped = keyed.group_by(keys, use_threads=False).aggregate(
        [
            ("stamp_batch", "count", pc.CountOptions(mode="all")),
            ("stamp_batch", "max"),
            ("deliver_us", "max"),
        ]
    )
    return [
        {
            "topic": g["topic"],
            "queue_id": g["queue_id"],
            "_due": due,
            "_new": g["_new"],
            "_removed": g["_removed"],
            "n": g["stamp_batch_count"],
            "max_batch": g["stamp_batch_max"],
            # epoch ms, floored as Spark's unix_millis does (// floors negatives too)
            "max_deliver_ms": None if g["deliver_us_max"] is None else g["deliver_us_max"] // 1000,
        }
        for g in grouped.to_pylist()
    ]


def topic_tables(rows: pa.Table) -> dict[str, pa.Table]:
    """Split due rows by topic table (topic names in lower case: ``Orders`` and ``orders``
    share one table)."""
    if rows.num_rows == 0:
        return {}
    lowered = pc.utf8_lower(rows["topic"])
    # One stable sort, then one take per run of one name (rows keep their order within a
    # table): a filter per table cost a pass over every row for each of them. A take (not a
    # slice of the sorted rows) gives each table arrays of its own, without an offset.
    order = pc.sort_indices(lowered)
    keys = lowered.take(order).combine_chunks()
    n = len(keys)
    changed = pc.not_equal(keys.slice(1), keys.slice(0, n - 1))
    starts = [0, *(i + 1 for i in pc.indices_nonzero(changed).to_pylist())]
    ends = [*starts[1:], n]
    names = keys.take(pa.array(starts, pa.int64())).to_pylist()
    return {
        name: rows.take(order.slice(a, b - a))
        for name, a, b in zip(names, starts, ends, strict=True)
    }


def to_topic_rows(due: pa.Table, delivered_ts: datetime, round_: int) -> pa.Table:
    """Shape due ``schedule`` rows as topic-table rows (``TOPIC``'s columns, in its order)."""
    extra: Mapping[str, pa.Array] = {
        "delivered_ts": pa.repeat(pa.scalar(delivered_ts, TS), due.num_rows),
        "delivery_round": pa.repeat(pa.scalar(round_, pa.int64()), due.num_rows),
    }
    names = column_names(TOPIC)
    return pa.table({c: extra[c] if c in extra else due[c] for c in names})


__all__ = [
    "SUMMARY_COLUMNS",
    "TS",
    "WINDOW_STATS",
    "Candidates",
    "Window",
    "counted_summary",
    "read_candidates",
    "removed_marks",
    "removed_mask",
    "summary_of",
    "to_topic_rows",
    "topic_tables",
]
