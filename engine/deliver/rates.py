"""Delivery rate caps: at most ``max_rate`` messages a second into a topic table.

When more rows of a capped topic fall due than its cap allows, a round delivers the first
ones in ``(deliver_ts, msg_id, revision)`` order and the rest wait, still in ``schedule``,
for the next rounds: the topic's backlog drains at the cap, never early, and each message's
extra wait shows as ``delivered_ts - deliver_ts`` in its topic table.

The allowance is a generic cell rate (a leaky bucket kept as one time per topic, ``tat_ns``):
a row may go at ``max(its deliver_ts, tat)``, and each row sent moves ``tat`` on by
``1 / max_rate``; unused allowance is kept at most :data:`BURST_S`. A round with watermark
``W`` therefore delivers ``floor((W - base) * rate) + 1`` of the topic's due rows, where
``base = max(tat, W - BURST_S, the first row's deliver_ts)``.

What waits is named by a cursor per topic, the key of the last row delivered (or a key
above every row due by the previous watermark): every row of the topic at or below it is
delivered, every due row above it waits. A round's window reads, for such a topic, the rows
above its cursor instead of those after the previous watermark (:class:`Waiting`). The
cursors and ``tat`` are part of the committed progress, and a round's caps part of its plan:
a replay computes the same rows whatever the configuration says by then.

Example:
    >>> import pyarrow as pa
    >>> from engine.deliver.due import TS
    >>> rows = pa.table({"topic": ["t"] * 3, "msg_id": ["a", "b", "c"],
    ...     "revision": pa.array([0, 0, 0], pa.int32()),
    ...     "deliver_ts": pa.array([1_000_000] * 3, TS), "stamp_batch": [1, 1, 1],
    ...     "queue_id": [-1] * 3})
    >>> out = cap_rows(rows, {"t": 1.0}, {}, watermark_us=1_500_000, after_us=0)
    >>> out.deliver.num_rows, out.state["t"].waiting, out.state["t"].cursor
    (1, 2, (1000000, 'a', 0))
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

#: Allowance a topic keeps unused at most: a round after a pause sends this much at once,
#: and a round after a long one (the first after a mass fell due reads all of it, about
#: 1.5 s for a million rows on two cores) catches up with the cap's pace.
BURST_S = 2.0
#: A msg_id and revision above any (a cursor at the end of an instant).
TOP_ID = "\U0010ffff"
TOP_REVISION = 2**62
#: Every topic without a cap of its own.
DEFAULT = "*"

Key = tuple[int, str, int]


@dataclass(frozen=True)
class TopicRate:
    """A capped topic's state after a round.

    Attributes:
        tat_ns: the earliest time (epoch ns) the cap lets its next row go.
        cursor: ``(deliver_us, msg_id, revision)``: every row of the topic at or below it
            is delivered; ``None`` when no due row waits (the topic follows the watermark).
        waiting: due rows left waiting by the round.
        rate: the cap that left them (messages per second).
    """

    tat_ns: int
    cursor: Key | None = None
    waiting: int = 0
    rate: float = 0.0

    def clears_us(self) -> int | None:
        """When, at the cap, the rows waiting will all have gone (epoch us); ``None`` when
        none wait.

        Example:
            >>> TopicRate(tat_ns=10**9, cursor=(0, "a", 0), waiting=50, rate=100.0).clears_us()
            1500000
        """
        if not self.waiting or not self.rate:
            return None
        return (self.tat_ns + math.ceil(self.waiting * 1e9 / self.rate)) // 1000


@dataclass(frozen=True)
class Backlog:
    """A capped topic's due rows in key order, as a round left them waiting: the driver
    keeps it for the next round, which then reads only the rows that are new since.

    Attributes:
        rows: ``schedule`` rows with the key columns ``_us``, ``_id``, ``_rev`` added (rows
            already delivered stay until half of them are: :meth:`compacted`).
        order: indices into ``rows`` of the waiting ones, in key order.
        round: the committed round that left them waiting.
        cursor: that round's cursor for the topic.
        checked: the cancel and reschedule marks (``msg_id + "\x00" + revision``) already
            taken out of ``order``.
    """

    rows: pa.Table
    order: pa.Array
    round: int = -1
    cursor: Key | None = None
    checked: frozenset[str] = frozenset()

    @property
    def size(self) -> int:
        """Rows waiting."""
        return len(self.order)

    def last_key(self) -> Key:
        """The highest key waiting."""
        return _key(self.rows, self.order[-1].as_py())

    def without(self, removed: frozenset[str]) -> Backlog:
        """The backlog without the rows ``removed`` names (only marks not ``checked`` yet are
        looked for: a round's marks are mostly those of earlier rounds)."""
        new = removed - self.checked
        if not new or self.size == 0:
            return replace(self, checked=removed)
        marks = pa.array(sorted(new), pa.string())
        named = _is_removed(self.rows.select(["msg_id", "revision"]).take(self.order), marks)
        return replace(self, order=self.order.filter(pc.invert(named)), checked=removed)

    def compacted(self) -> Backlog:
        """The same rows, without those delivered once they are half of ``rows``."""
        if 2 * self.size >= self.rows.num_rows:
            return self
        rows = self.rows.take(self.order)
        return replace(self, rows=rows, order=pa.array(range(rows.num_rows), pa.int64()))


@dataclass(frozen=True)
class Capped:
    """What :func:`cap_rows` left to deliver now, what waits, and each topic's new state.

    Attributes:
        deliver: the rows to deliver now (every topic).
        taken: of those, the capped topics' (for the round's counts).
        new_waiting: rows read by this round that wait (``topic, queue_id, stamp_batch,
            deliver_ts``: the round counts them as stamped, not delivered).
        state: the capped topics' state to commit.
        backlogs: per capped topic with rows waiting, those rows (for the next round).
        topics: the topics split (every other row is in ``deliver`` as it came).
    """

    deliver: pa.Table
    taken: pa.Table
    new_waiting: pa.Table
    state: dict[str, TopicRate]
    backlogs: dict[str, Backlog]
    topics: tuple[str, ...] = ()


def rate_text(rate: float) -> str:
    """A cap as people write it: per second, or per minute or hour when below one a second.

    Example:
        >>> rate_text(100000.0), rate_text(0.5), rate_text(1 / 3600)
        ('100,000/s', '30/m', '1/h')
    """
    seconds = next((n for n in (1, 60) if rate * n >= 1), 3600)
    count, unit = rate * seconds, {1: "s", 60: "m", 3600: "h"}[seconds]
    return (
        f"{count:,.0f}/{unit}" if count >= 100 or count == round(count) else f"{count:.3g}/{unit}"
    )


def rate_for(caps: Mapping[str, float], topic: str) -> float:
    """The cap of ``topic`` (lower case) in ``caps``; 0.0: none.

    Example:
        >>> caps = {"*": 10.0, "audit": 0.0}
        >>> rate_for(caps, "orders"), rate_for(caps, "audit")
        (10.0, 0.0)
    """
    return caps.get(topic, caps.get(DEFAULT, 0.0))


def cursors(state: Mapping[str, TopicRate]) -> dict[str, Key]:
    """The topics with rows waiting, and their cursors."""
    return {t: s.cursor for t, s in state.items() if s.cursor is not None}


_KEYS = ("_us", "_id", "_rev")
_NARROW = ("topic", "queue_id", "stamp_batch", "deliver_ts")


def _keyed(rows: pa.Table) -> pa.Table:
    """``rows`` with the key columns ``_us``, ``_id``, ``_rev`` added."""
    rev = pc.coalesce(rows["revision"], pa.scalar(0, rows.schema.field("revision").type))
    keyed = rows.append_column("_us", pc.cast(rows["deliver_ts"], pa.int64()))
    keyed = keyed.append_column("_id", pc.fill_null(rows["msg_id"], ""))
    return keyed.append_column("_rev", pc.cast(rev, pa.int64()))


def _sorted(keyed: pa.Table) -> pa.Array:
    return pc.cast(pc.sort_indices(keyed, [(c, "ascending") for c in _KEYS]), pa.int64())


def _key(rows: pa.Table, i: int) -> Key:
    return (rows["_us"][i].as_py(), rows["_id"][i].as_py(), rows["_rev"][i].as_py())


def _ordered(
    keyed: pa.Table, mine: pa.Array, keys: pa.Table, kept: Backlog | None
) -> tuple[pa.Table, pa.Array, int]:
    """A topic's candidates: its rows of ``keyed`` (at indices ``mine``, whose key columns
    are ``keys``) and those ``kept`` from the last round, as a table, the indices of the
    topic's rows in key order, and where in the table the rows read by this round start."""
    order = mine.take(_sorted(keys))
    if kept is None or kept.size == 0:
        return keyed, order, 0
    start = kept.rows.num_rows
    if len(mine) == 0:
        return kept.rows, kept.order, start
    if _key(keyed, order[0].as_py()) > kept.last_key():  # (the usual case: due since)
        both = pa.concat_tables([kept.rows, keyed.cast(kept.rows.schema)])
        return both, pa.concat_arrays([kept.order, pc.add(order, start)]), start
    waiting = kept.rows.take(kept.order)  # (a row stamped late among them: sorted again)
    both = pa.concat_tables([waiting, keyed.take(mine).cast(waiting.schema)])
    return both, _sorted(both.select(list(_KEYS))), waiting.num_rows


def cap_rows(
    rows: pa.Table,
    caps: Mapping[str, float],
    state: Mapping[str, TopicRate],
    watermark_us: int,
    after_us: int,
    backlogs: Mapping[str, Backlog] | None = None,
    removed: frozenset[str] = frozenset(),
) -> Capped:
    """Split a round's due rows into those its caps let go now and those that wait.

    A pure function of its inputs, so a replayed round splits the same way (a replay has no
    backlogs: it reads every row waiting).

    Args:
        rows: the round's due rows (``schedule`` columns), every topic: for a topic in
            ``backlogs``, only those the round read (due since, or stamped since).
        caps: the round's caps (:meth:`~engine.core.config.EngineConfig.rates`).
        state: the committed state of the capped topics (from the previous round).
        watermark_us: the round's watermark.
        after_us: the previous round's watermark: a topic without a cursor has delivered
            every row due by it.
        backlogs: rows the previous round left waiting, per topic (their cursor in
            ``state``); the round did not read them again.
        removed: ``msg_id + "\x00" + revision`` of rows cancels and reschedules took out
            (rows in ``backlogs`` may be among them; ``rows`` are not): taken out of the
            backlogs before the split, as a round reading them again does.

    Returns:
        The rows to deliver (uncapped topics' as they came), what waits, and the state to
        commit with the round.
    """
    backlogs = {t: b.without(removed) for t, b in (backlogs or {}).items()}
    new_state: dict[str, TopicRate] = {}
    kept: dict[str, Backlog] = {}
    lowered = pc.utf8_lower(rows["topic"])
    present = {t for t in lowered.unique().to_pylist() if t}
    topics = sorted({t for t in present if rate_for(caps, t) > 0} | set(state) | set(backlogs))
    capped = pc.fill_null(pc.is_in(lowered, pa.array(topics, pa.string())), False)
    rest = rows.filter(pc.invert(capped))
    keyed = _keyed(rows)
    taken, waiting_new = [], []
    w_ns = watermark_us * 1000
    for topic in topics:
        rate = rate_for(caps, topic)
        prior = state.get(topic)
        mine = pc.cast(pc.indices_nonzero(pc.equal(lowered, topic)), pa.int64())
        keys = keyed.select(list(_KEYS)).take(mine)
        table, order, new_from = _ordered(keyed, mine, keys, backlogs.get(topic))
        tat = prior.tat_ns if prior else None
        floor: Key = prior.cursor if prior and prior.cursor else (after_us, TOP_ID, TOP_REVISION)
        count = len(order)
        if count == 0:
            if rate > 0 and tat is not None and tat > w_ns - BURST_S * 1e9:
                new_state[topic] = TopicRate(tat, None, 0, rate)
            continue
        if rate <= 0:
            take = count  # (no longer capped: what waited goes now)
        else:
            first_ns = _key(table, order[0].as_py())[0] * 1000
            base = max(first_ns, w_ns - int(BURST_S * 1e9), tat if tat is not None else first_ns)
            allowed = math.floor((w_ns - base) * rate / 1e9) + 1 if w_ns >= base else 0
            # Rows at or below the floor were stamped late: a cursor cannot leave them behind.
            late = _count_at_or_below(keys, floor)
            take = min(count, max(allowed, late))
            while 0 < take < count and _key(table, order[take].as_py()) == _key(
                table, order[take - 1].as_py()
            ):
                take += 1  # (rows of one key go together: a cursor cannot part them)
            tat_after = base + math.ceil(take * 1e9 / rate)
            if take < count:
                last = _key(table, order[take - 1].as_py()) if take else floor
                cursor = max(floor, last)
                new_state[topic] = TopicRate(tat_after, cursor, count - take, rate)
                rest_order = order.slice(take)
                kept[topic] = Backlog(table, rest_order, cursor=cursor, checked=removed)
                kept[topic] = kept[topic].compacted()
                fresh = pc.filter(rest_order, pc.greater_equal(rest_order, new_from))
                waiting_new.append(table.select(list(_NARROW)).take(fresh))
            elif tat_after > w_ns - BURST_S * 1e9:
                new_state[topic] = TopicRate(tat_after, None, 0, rate)
        taken.append(table.take(order.slice(0, take)).drop_columns(list(_KEYS)))
    mine = pa.concat_tables(taken) if taken else rows.slice(0, 0)
    deliver = pa.concat_tables([rest, mine.cast(rest.schema)]) if taken else rest
    narrow = rows.select(list(_NARROW)).slice(0, 0)
    new_waiting = pa.concat_tables(waiting_new) if waiting_new else narrow
    return Capped(deliver, mine, new_waiting, new_state, kept, tuple(topics))


def read_ahead(rows: pa.Table) -> dict[str, Backlog]:
    """Rows of capped topics due at one instant, read before it, as a backlog per topic
    (in key order) for the round that reaches the instant. They were stamped by the last
    round's batch, so the round does not count them as new, as it would not a backlog.

    Example:
        >>> import pyarrow as pa
        >>> from engine.deliver.due import TS
        >>> rows = pa.table({"topic": ["T", "t"], "msg_id": ["b", "a"],
        ...     "revision": pa.array([0, 0], pa.int32()), "deliver_ts": pa.array([5, 5], TS)})
        >>> [r["msg_id"] for r in read_ahead(rows)["t"].rows.take(read_ahead(rows)["t"].order)
        ...  .to_pylist()]
        ['a', 'b']
    """
    lowered = pc.utf8_lower(rows["topic"])
    out: dict[str, Backlog] = {}
    for topic in sorted(t for t in lowered.unique().to_pylist() if t):
        keyed = _keyed(rows.filter(pc.equal(lowered, topic)))
        out[topic] = Backlog(keyed, _sorted(keyed.select(list(_KEYS))))
    return out


def _is_removed(rows: pa.Table, removed: pa.Array) -> pa.Array | pa.ChunkedArray:
    zero = pa.scalar(0, rows.schema.field("revision").type)
    revision = pc.cast(pc.coalesce(rows["revision"], zero), pa.string())
    keys = pc.binary_join_element_wise(rows["msg_id"], revision, "\x00")
    return pc.fill_null(pc.is_in(keys, value_set=removed), False)


def _count_at_or_below(ordered: pa.Table, key: Key) -> int:
    """How many rows of ``ordered`` (key order) have a key at or below ``key``."""
    us, msg_id, rev = key
    below = pc.or_(
        pc.less(ordered["_us"], us),
        pc.and_(
            pc.equal(ordered["_us"], us),
            pc.or_(
                pc.less(ordered["_id"], msg_id),
                pc.and_(pc.equal(ordered["_id"], msg_id), pc.less_equal(ordered["_rev"], rev)),
            ),
        ),
    )
    return int(pc.sum(pc.cast(below, pa.int64())).as_py() or 0)


def above(key: Key) -> ds.Expression:
    """``schedule`` rows whose key is above ``key`` (a dataset filter)."""
    us, msg_id, rev = key
    ts = ds.field("deliver_ts")
    at = pa.scalar(us, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    row_rev = ds.field("revision")
    later_rev = (row_rev > rev) | (row_rev.is_null() & (rev < 0))
    same_ts = (ds.field("msg_id") > msg_id) | ((ds.field("msg_id") == msg_id) & later_rev)
    return (ts > at) | ((ts == at) & same_ts)


def lowered_topic() -> ds.Expression:
    """A ``schedule`` row's topic table name (its topic in lower case), as a filter term."""
    return pc.utf8_lower(ds.field("topic"))


def state_json(state: Mapping[str, TopicRate]) -> str | None:
    """The state as the checkpoint stores it (``None`` when empty).

    The cursor is three fields, as SQL reads them (``schemas.RATES_STATE``).

    Example:
        >>> state_json({"t": TopicRate(5, (1, "a", 0), 2, 1.0)})  # doctest: +NORMALIZE_WHITESPACE
        '{"t": {"tat_ns": 5, "cursor_us": 1, "cursor_id": "a", "cursor_rev": 0,
          "waiting": 2, "rate": 1.0}}'
    """
    if not state:
        return None
    out = {}
    for topic, s in sorted(state.items()):
        us, msg_id, rev = s.cursor or (None, None, None)
        out[topic] = {
            "tat_ns": s.tat_ns, "cursor_us": us, "cursor_id": msg_id, "cursor_rev": rev,
            "waiting": s.waiting, "rate": s.rate,
        }  # fmt: skip
    return json.dumps(out)


def state_of(text: object) -> dict[str, TopicRate]:
    """The state :func:`state_json` wrote (empty for ``None``).

    Example:
        >>> state_of(state_json({"t": TopicRate(5, (1, "a", 0), 2, 1.0)}))["t"].cursor
        (1, 'a', 0)
    """
    if not text:
        return {}
    out: dict[str, TopicRate] = {}
    for topic, s in json.loads(str(text)).items():
        us = s.get("cursor_us")
        out[topic] = TopicRate(
            int(s["tat_ns"]),
            None if us is None else (int(us), str(s["cursor_id"]), int(s["cursor_rev"])),
            int(s.get("waiting") or 0),
            float(s.get("rate") or 0.0),
        )
    return out


__all__ = [
    "BURST_S",
    "Capped",
    "TopicRate",
    "above",
    "cap_rows",
    "cursors",
    "lowered_topic",
    "rate_for",
    "rate_text",
    "read_ahead",
    "state_json",
    "state_of",
]
