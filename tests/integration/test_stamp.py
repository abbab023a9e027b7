"""Stamping as a transform on small inline tables, and its writer across replays."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.core.errors import CheckpointError, RetryableError
from engine.core.levels import parse_levels
from engine.lakehouse.delta.tables import ensure_tables
from engine.produce.send import Message, send_df, send_many
from engine.run.engine import Engine
from engine.stamp.stamper import Stamper
from engine.stamp.transform import stamp
from engine.stamp.writer import StampWriter
from schemas import COMMITLOG

pytestmark = pytest.mark.integration
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
CFG = EngineConfig(levels=parse_levels("1s 2s 3s"), max_body_bytes=8)


def commitlog_rows(
    spark: SparkSession,
    rows: list[tuple[str, str | None, bytes | None, int | None]],
    store_ts: datetime = T0,
) -> pa.Table:
    """``commitlog`` rows as stamping reads them (Arrow, in the table's types)."""
    return spark.createDataFrame(
        [(m, t, [], None, {}, b, lvl, store_ts, store_ts, None) for m, t, b, lvl in rows],
        COMMITLOG,
    ).toArrow()


def stored(spark: SparkSession, path: str) -> list[tuple[str, int]]:
    rows = spark.read.format("delta").load(path).select("msg_id", "stamp_batch").collect()
    return sorted((r["msg_id"], r["stamp_batch"]) for r in rows)


def reasons(spark: SparkSession, path: str) -> list[tuple[str, str]]:
    rows = spark.read.format("delta").load(path).select("msg_id", "reason").collect()
    return sorted((r["msg_id"], r["reason"]) for r in rows)


def test_stamp_sets_queue_and_deliver_time_and_quarantines(spark: SparkSession) -> None:
    df = commitlog_rows(
        spark,
        [
            ("now", "orders", b"a", None),
            ("neg", "orders", b"a", -2),
            ("l2", "orders", b"a", 2),
            ("l9", "orders", b"a", 9),
            ("big", "orders", b"123456789", 1),
            ("notopic", None, b"a", 1),
        ],
    )
    scheduled, quarantined = stamp(df, CFG, batch_id=7, now=T0)
    got = scheduled.select(["msg_id", "queue_id", "deliver_ts", "stamp_batch"]).to_pylist()
    assert sorted(got, key=lambda r: r["msg_id"]) == [
        {"msg_id": "l2", "queue_id": 2, "deliver_ts": T0 + timedelta(seconds=2), "stamp_batch": 7},
        {"msg_id": "l9", "queue_id": 3, "deliver_ts": T0 + timedelta(seconds=3), "stamp_batch": 7},
        {"msg_id": "neg", "queue_id": 0, "deliver_ts": T0, "stamp_batch": 7},
        {"msg_id": "now", "queue_id": 0, "deliver_ts": T0, "stamp_batch": 7},
    ]
    reasons = {r["msg_id"]: r["reason"] for r in quarantined.to_pylist()}
    assert reasons == {
        "big": "body is 9 bytes, over messages.max_body_bytes=8",
        "notopic": "topic is missing",
    }


def test_stamp_writer_stores_each_row_once_across_replays(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    lay = ensure_tables(spark, cfg)
    valid = [("ok1", "orders", b"a", 1), ("ok2", "audit", b"b", None)]
    batch = commitlog_rows(spark, [*valid, ("notopic", None, b"c", 1)])
    clock = FakeClock(T0)

    StampWriter(cfg, lay, clock)(batch, 0)
    StampWriter(cfg, lay, clock)(batch, 0)  # Spark replays the batch after a crash
    # A crash between the two appends of batch 1: schedule has it, quarantine not yet.
    more = [("ok3", "orders", b"a", 1), ("ok4", "audit", b"b", None)]
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, more), 1)
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [*more, ("late", None, b"c", 1)]), 1)
    # A batch of refused rows only.
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("bad", None, b"d", 2)]), 2)

    assert stored(spark, lay.schedule) == [("ok1", 0), ("ok2", 0), ("ok3", 1), ("ok4", 1)]
    assert stored(spark, lay.quarantine) == [("bad", 2), ("late", 1), ("notopic", 0)]


def test_a_message_id_is_stamped_once_and_later_copies_are_duplicates(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    lay = ensure_tables(spark, cfg)
    clock = FakeClock(T0)
    later = T0 + timedelta(seconds=5)
    first = commitlog_rows(spark, [("A", "orders", b"1", 1), ("B", "orders", b"b", 1)])
    # The same id twice in one batch (two writers): the earlier store time is kept.
    same_batch = pa.concat_tables([first, commitlog_rows(spark, [("A", "audit", b"2", 2)], later)])
    writer = StampWriter(cfg, lay, clock)
    writer(same_batch, 0)
    writer(commitlog_rows(spark, [("A", "orders", b"3", 1), ("C", "orders", b"c", 1)], later), 1)
    # A restarted engine still knows the ids stamped before it started.
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("B", "x", b"4", 1)], later), 2)

    assert stored(spark, lay.schedule) == [("A", 0), ("B", 0), ("C", 1)]
    body = spark.read.format("delta").load(lay.schedule).where("msg_id = 'A'").first()
    assert body is not None and body["body"] == b"1" and body["topic"] == "orders"
    first_stored = "was already stored at 2026-01-01 12:00:00.000 UTC"
    assert reasons(spark, lay.quarantine) == [
        ("A", f"duplicate: msg_id A {first_stored}"),
        ("A", f"duplicate: msg_id A {first_stored}"),
        ("B", f"duplicate: msg_id B {first_stored}"),
    ]


def test_a_replayed_batch_decides_its_duplicates_the_same_way(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    lay = ensure_tables(spark, cfg)
    clock = FakeClock(T0)
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("A", "orders", b"1", 1)]), 0)
    batch = commitlog_rows(spark, [("A", "orders", b"2", 1), ("D", "orders", b"d", 1)])
    # The first try of batch 1 reached `schedule` and then crashed before `quarantine`.
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("D", "orders", b"d", 1)]), 1)
    StampWriter(cfg, lay, clock)(batch, 1)  # the replay: D is not a duplicate of itself
    StampWriter(cfg, lay, clock)(batch, 1)

    assert stored(spark, lay.schedule) == [("A", 0), ("D", 1)]
    assert stored(spark, lay.quarantine) == [("A", 1)]


def test_ids_read_ahead_at_start_serve_only_the_batch_they_were_read_for(
    spark: SparkSession, cfg: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.stamp.writer as writer_module

    reads: list[int] = []
    real = writer_module.seen_ids

    def counted(table: Any, batch_id: int, since: datetime, *only: Any) -> Any:
        if not only:  # (not a batch's read of its own ids' entries)
            reads.append(batch_id)
        return real(table, batch_id, since, *only)

    monkeypatch.setattr(writer_module, "seen_ids", counted)
    lay = ensure_tables(spark, cfg)
    clock = FakeClock(T0)
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("A", "orders", b"1", 1)]), 0)
    # The first try of batch 1 reached `schedule` and then crashed.
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("D", "orders", b"d", 1)]), 1)
    reads.clear()

    # A restart read the ids ahead for batch 1, its replay: used, D is not its own duplicate.
    replay = StampWriter(cfg, lay, clock)
    replay.warm(1)
    replay(commitlog_rows(spark, [("A", "orders", b"2", 1), ("D", "orders", b"d", 1)]), 1)
    # Read ahead for batch 1 but batch 2 comes first: read again, so D (batch 1) is known.
    other = StampWriter(cfg, lay, clock)
    other.warm(1)
    other(commitlog_rows(spark, [("D", "audit", b"e", 2)]), 2)

    assert stored(spark, lay.schedule) == [("A", 0), ("D", 1)]
    assert stored(spark, lay.quarantine) == [("A", 1), ("D", 2)]
    assert reads == [1, 1, 2]  # the replay read nothing more; batch 2 read its own


def test_batches_stamped_while_the_ids_are_read_ahead_decide_from_their_own_ids_alone(
    spark: SparkSession, cfg: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart's first batches do not wait for millions of taken ids: each reads the
    entries of its own ids; their ids are then carried into what is read ahead."""
    import threading

    import engine.stamp.writer as writer_module

    release, reads = threading.Event(), []
    real = writer_module.seen_ids

    def slow(table: Any, batch_id: int, since: datetime, only: Any = None) -> Any:
        reads.append((batch_id, "full" if only is None else "own"))
        if only is None:
            release.wait(60)  # millions of ids: still reading
        return real(table, batch_id, since) if only is None else real(table, batch_id, since, only)

    lay = ensure_tables(spark, cfg)
    clock = FakeClock(T0)
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("A", "orders", b"1", 1)]), 0)
    monkeypatch.setattr(writer_module, "seen_ids", slow)  # (for the restarted writer)

    writer = StampWriter(cfg, lay, clock)
    writer.warm(1)
    writer(commitlog_rows(spark, [("A", "orders", b"2", 1), ("E", "orders", b"e", 1)]), 1)
    writer(commitlog_rows(spark, [("E", "audit", b"3", 1)]), 2)
    release.set()
    copies = [("A", "x", b"4", 1), ("E", "x", b"5", 1), ("F", "orders", b"f", 1)]
    writer(commitlog_rows(spark, copies), 3)

    assert stored(spark, lay.schedule) == [("A", 0), ("E", 1), ("F", 3)]
    assert stored(spark, lay.quarantine) == [("A", 1), ("A", 3), ("E", 2), ("E", 3)]
    assert reads == [(1, "full"), (1, "own"), (2, "own")]  # batch 3: what was read, + 1, 2


def test_ids_read_ahead_for_a_batch_stamped_at_once_wait_for_its_own_lookup(
    spark: SparkSession, cfg: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that stamps a batch right away holds the read of every taken id until that
    batch has looked up its own (so the lookup does not read beside it), then reads them."""
    import time

    import engine.stamp.writer as writer_module

    reads: list[tuple[int, str]] = []
    real = writer_module.seen_ids

    def recorded(table: Any, batch_id: int, since: datetime, *only: Any) -> Any:
        reads.append((batch_id, "own" if only else "full"))
        return real(table, batch_id, since, *only)

    monkeypatch.setattr(writer_module, "seen_ids", recorded)
    monkeypatch.setattr(writer_module, "HOLD_S", 120.0)  # (never runs out here)
    lay = ensure_tables(spark, cfg)
    clock = FakeClock(T0)
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("A", "orders", b"1", 1)]), 0)
    first = commitlog_rows(spark, [("A", "orders", b"2", 1), ("E", "orders", b"e", 1)])
    reads.clear()

    writer = StampWriter(cfg, lay, clock)
    writer.warm(1, hold=True)
    time.sleep(0.5)
    assert reads == []  # held
    writer(first, 1)
    deadline = time.monotonic() + 30
    while (1, "full") not in reads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reads == [(1, "own"), (1, "full")]  # read once the batch had looked up its own
    writer(commitlog_rows(spark, [("E", "audit", b"3", 1)]), 2)

    assert stored(spark, lay.schedule) == [("A", 0), ("E", 1)]
    assert stored(spark, lay.quarantine) == [("A", 1), ("E", 2)]

    # A first batch with no valid row looks nothing up: it lets the read go all the same.
    reads.clear()
    refused = commitlog_rows(spark, [("X", None, b"x", 1)])  # no topic: quarantined
    other = StampWriter(cfg, lay, clock)
    other.warm(3, hold=True)
    other(refused, 3)
    deadline = time.monotonic() + 30
    while (3, "full") not in reads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reads == [(3, "full")]


def short_window(spark: SparkSession, make_cfg: object) -> tuple[EngineConfig, Any, FakeClock]:
    """A lakehouse whose ids stay taken 3 s (the longest test level), and a clock."""
    cfg = make_cfg(dedup_window_ms=3_000)  # type: ignore[operator]
    return cfg, ensure_tables(spark, cfg), FakeClock(T0)


def test_ids_older_than_the_dedup_window_are_stamped_again(
    spark: SparkSession, make_cfg: object
) -> None:
    cfg, lay, clock = short_window(spark, make_cfg)
    writer = StampWriter(cfg, lay, clock)
    writer(commitlog_rows(spark, [("A", "orders", b"1", 1)]), 0)
    clock.advance(seconds=10)
    later = T0 + timedelta(seconds=10)
    writer(commitlog_rows(spark, [("A", "orders", b"2", 1), ("B", "orders", b"b", 1)], later), 1)
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("A", "orders", b"3", 1)], later), 2)

    assert stored(spark, lay.schedule) == [("A", 0), ("A", 1), ("B", 1)]
    assert stored(spark, lay.quarantine) == [("A", 2)]


def test_dedup_off_stamps_every_copy(spark: SparkSession, make_cfg: object) -> None:
    cfg = make_cfg(dedup_window_ms=0)  # type: ignore[operator]
    lay = ensure_tables(spark, cfg)
    rows = [("A", "orders", b"1", 1), ("A", "orders", b"2", 1)]
    StampWriter(cfg, lay, FakeClock(T0))(commitlog_rows(spark, rows), 0)
    assert stored(spark, lay.schedule) == [("A", 0), ("A", 0)]


def test_a_copy_stamped_long_after_it_was_stored_is_still_a_duplicate(
    spark: SparkSession, make_cfg: object
) -> None:
    # Stamping fell 40 minutes behind (a backlog after downtime): the ids the
    # batch needs must not be forgotten when the writer trims its memory.
    cfg, lay, clock = short_window(spark, make_cfg)
    writer = StampWriter(cfg, lay, clock)
    writer(commitlog_rows(spark, [("X", "orders", b"1", None)]), 0)
    clock.advance(seconds=40 * 60)
    retry = commitlog_rows(spark, [("X", "orders", b"2", None)], T0 + timedelta(seconds=2))
    writer(retry, 1)

    assert stored(spark, lay.schedule) == [("X", 0)]
    assert stored(spark, lay.quarantine) == [("X", 1)]


def test_rows_stamped_before_the_hash_column_existed_still_make_copies_duplicates(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    lay = ensure_tables(spark, cfg)
    clock = FakeClock(T0)
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("A", "orders", b"1", 1)]), 0)
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("B", "orders", b"2", 1)]), 1)
    # A lakehouse stamped by an older version: no msg_id_hash in A's row.
    spark.sql(f"UPDATE delta.`{lay.schedule}` SET msg_id_hash = NULL WHERE msg_id = 'A'")
    copies = [("A", "orders", b"3", 1), ("B", "orders", b"4", 1), ("C", "orders", b"5", 1)]
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, copies), 2)  # a restart: rebuilt index

    assert stored(spark, lay.schedule) == [("A", 0), ("B", 1), ("C", 2)]
    assert stored(spark, lay.quarantine) == [("A", 2), ("B", 2)]


# --------------------------------------------------------------------------- the stamper


def schedule_ids(spark: SparkSession, path: str) -> list[str]:
    return sorted(r["msg_id"] for r in spark.read.format("delta").load(path).collect())


def test_a_commit_larger_than_a_batch_is_stamped_in_parts_and_a_crash_replays_its_plan(
    spark: SparkSession, make_cfg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_cfg(stamp_max_files=1)
    clock = FakeClock(T0)
    lay = ensure_tables(spark, cfg)
    three_files = spark.range(30).selectExpr("'orders' AS topic", "CAST(id AS STRING) AS body")
    send_df(spark, cfg, three_files.repartition(3), clock)  # one commit, three files
    stamper = Stamper(spark, cfg, lay, clock)
    first = stamper.run_batch()
    assert first is not None and first.files == 1

    real = StampWriter._append
    calls = {"n": 0}

    def crash_after_schedule(self: StampWriter, rows: pa.Table, path: str, *args: Any) -> None:
        real(self, rows, path, *args)
        calls["n"] += 1
        raise OSError("the process died here")

    monkeypatch.setattr(StampWriter, "_append", crash_after_schedule)
    with pytest.raises(OSError):
        stamper.run_batch()  # batch 1 planned, its schedule rows written, then a crash
    monkeypatch.setattr(StampWriter, "_append", real)

    restarted = Stamper(spark, cfg, lay, clock)
    assert restarted.run_available() == 20  # batch 1 again (same file), then batch 2
    ids = schedule_ids(spark, lay.schedule)
    assert len(ids) == 30 and len(set(ids)) == 30
    assert sorted({b for _, b in stored(spark, lay.schedule)}) == [0, 1, 2]


def test_rows_rewritten_in_commitlog_are_not_stamped_again(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    clock = FakeClock(T0)
    lay = ensure_tables(spark, cfg)
    send_many(spark, cfg, [Message("orders", "a"), Message("orders", "b")], clock)
    stamper = Stamper(spark, cfg, lay, clock)
    stamper.run_available()
    spark.sql(f"UPDATE delta.`{lay.commitlog}` SET tags = 'x' WHERE body = CAST('a' AS BINARY)")
    spark.sql(f"DELETE FROM delta.`{lay.commitlog}` WHERE body = CAST('b' AS BINARY)")
    [later] = send_many(spark, cfg, [Message("orders", "c")], clock)
    assert stamper.run_available() == 1
    assert later in schedule_ids(spark, lay.schedule)
    assert len(schedule_ids(spark, lay.schedule)) == 3
    # A MERGE that rewrites rows and adds others: new and old messages cannot be told apart.
    spark.sql(
        f"MERGE INTO delta.`{lay.commitlog}` t USING delta.`{lay.commitlog}` s "
        "ON t.msg_id = s.msg_id WHEN MATCHED THEN UPDATE SET t.tags = 'y'"
    )
    with pytest.raises(CheckpointError, match=r"version \d+ \(MERGE\) removes rows"):
        stamper.run_available()


def test_a_second_stamper_on_the_lakehouse_is_refused_and_a_lost_log_is_noticed(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    clock = FakeClock(T0)
    lay = ensure_tables(spark, cfg)
    first, second = Stamper(spark, cfg, lay, clock).open(), Stamper(spark, cfg, lay, clock).open()
    send_many(spark, cfg, [Message("orders", "a")], clock)
    assert first.run_available() == 1
    with pytest.raises(RetryableError, match="planned by another stamper"):
        second.run_batch()  # it would plan batch 0 again: it runs the first's plan instead
    again = second.run_batch()
    assert again is not None and again.replayed and again.batch == 0
    assert len(schedule_ids(spark, lay.schedule)) == 1  # nothing stored twice
    send_many(spark, cfg, [Message("orders", "b")], clock)
    assert first.run_available() == 1
    newest = Path(lay.checkpoint("stamp")) / "batches" / f"{1:020d}.json"
    newest.unlink()  # the log lost its newest plan: it now ends before what the tables hold
    with pytest.raises(CheckpointError, match="holds stamping batch 1"):
        Stamper(spark, cfg, lay, clock).open()


def test_a_lakehouse_stamped_by_the_spark_stream_carries_on_from_its_last_batch(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    clock = FakeClock(T0)
    lay = ensure_tables(spark, cfg)
    before = send_many(spark, cfg, [Message("orders", str(i)) for i in range(3)], clock)
    more = send_many(spark, cfg, [Message("audit", "x")], clock)
    writer = StampWriter(cfg, lay, clock)
    # What an earlier version ran: a Delta stream on commitlog with a foreachBatch.
    query = (
        spark.readStream.format("delta")
        .load(lay.commitlog)
        .writeStream.foreachBatch(lambda df, batch: writer(df.toArrow(), batch))
        .option("checkpointLocation", lay.checkpoint("stamp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    after = send_many(spark, cfg, [Message("orders", "late")], clock)

    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    engine.stamp_available()
    assert schedule_ids(spark, lay.schedule) == sorted([*before, *more, *after])
