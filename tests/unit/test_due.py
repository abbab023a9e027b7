"""The round's cutoff, summary and topic rows, on small Delta tables written by delta-rs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake

from engine.deliver.due import (
    Window,
    read_candidates,
    removed_marks,
    to_topic_rows,
    topic_tables,
)
from engine.lakehouse.arrow_delta import ArrowDelta
from schemas import TOPIC, column_names

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
TS = pa.timestamp("us", tz="UTC")


def schedule_files(path: Path, *files: list[tuple[str, datetime, int]]) -> ArrowDelta:
    """A ``schedule``-like table, one data file per list of ``(msg_id, deliver_ts, batch)``."""
    for rows in files:
        write_deltalake(
            str(path),
            pa.table(
                {
                    "msg_id": [m for m, _, _ in rows],
                    "topic": ["Orders" if m.endswith("!") else "orders" for m, _, _ in rows],
                    "queue_id": pa.array([1] * len(rows), pa.int32()),
                    "deliver_ts": pa.array([d for _, d, _ in rows], TS),
                    "stamp_batch": pa.array([b for _, _, b in rows], pa.int64()),
                    "revision": pa.array([None] * len(rows), pa.int32()),
                    "body": [b"x"] * len(rows),
                }
            ),
            mode="append",
        )
    return ArrowDelta(str(path))


def test_cutoff_picks_newly_due_and_late_stamped_rows(tmp_path: Path) -> None:
    table = schedule_files(
        tmp_path / "schedule",
        [
            ("delivered before", T0 - timedelta(seconds=1), 2),
            ("at old watermark", T0, 3),
            ("due in this round", T0 + timedelta(milliseconds=500), 3),
            ("at new watermark", T0 + timedelta(seconds=1), 3),
            ("not yet due", T0 + timedelta(seconds=2), 3),
            ("stamped late, due long ago", T0 - timedelta(seconds=5), 4),
            ("stamped since, not due", T0 + timedelta(seconds=5), 4),
        ],
    )
    found = read_candidates(table.dataset(table.latest()), Window(T0, T0 + timedelta(seconds=1), 3))
    assert sorted(found.deliver["msg_id"].to_pylist()) == [
        "at new watermark",
        "due in this round",
        "stamped late, due long ago",
    ]
    # the round also counts what was stamped since, to learn the new stamp high mark
    assert max(r["max_batch"] for r in found.summary) == 4
    later = [r for r in found.summary if not r["_due"]]
    assert [(r["n"], r["_new"]) for r in later] == [(1, True)]


def test_a_row_due_between_two_milliseconds_is_not_skipped(tmp_path: Path) -> None:
    # Delta's statistics keep timestamps to the millisecond (the file's max reads .707 for a
    # row at .707542): skipping files by them must not lose the row.
    row_at = T0 + timedelta(microseconds=707_542)
    table = schedule_files(
        tmp_path / "schedule",
        [("early", T0, 1)],
        [("between", row_at, 1)],
    )
    window = Window(T0 + timedelta(microseconds=707_100), T0 + timedelta(microseconds=708_000), 1)
    found = read_candidates(table.dataset(table.latest()), window)
    assert found.deliver["msg_id"].to_pylist() == ["between"]
    assert found.summary[0]["max_deliver_ms"] == int(row_at.timestamp() * 1000)


def test_files_far_ahead_are_skipped_not_read(tmp_path: Path) -> None:
    far = T0 + timedelta(days=3)
    table = schedule_files(
        tmp_path / "schedule",
        [(f"parked{i}", far, 1) for i in range(100)],
        [(f"parked-b{i}", far, 2) for i in range(100)],
        [("due", T0 + timedelta(milliseconds=10), 3)],
    )
    found = read_candidates(table.dataset(table.latest()), Window(T0, T0 + timedelta(seconds=1), 2))
    assert found.deliver["msg_id"].to_pylist() == ["due"]
    assert (found.files, found.rows) == (1, 1)


def test_removed_rows_are_counted_but_not_delivered(tmp_path: Path) -> None:
    table = schedule_files(
        tmp_path / "schedule",
        [("keep", T0, 1), ("cancelled", T0, 1), ("keep!", T0, 1)],
    )
    window = Window(T0 - timedelta(seconds=1), T0, 0)
    found = read_candidates(table.dataset(table.latest()), window, removed={("cancelled", 0)})
    assert sorted(found.deliver["msg_id"].to_pylist()) == ["keep", "keep!"]
    counted = sorted((r["topic"], r["_removed"], r["n"]) for r in found.summary)
    assert counted == [("Orders", False, 1), ("orders", False, 1), ("orders", True, 1)]
    # topics differing only in case share one table
    assert {k: v.num_rows for k, v in topic_tables(found.deliver).items()} == {"orders": 2}


def test_removed_marks_read_earlier_rounds_only(tmp_path: Path) -> None:
    path = tmp_path / "command_results"
    write_deltalake(
        str(path),
        pa.table(
            {
                "msg_id": ["a", "b", "c", "d"],
                "revision": pa.array([None, 2, 0, 0], pa.int32()),
                "round": pa.array([3, 4, 5, 3], pa.int64()),
                "result": ["cancelled", "rescheduled", "cancelled", "not_found"],
                "deliver_ts": pa.array([T0 + timedelta(seconds=1)] * 4, TS),
            }
        ),
    )
    results = ArrowDelta(str(path))
    marks = removed_marks(results.dataset(results.latest()), 5, T0, ("cancelled", "rescheduled"))
    assert marks == {("a", 0), ("b", 2)}
    assert removed_marks(results.dataset(0), 5, T0 + timedelta(seconds=1), ("cancelled",)) == set()


def test_topic_rows_have_the_topic_schema_columns(tmp_path: Path) -> None:
    names = column_names(TOPIC)
    due = pa.table({c: pa.nulls(2) for c in names if c not in ("delivered_ts", "delivery_round")})
    rows = to_topic_rows(due, T0, 7)
    assert rows.column_names == names
    assert rows["delivery_round"].to_pylist() == [7, 7]
    assert rows["delivered_ts"].to_pylist() == [T0, T0]
