"""Which copies of a message id are duplicates, decided without Spark."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa

from engine.stamp.dedup import SeenIds, duplicate_reasons

T0 = datetime(2026, 1, 1, tzinfo=UTC)
HOUR = timedelta(hours=1)


def batch(*rows: tuple[str, datetime, bytes]) -> pa.Table:
    ids, stored, bodies = zip(*rows, strict=True)
    return pa.table(
        {
            "msg_id": list(ids),
            "store_ts": pa.array(stored, pa.timestamp("us", tz="UTC")),
            "born_ts": pa.array(stored, pa.timestamp("us", tz="UTC")),
            "topic": ["t"] * len(ids),
            "body": list(bodies),
        }
    )


def test_seen_ids_answer_like_a_set_through_many_merges() -> None:
    rng = np.random.default_rng(7)
    seen, truth = SeenIds(), set()
    for i in range(300):
        hashes = rng.integers(-(2**63), 2**63 - 1, size=int(rng.integers(1, 50)), dtype=np.int64)
        seen.add(hashes, T0 + timedelta(seconds=i))
        truth.update(hashes.tolist())
    probe = np.concatenate([np.array(sorted(truth)[:500]), rng.integers(0, 2**62, 500)])
    assert seen.contains(probe).tolist() == [int(h) in truth for h in probe]
    assert len(seen._segments) < 20  # merged, not one array per batch


def test_expiry_forgets_whole_segments_only_when_all_are_older() -> None:
    seen = SeenIds()
    seen.add(np.array([1, 2], dtype=np.int64), T0)
    seen.add(np.array([3], dtype=np.int64), T0 + HOUR)  # merged with the first
    seen.expire(T0 + timedelta(minutes=30))
    assert seen.contains(np.array([1, 3], dtype=np.int64)).tolist() == [True, True]
    seen.expire(T0 + 2 * HOUR)
    assert len(seen) == 0


def test_a_hash_collision_is_not_a_duplicate() -> None:
    rows = batch(("A", T0, b"a"), ("B", T0, b"b"))
    seen = SeenIds()
    seen.add(np.array([11, 22], dtype=np.int64), T0)  # another id with the same hashes
    reasons = duplicate_reasons(rows, np.array([11, 22]), seen, lambda ids: {}, HOUR)
    assert reasons.to_pylist() == [None, None]


def test_the_earliest_copy_in_a_batch_is_kept_whatever_the_row_order() -> None:
    late = T0 + timedelta(seconds=5)
    rows = batch(("A", late, b"second"), ("A", T0, b"first"), ("B", T0, b"b"))
    reasons = duplicate_reasons(rows, np.array([1, 1, 2]), SeenIds(), lambda ids: {}, HOUR)
    assert reasons.to_pylist() == [
        "duplicate: msg_id A was already stored at 2026-01-01 00:00:00.000 UTC",
        None,
        None,
    ]


def test_copies_further_apart_than_the_window_are_both_kept() -> None:
    rows = batch(("A", T0, b"1"), ("A", T0 + 2 * HOUR, b"2"), ("A", T0 + 2 * HOUR, b"3"))
    seen = SeenIds()
    seen.add(np.array([1], dtype=np.int64), T0 - 2 * HOUR)
    stamped = {"A": T0 - 2 * HOUR}  # an earlier batch's copy, out of the window too
    reasons = duplicate_reasons(rows, np.array([1, 1, 1]), seen, lambda ids: stamped, HOUR)
    kept = [r is None for r in reasons.to_pylist()]
    assert kept.count(True) == 2 and kept[0]


def test_a_copy_stamped_by_an_earlier_batch_makes_every_copy_a_duplicate() -> None:
    rows = batch(("A", T0, b"1"), ("A", T0, b"2"), ("C", T0, b"c"))
    seen = SeenIds()
    seen.add(np.array([1], dtype=np.int64), T0 - HOUR / 2)
    reasons = duplicate_reasons(
        rows, np.array([1, 1, 3]), seen, lambda ids: {"A": T0 - HOUR / 2}, HOUR
    ).to_pylist()
    assert reasons[2] is None
    assert (
        reasons[:2] == ["duplicate: msg_id A was already stored at 2025-12-31 23:30:00.000 UTC"] * 2
    )
