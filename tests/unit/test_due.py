"""The round's cutoff, summary and topic rows, on small Delta tables written by delta-rs."""

from __future__ import annotations

import dataclasses
import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from engine.deliver.ahead import ahead_round, mass_due
from engine.deliver.due import (
    WINDOW_STATS,
    Window,
    counted_summary,
    read_candidates,
    removed_marks,
    to_topic_rows,
    topic_tables,
)
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.live_files import DataFile, LiveFiles
from schemas import TOPIC, column_names

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
TS = pa.timestamp("us", tz="UTC")


def schedule_files(path: Path, *files: list[tuple[str, datetime, int | None]]) -> ArrowDelta:
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
                    "born_ts": pa.array([None] * len(rows), TS),
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


def test_spark_int96_timestamps_outside_1677_2262_are_read(tmp_path: Path) -> None:
    # Spark writes timestamps as INT96; read as nanoseconds, year 1 would not fit.
    root = tmp_path / "schedule"
    table = schedule_files(root, [("m", T0, 1)])
    (name,) = table.dataset(table.latest()).files
    rows = pq.read_table(root / name)
    year_one = pa.array([datetime(1, 1, 1, tzinfo=UTC)], TS)
    rows = rows.set_column(rows.schema.get_field_index("born_ts"), "born_ts", year_one)
    pq.write_table(rows, root / name, use_deprecated_int96_timestamps=True)
    commit = root / "_delta_log" / f"{0:020d}.json"
    actions = [json.loads(line) for line in commit.read_text().splitlines()]
    for action in actions:
        if "add" in action:
            action["add"]["size"] = (root / name).stat().st_size
            del action["add"]["stats"]  # they say born_ts is null
    commit.write_text("".join(json.dumps(a) + "\n" for a in actions))

    found = ArrowDelta(str(root)).dataset(0).to_table()
    assert found["born_ts"].to_pylist() == [datetime(1, 1, 1, tzinfo=UTC)]
    assert found["deliver_ts"].to_pylist() == [T0]


def test_append_refuses_columns_the_table_lacks_and_cuts_large_batches(tmp_path: Path) -> None:
    table = schedule_files(tmp_path / "schedule", [("m", T0, 1)])
    base = table.dataset(table.latest()).to_table()
    with pytest.raises(ValueError, match="no column surprise"):
        table.append(base.append_column("surprise", pa.array([1])))
    n = 30_000
    many = pa.concat_tables([base] * n)
    many = many.set_column(0, "msg_id", pa.array([f"m{i:06d}" for i in range(n)]))
    many = many.set_column(
        many.schema.get_field_index("body"),
        "body",
        pa.array([f"body {i} ".encode() * 8 for i in range(n)]),
    )
    table.append(many, file_rows=10_000)
    fragments = list(table.dataset(table.latest()).get_fragments())
    sizes = sorted(f.count_rows() for f in fragments)
    assert len(sizes) >= 1 + 3  # the first file, and the batch cut by an estimated size
    assert sizes[-1] <= 10_000  # never wider than asked: file skipping stays as tight
    assert sum(sizes) == n + 1


def _rows_of(dataset: ds.Dataset) -> list[str]:
    return sorted(dataset.to_table(columns=["msg_id"])["msg_id"].to_pylist())


def test_followed_files_give_each_round_what_the_snapshot_gives(tmp_path: Path) -> None:
    # Rounds over files with microsecond times and late stamping: the files a round keeps
    # (and those retired after each commit) never lose a row the whole snapshot finds.
    rng = random.Random(7)
    path = tmp_path / "schedule"
    schedule_files(path, [("first", T0, 0)])
    table, live = ArrowDelta(str(path)), LiveFiles(str(path), stats=WINDOW_STATS)
    after, stamped, delivered = T0 - timedelta(days=1), 0, []
    for step in range(1, 40):
        until = T0 + timedelta(microseconds=step * 300_007)
        if step <= 24:  # a stamping batch: some rows due long ago, some far ahead
            rows = []
            for i in range(rng.randint(1, 6)):
                at = until + timedelta(microseconds=rng.randint(-3_000_000, 4_000_000))
                rows.append((f"b{step}-{i}", at, step))
            schedule_files(path, rows)
        version = table.latest()
        window = Window(after, until, stamped)
        whole = read_candidates(table.dataset(version), window)
        kept = read_candidates(live.dataset(version, keep=window.may_hold), window)
        assert sorted(kept.deliver["msg_id"].to_pylist()) == sorted(
            whole.deliver["msg_id"].to_pylist()
        )
        assert max([0, *(r["max_batch"] for r in kept.summary)]) == max(
            [0, *(r["max_batch"] for r in whole.summary)]
        )
        assert kept.files <= whole.files
        delivered += kept.deliver["msg_id"].to_pylist()
        after, stamped = until, max([stamped, *(r["max_batch"] for r in kept.summary)])
        live.retire(version, done=Window(after, after, stamped).passed)
    assert len(delivered) == len(set(delivered))
    everything = table.dataset(version).to_table()
    due = everything.filter(pc.less_equal(everything["deliver_ts"], pa.scalar(after, TS)))
    assert sorted(delivered) == sorted(due["msg_id"].to_pylist())


def test_followed_files_answer_older_versions_across_deletes_and_compaction(
    tmp_path: Path,
) -> None:
    path = tmp_path / "schedule"
    for i in range(6):
        schedule_files(path, [(f"m{i}", T0 + timedelta(seconds=i), i)])
    live = LiveFiles(str(path), stats=WINDOW_STATS)
    assert _rows_of(live.dataset(live.latest())) == [f"m{i}" for i in range(6)]
    DeltaTable(str(path)).delete("msg_id = 'm2'")
    DeltaTable(str(path)).optimize.compact()
    table = ArrowDelta(str(path))
    for version in range(table.latest() + 1):  # each version, as delta-rs reads it
        if version >= 5:
            assert _rows_of(live.dataset(version)) == _rows_of(table.dataset(version))
    live.retire(table.latest())
    assert _rows_of(live.dataset(4)) == [f"m{i}" for i in range(5)]  # reloaded
    assert _rows_of(live.dataset(live.latest())) == ["m0", "m1", "m3", "m4", "m5"]


def test_topic_tables_split_by_lower_case_name_keeping_each_tables_row_order() -> None:
    topics = ["b", "Orders", "a", "orders", "b", "ORDERS", "a"]
    rows = pa.table({"topic": topics, "n": list(range(len(topics)))})
    tables = topic_tables(rows)
    assert {k: v["n"].to_pylist() for k, v in tables.items()} == {
        "a": [2, 6],
        "b": [0, 4],
        "orders": [1, 3, 5],
    }
    assert topic_tables(rows.slice(0, 0)) == {}


def test_topic_tables_give_each_table_arrays_without_an_offset() -> None:
    """The Kafka sink rebuilds list arrays from a table's map offsets and null mask, which
    Arrow refuses for a sliced array: each table's columns start at offset 0."""
    props = pa.array([[("p", "v")], None, [("q", "w")], None], pa.map_(pa.string(), pa.string()))
    rows = pa.table({"topic": ["b", "a", "b", "a"], "properties": props})
    for table in topic_tables(rows).values():
        for maps in table["properties"].chunks:
            assert maps.offset == 0
            pa.ListArray.from_arrays(maps.offsets, maps.values, mask=maps.is_null())


def test_a_round_written_ahead_and_the_rest_of_its_window_make_the_whole_window(
    tmp_path: Path,
) -> None:
    """A round whose rows due after ``X`` stamped up to batch 5 were written ahead (in two
    layers: up to batch 3, then 4-5): those layers and the rest of its window (due before
    ``X``, or stamped since) are its rows, each once; files a part cannot hold are skipped."""
    x = T0
    schedule = schedule_files(
        tmp_path / "schedule",
        [("a", x + timedelta(seconds=1), 3), ("b", x + timedelta(seconds=1), 4)],
        [("c", x + timedelta(seconds=1), 7), ("d", x - timedelta(seconds=1), 7)],
        [("e", x - timedelta(milliseconds=200), 4)],
        [("f", x + timedelta(seconds=1), None)],  # (no batch: never written ahead)
    )
    whole = Window(x - timedelta(milliseconds=500), x + timedelta(seconds=2), stamped_after=5)
    first = Window(x, whole.until, stamped_after=2**62, batches=(None, 3))
    layer = Window(x, whole.until, stamped_after=2**62, batches=(3, 5))
    rest = dataclasses.replace(whole, written=(x, 5))
    live = LiveFiles(str(tmp_path / "schedule"), stats=WINDOW_STATS)

    def ids(window: Window) -> list[str]:
        found = read_candidates(live.dataset(schedule.latest(), keep=window.may_hold), window)
        return sorted(found.deliver["msg_id"].to_pylist())

    assert ids(whole) == ["a", "b", "c", "d", "e", "f"]  # ("d": stamped late, due before)
    assert ids(first) == ["a"]
    assert ids(layer) == ["b"]
    assert ids(rest) == ["c", "d", "e", "f"]
    files = live.files(schedule.latest())
    held = [f.max("stamp_batch") for f in files if rest.may_hold(f)]
    assert sorted(held, key=lambda b: -1 if b is None else b) == [None, 4, 7]
    kept = [f.min("stamp_batch") for f in files if first.may_hold(f)]
    assert sorted(kept, key=lambda b: -1 if b is None else b) == [None, 3]  # (None: unknown)


def test_a_mass_due_at_one_instant_is_found_between_soonest_and_horizon() -> None:
    def file(low_s: float, high_s: float, rows: int) -> DataFile:
        bounds = {"deliver_ts": int(low_s * 1e6)}, {"deliver_ts": int(high_s * 1e6)}
        return DataFile("f", {}, rows, low=bounds[0], high=bounds[1])

    spike = [file(9, 9.001, 50), file(9, 9.001, 50)]
    others = [
        file(9, 9.5, 500),  # spread over half a second: not one instant
        file(3, 3.001, 500),  # too soon to write ahead
        file(40, 40.001, 500),  # beyond the horizon
        file(12, 12.001, 80),  # a later, smaller mass
    ]
    assert mass_due(spike + others, now_us=0, rows_over=60) == (8_999_999, 9_001_000)
    assert mass_due(spike + others, now_us=0, rows_over=90) == (8_999_999, 9_001_000)
    assert mass_due(others, now_us=0, rows_over=60) == (11_999_999, 12_001_000)
    assert mass_due(spike + others, now_us=0, rows_over=100) is None
    assert ahead_round(41, T0 + timedelta(seconds=10), T0, 200) == 242


def test_files_of_new_rows_not_yet_due_are_counted_from_statistics_as_reading_counts_them(
    tmp_path: Path,
) -> None:
    """Timers stamped while no round ran (a restart's millions): a file whose statistics
    show every row stamped since the last round and not due is counted from them instead of
    read. Per queue, the counts and the highest batch are what reading every file gives; a
    file with a row due, an older row, or a null time is still read."""
    path = tmp_path / "schedule"
    far = T0 + timedelta(days=2)

    def write(rows: list[tuple[str, datetime | None, int, int]]) -> None:
        write_deltalake(
            str(path),
            pa.table(
                {
                    "msg_id": [m for m, _, _, _ in rows],
                    "topic": ["orders"] * len(rows),
                    "queue_id": pa.array([q for _, _, _, q in rows], pa.int32()),
                    "deliver_ts": pa.array([d for _, d, _, _ in rows], TS),
                    "stamp_batch": pa.array([b for _, _, b, _ in rows], pa.int64()),
                    "revision": pa.array([None] * len(rows), pa.int32()),
                }
            ),
            mode="append",
            partition_by=["queue_id"],
        )

    write([("old", T0 - timedelta(seconds=1), 1, 1)])
    live = LiveFiles(str(path), stats=WINDOW_STATS)
    assert len(live.files(0)) == 1  # (the files added since are read from each commit)
    write([(f"far{i}", far, 5, 2) for i in range(50)])
    write([(f"far-b{i}", far + timedelta(hours=i), 6, 3) for i in range(30)])
    write([("due", T0 + timedelta(milliseconds=10), 6, 1), ("with it", far, 6, 1)])
    write([("no time", None, 6, 2), ("beside it", far, 6, 2)])
    write([("stamped before", far, 4, 2)])
    table = ArrowDelta(str(path))
    version = table.latest()
    plain = Window(T0, T0 + timedelta(seconds=1), 4)
    whole = read_candidates(table.dataset(version), plain)
    window = dataclasses.replace(plain, by_stats=True)
    kept = read_candidates(live.dataset(version, keep=window.may_hold), window)
    counted = counted_summary(live.files(version), window)

    def not_due(summary: list[dict[str, Any]]) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in summary:
            if not r["_due"]:
                out[r["queue_id"]] = out.get(r["queue_id"], 0) + r["n"]
        return out

    assert kept.deliver["msg_id"].to_pylist() == whole.deliver["msg_id"].to_pylist() == ["due"]
    assert not_due(kept.summary + counted) == not_due(whole.summary) == {1: 1, 2: 51, 3: 30}
    assert {(r["queue_id"], r["n"], r["max_batch"]) for r in counted} == {(2, 50, 5), (3, 30, 6)}
    top = max(r["max_batch"] for r in whole.summary)
    assert max(r["max_batch"] for r in kept.summary + counted) == top == 6
    assert kept.files == whole.files - 2  # the two files counted from their statistics
    # ... and once their rows fall due, a later round reads those files and delivers them
    later = Window(T0 + timedelta(seconds=1), far + timedelta(days=2), top, by_stats=True)
    due = read_candidates(live.dataset(version, keep=later.may_hold), later)
    delivered = set(due.deliver["msg_id"].to_pylist())
    assert {f"far{i}" for i in range(50)} | {f"far-b{i}" for i in range(30)} <= delivered
    assert counted_summary(live.files(version), later) == []
