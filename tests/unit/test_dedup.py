"""Which copies of a message id are duplicates, decided without Spark."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa

from engine.stamp.dedup import SeenIds, Taken, duplicate_reasons, micros

T0 = datetime(2026, 1, 1, tzinfo=UTC)
HOUR = timedelta(hours=1)
TS = pa.timestamp("us", tz="UTC")


def batch(*rows: tuple[str, datetime, bytes]) -> pa.Table:
    """Stamped rows, not delayed (deliver_ts = store_ts)."""
    ids, stored, bodies = zip(*rows, strict=True)
    n = len(ids)
    return pa.table(
        {
            "msg_id": list(ids),
            "store_ts": pa.array(stored, TS),
            "born_ts": pa.array(stored, TS),
            "topic": ["t"] * n,
            "body": list(bodies),
            "delay_level": pa.nulls(n, pa.int32()),
            "deliver_at": pa.nulls(n, TS),
            "tags": pa.nulls(n, pa.string()),
            "deliver_ts": pa.array(stored, TS),
        }
    )


def reasons(rows: pa.Table, hashes: list[int], seen: SeenIds, stamped: dict[str, Taken]) -> list:
    return duplicate_reasons(rows, np.array(hashes), seen, lambda ids: stamped, HOUR).to_pylist()


def test_seen_ids_answer_like_a_set_through_many_merges() -> None:
    rng = np.random.default_rng(7)
    seen, truth = SeenIds(T0), set()
    for i in range(300):
        hashes = rng.integers(-(2**63), 2**63 - 1, size=int(rng.integers(1, 50)), dtype=np.int64)
        seen.add(hashes, np.full(len(hashes), micros(T0) + i))
        truth.update(hashes.tolist())
    probe = np.concatenate([np.array(sorted(truth)[:500]), rng.integers(0, 2**62, 500)])
    assert seen.contains(probe).tolist() == [int(h) in truth for h in probe]
    assert len(seen._segments) < 20  # merged, not one array per batch


def test_each_id_expires_at_its_own_time() -> None:
    seen = SeenIds(T0)
    # A pending timer keeps its id taken; a row stored with a clock far ahead keeps only its own.
    seen.add(np.array([1, 2, 3]), np.array([micros(T0), micros(T0 + 48 * HOUR), micros(T0)]))
    seen.add(np.array([4]), np.array([micros(T0 + 24 * 365 * HOUR)]))
    seen.expire(T0 + HOUR)
    assert seen.contains(np.array([1, 2, 3, 4])).tolist() == [False, True, False, True]
    assert len(seen) == 2 and seen.complete_from == T0 + HOUR


def test_a_hash_collision_is_not_a_duplicate() -> None:
    rows = batch(("A", T0, b"a"), ("B", T0, b"b"))
    seen = SeenIds(T0)
    seen.add(np.array([11, 22]), np.array([micros(T0)] * 2))  # other ids with these hashes
    assert reasons(rows, [11, 22], seen, {}) == [None, None]


def test_the_earliest_copy_in_a_batch_is_kept_whatever_the_row_order() -> None:
    late = T0 + timedelta(seconds=5)
    rows = batch(("A", late, b"second"), ("A", T0, b"first"), ("B", T0, b"b"))
    assert reasons(rows, [1, 1, 2], SeenIds(T0), {}) == [
        "duplicate: msg_id A was already stored at 2026-01-01 00:00:00.000 UTC",
        None,
        None,
    ]


def test_copies_further_apart_than_the_window_are_both_kept() -> None:
    rows = batch(("A", T0, b"1"), ("A", T0 + 2 * HOUR, b"2"), ("A", T0 + 2 * HOUR, b"3"))
    seen = SeenIds(T0 - 3 * HOUR)
    seen.add(np.array([1]), np.array([micros(T0 - 2 * HOUR)]))
    stamped = {"A": Taken(T0 - 2 * HOUR, T0 - 2 * HOUR)}  # an earlier batch's, out of reach
    kept = [r is None for r in reasons(rows, [1, 1, 1], seen, stamped)]
    assert kept == [True, True, False]


def test_a_pending_copy_keeps_its_id_taken_past_the_window() -> None:
    # A timer due in 2 days (or a cancelled one): sent again 3 h later, still a duplicate.
    rows = batch(("K", T0 + 3 * HOUR, b"again"))
    seen = SeenIds(T0)
    seen.add(np.array([9]), np.array([micros(T0 + 48 * HOUR)]))
    stamped = {"K": Taken(T0, T0 + 48 * HOUR)}
    assert reasons(rows, [9], seen, stamped) == [
        "duplicate: msg_id K was already stored at 2026-01-01 00:00:00.000 UTC"
    ]


def test_a_copy_stamped_by_an_earlier_batch_makes_every_copy_a_duplicate() -> None:
    rows = batch(("A", T0, b"1"), ("A", T0, b"2"), ("C", T0, b"c"))
    seen = SeenIds(T0 - HOUR)
    seen.add(np.array([1]), np.array([micros(T0 - HOUR / 2)]))
    got = reasons(rows, [1, 1, 3], seen, {"A": Taken(T0 - HOUR / 2, T0 - HOUR / 2)})
    assert got[2] is None
    assert got[:2] == ["duplicate: msg_id A was already stored at 2025-12-31 23:30:00.000 UTC"] * 2
