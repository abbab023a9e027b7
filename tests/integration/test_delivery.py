"""The delivery guarantees, on real Spark + Delta with levels ``1s 2s 3s`` and a fake clock."""

from __future__ import annotations

import contextlib
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.core.clock import FakeClock, SystemClock, from_micros
from engine.core.config import EngineConfig
from engine.core.errors import RetryableError
from engine.deliver.checkpoint import Plan
from engine.deliver.round import Delivery, RoundResult
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from engine.run.engine import Engine
from tests.support.crash import Crash, crash_after_writes, crash_before_commits, crash_writing
from tests.support.faults import FaultyStore, StoreWentAway
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows

pytestmark = pytest.mark.integration


def mixed_messages(n: int, topics: tuple[str, ...] = ("orders", "audit")) -> list[Message]:
    # levels -1..4: not delayed, each level, and one above the maximum (clamped to 3)
    return [
        Message(topics[i % len(topics)], f"body-{i}", keys=[f"k{i}"], delay_level=(i % 6) - 1)
        for i in range(n)
    ]


def run_for(engine: Engine, clock: FakeClock, seconds: float, tick: float = 0.5) -> None:
    """Step the engine while the fake clock moves ``seconds`` forward in ``tick`` steps."""
    steps = round(seconds / tick)
    for _ in range(steps):
        clock.advance(seconds=tick)
        engine.step()


def test_every_message_arrives_exactly_once_and_never_early(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    ids = send_many(spark, cfg, mixed_messages(24), clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    seen_at: dict[str, Any] = {}
    for _ in range(8):  # 4 s of fake time in 0.5 s ticks
        engine.step()
        for row in delivered_rows(spark, cfg):
            seen_at.setdefault(row["msg_id"], clock.now())
        clock.advance(seconds=0.5)
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, ids)
    for row in rows:
        # visible in its topic no earlier than the fake time it was due
        assert seen_at[row["msg_id"]] >= row["deliver_ts"].replace(tzinfo=clock.now().tzinfo)
        expected = {-1: 0, 0: 0, 1: 1, 2: 2, 3: 3, 4: 3}[row["delay_level"]]
        assert row["queue_id"] == expected
        assert row["deliver_ts"] - row["store_ts"] == timedelta(seconds=expected)
    assert engine.status().idle


def test_clamped_level_waits_for_the_max_delay(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    [msg_id] = send_many(spark, cfg, [Message("orders", "late", delay_level=99)], clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    run_for(engine, clock, 2.5)
    assert delivered_rows(spark, cfg) == []
    status = engine.status()
    assert (status.pending, status.unstamped) == ({3: 1}, 0), "waits in the top level's queue"
    run_for(engine, clock, 0.5)
    [row] = delivered_rows(spark, cfg)
    assert (row["msg_id"], row["queue_id"], row["delay_level"]) == (msg_id, 3, 99)


def test_empty_rounds_write_nothing(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    result = engine.step()
    assert (result.delivered, result.committed) == (0, False)
    assert delivered_rows(spark, cfg) == []


def test_many_topics_in_one_round(spark: SparkSession, cfg: EngineConfig, clock: FakeClock) -> None:
    topics = tuple(f"topic_{i}" for i in range(6))
    ids = send_many(spark, cfg, [Message(t, f"{t}-{n}") for t in topics for n in range(3)], clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    result = engine.step()
    assert result.per_topic == dict.fromkeys(topics, 3)
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, ids)
    assert all(r["body"].decode().startswith(r["topic"]) for r in rows)  # type: ignore[union-attr]


def test_crash_between_topic_write_and_commit_replays_without_duplicates(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    ids = send_many(spark, cfg, mixed_messages(12), clock)

    engine = Engine(spark, cfg, clock, out=lambda _: None, sinks=crash_after_writes()).open()
    clock.advance(seconds=1)
    with pytest.raises(Crash):
        engine.step()
    written = delivered_rows(spark, cfg)
    assert written, "the topic writes happened before the crash"

    # Later, more rows are due; a new process must first replay exactly the crashed round.
    clock.advance(seconds=5)
    restarted = Engine(spark, cfg, clock, out=lambda _: None).open()
    after_replay = delivered_rows(spark, cfg)
    assert sorted(r["msg_id"] for r in after_replay) == sorted(r["msg_id"] for r in written)
    restarted.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)


def test_crash_after_some_topics_replays_the_rest(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    ids = send_many(spark, cfg, mixed_messages(12, topics=("alpha", "beta")), clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None, sinks=crash_writing("beta")).open()
    clock.advance(seconds=4)
    with pytest.raises(Crash):
        engine.step()
    assert {r["topic"] for r in delivered_rows(spark, cfg)} == {"alpha"}

    Engine(spark, cfg, clock, out=lambda _: None).open()  # replays the planned round at start
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)


def test_replaying_a_committed_round_changes_nothing(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    """A plan left behind for a round that did commit (crash after the commit) is harmless."""
    ids = send_many(spark, cfg, mixed_messages(6), clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    clock.advance(seconds=4)
    engine.step()
    before = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(before, ids)
    # Re-run the same round's topic writes with the same txnVersion: Delta skips them.
    progress = engine.delivery.progress
    engine.delivery.progress = type(progress)(checkpoint_id=progress.checkpoint_id)
    engine.delivery.pending = Plan(progress.round, progress.watermark, progress.schedule_version)
    with pytest.raises(RetryableError, match="round 0 was committed by an engine fenced since"):
        engine.delivery.run_round()  # its commit file exists: put-if-absent refuses it
    assert len(delivered_rows(spark, cfg)) == len(before)
    assert engine.delivery.progress == progress  # the committed progress, read again


def test_a_table_that_may_forget_its_txn_records_is_refused_naming_it_and_the_property(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    """``delta.setTransactionRetentionDuration`` lets a checkpoint drop the ``txn`` records a
    replay is skipped by: at start, and when a running engine meets it on a topic table."""
    from engine.core.errors import SetupError

    ids = send_many(spark, cfg, mixed_messages(4), clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    clock.advance(seconds=4)
    engine.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)
    orders = layout(cfg).topic("orders")
    prop = "'delta.setTransactionRetentionDuration'"
    spark.sql(f"ALTER TABLE delta.`{orders}` SET TBLPROPERTIES ({prop} = 'interval 1 days')")
    more = send_many(spark, cfg, [Message("orders", "late", delay_level=1)], clock)
    clock.advance(seconds=2)
    with pytest.raises(SetupError, match=f"{orders}: table property delta.setTransaction"):
        for _ in range(3):  # the stamping batch, then the round that writes orders
            engine.step()
    with pytest.raises(SetupError, match=f"{orders}: .* UNSET TBLPROPERTIES"):
        Engine(spark, cfg, clock, out=lambda _: None).open()
    spark.sql(f"ALTER TABLE delta.`{orders}` UNSET TBLPROPERTIES ({prop})")
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    engine.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids + more)


def test_stamping_replay_stores_nothing_twice(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    from engine.stamp.stamper import Stamper

    send_many(spark, cfg, mixed_messages(6), clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    first = engine.stamper.run_batch()
    assert first is not None and first.rows == 6
    # A restart runs the newest plan again, over the same files: nothing is stored twice.
    again = Stamper(spark, cfg, layout(cfg), clock).run_batch()
    assert again is not None and again.batch == first.batch and again.replayed
    assert spark.read.format("delta").load(layout(cfg).schedule).count() == 6


def test_message_stamped_after_its_time_is_delivered_next_round(
    spark: SparkSession, make_cfg: Any, clock: FakeClock
) -> None:
    cfg = make_cfg(checkpoint_flush_ms=1)  # idle rounds record their watermark at once
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    [msg_id] = send_many(spark, cfg, [Message("orders", "late", delay_level=1)], clock)
    clock.advance(seconds=5)
    engine.delivery.run_round()  # the watermark passes deliver_ts before the row is stamped
    engine.delivery.run_round()
    assert engine.delivery.progress.watermark > clock.now() - timedelta(seconds=1)
    engine.step()  # stamped now, 4 s after it was due
    [row] = delivered_rows(spark, cfg)
    assert row["msg_id"] == msg_id


def test_shortened_level_table_makes_waiting_rows_due_now(
    spark: SparkSession, make_cfg: Any, clock: FakeClock
) -> None:
    long_cfg = make_cfg(levels="1s 1h")
    [msg_id] = send_many(spark, long_cfg, [Message("orders", "x", delay_level=2)], clock)
    engine = Engine(spark, long_cfg, clock, out=lambda _: None).open()
    engine.step()
    clock.advance(seconds=10)
    engine.step()
    assert delivered_rows(spark, long_cfg) == []

    short_cfg = make_cfg(levels="1s 2s", lakehouse=long_cfg.lakehouse)
    notes: list[str] = []
    restarted = Engine(spark, short_cfg, clock, out=notes.append).open()
    assert any("1 scheduled rows" in n for n in notes), notes
    restarted.step()
    [row] = delivered_rows(spark, short_cfg)
    assert row["msg_id"] == msg_id
    assert row["delivered_ts"] >= row["deliver_ts"]


def test_bad_rows_in_commitlog_are_quarantined_and_do_not_stop_delivery(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    from engine.stamp.transform import queue_of  # noqa: F401 - imported to show the stamp module loads

    good = send_many(spark, cfg, [Message("orders", "fine")], clock)
    T = "TIMESTAMP'2026-01-01 12:00:00'"
    spark.sql(
        f"""INSERT INTO delta.`{layout(cfg).commitlog}` VALUES
        ('M1', NULL, array(), NULL, map(), X'01', 1, NULL, {T}, NULL),
        ('M2', 'bad-topic', array(), NULL, map(), X'01', 1, NULL, {T}, NULL),
        ('M3', 'orders', array(), NULL, map('p', NULL), X'01', 1, NULL, {T}, NULL),
        ('M4', 'orders', array(), NULL, map(), NULL, 1, NULL, {T}, NULL),
        ('M5', 'orders', array(), NULL, map(), X'01', NULL, NULL, {T}, {T} + INTERVAL 40 DAYS),
        ('M6', 'orders', array(), NULL, map(), X'01', 18, NULL,
         TIMESTAMP'9999-12-31 23:00:00', NULL),
        ('M7', 'orders', array(), NULL, map(), X'', 1, NULL, {T}, NULL),
        ('M8', 'orders', array(), NULL, map('a=b', 'v'), X'01', 1, NULL, {T}, NULL)"""
    )
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    clock.advance(seconds=1)
    engine.step()
    reasons = {
        r["msg_id"]: r["reason"]
        for r in spark.read.format("delta").load(layout(cfg).quarantine).collect()
    }
    assert reasons == {
        "M1": "topic is missing",
        "M2": "topic 'bad-topic' is not a valid topic name",
        "M3": "a property has an empty name or no value",
        "M4": "body is missing",
        "M5": "deliver_at is more than messages.max_delay=2592000s ahead",
        "M6": "store_ts is outside 1970-01-01..9000-01-01",
        "M7": "body is empty (messages.allow_empty_body is false)",
        "M8": "property name 'a=b' is longer than messages.max_property_name_length=128 "
        "or holds characters other than A-Z a-z 0-9 _ . - :",
    }
    assert [r["msg_id"] for r in delivered_rows(spark, cfg)] == good
    status = engine.status()
    assert (status.quarantined, status.idle) == (8, True)


def test_topics_differing_only_in_case_lose_nothing(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    ids = send_many(spark, cfg, [Message("Orders", "a"), Message("orders", "b")], clock)
    result = Engine(spark, cfg, clock, out=lambda _: None).step()
    assert result.per_topic == {"orders": 2}
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, ids)
    assert sorted(r["topic"] for r in rows) == ["Orders", "orders"]


def test_clock_stepping_back_never_delivers_early(
    spark: SparkSession, make_cfg: Any, clock: FakeClock
) -> None:
    cfg = make_cfg(levels="1s 1h", checkpoint_flush_ms=1)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    clock.advance(seconds=3600)
    engine.step()  # the watermark is now t0 + 1 h
    clock.advance(seconds=-3600)  # NTP steps the clock back an hour
    [msg_id] = send_many(spark, cfg, [Message("orders", "x", delay_level=2)], clock)
    engine.step()
    assert delivered_rows(spark, cfg) == [], "due at t0 + 1 h, it is only t0"
    clock.advance(seconds=3600)
    engine.step()
    assert [r["msg_id"] for r in delivered_rows(spark, cfg)] == [msg_id]


def test_missing_delivery_checkpoint_refuses_to_start(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    import shutil

    from engine.core.errors import CheckpointError

    send_many(spark, cfg, [Message("orders", "a")], clock)
    Engine(spark, cfg, clock, out=lambda _: None).step()
    shutil.rmtree(layout(cfg).delay_offset)
    with pytest.raises(CheckpointError, match="duplicate every message"):
        Engine(spark, cfg, clock, out=lambda _: None).open()


def test_missing_stamping_checkpoint_refuses_to_start(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    import shutil

    from engine.core.errors import CheckpointError

    send_many(spark, cfg, [Message("orders", "a")], clock)
    Engine(spark, cfg, clock, out=lambda _: None).step()
    shutil.rmtree(layout(cfg).checkpoint("stamp"))
    with pytest.raises(CheckpointError, match="schedule every message twice"):
        Engine(spark, cfg, clock, out=lambda _: None).open()


def test_a_failed_commit_never_reuses_a_round_number(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.lakehouse.state.offset_log import OffsetLog

    ids = send_many(spark, cfg, mixed_messages(6), clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    real_write = OffsetLog.write

    def landed_but_failed(
        self: OffsetLog, round_: int, rows: Any, planned: bool = False, **kw: Any
    ) -> None:
        real_write(self, round_, rows, planned, **kw)
        if not planned and self.path == layout(cfg).delay_offset:
            raise OSError("rename reported failure after the copy landed")

    monkeypatch.setattr(OffsetLog, "write", landed_but_failed)
    clock.advance(seconds=1)
    with pytest.raises(OSError):
        engine.step()
    monkeypatch.setattr(OffsetLog, "write", real_write)
    committed = engine.delivery.progress.round
    assert committed == 0, "the landed commit was reloaded"
    clock.advance(seconds=5)
    assert engine.step().round == committed + 1
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)


def test_a_commit_that_fails_half_way_is_run_again_from_its_plan(
    spark: SparkSession, any_cfg: EngineConfig, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.lakehouse.state import offset_log

    cfg = any_cfg
    ids = send_many(spark, cfg, mixed_messages(12), clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    real = offset_log.store_for(layout(cfg).delay_offset)
    faulty = FaultyStore(real, cut=lambda p: "delay_offset" in p and not p.endswith(".plan.json"))
    monkeypatch.setattr(engine.delivery.offsets, "_store", faulty)
    clock.advance(seconds=1)
    with pytest.raises(StoreWentAway):
        engine.step()
    monkeypatch.setattr(engine.delivery.offsets, "_store", real)
    assert engine.delivery.pending is not None, "the round's plan is what is durable"
    for _ in range(4):
        clock.advance(seconds=1)
        engine.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)


def test_a_listing_that_misses_the_newest_commit_duplicates_nothing(
    spark: SparkSession, any_cfg: EngineConfig, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.lakehouse.state import offset_log

    cfg = any_cfg
    first = send_many(spark, cfg, mixed_messages(12), clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    for _ in range(4):
        clock.advance(seconds=1)
        engine.step()
    committed = engine.delivery.progress.round
    folder = layout(cfg).delay_offset
    misses = {"left": 3}

    def stale_listing(listed: str, names: list[str]) -> list[str]:
        commits = [n for n in names if not n.endswith(".plan.json")]
        if listed == folder and misses["left"] > 0 and commits:
            misses["left"] -= 1
            return [n for n in names if n != commits[-1]]  # the newest commit: not listed yet
        return names

    faulty = FaultyStore(offset_log.store_for(folder), listing=stale_listing)
    monkeypatch.setattr(offset_log, "store_for", lambda _location: faulty)
    restarted = Engine(spark, cfg, clock, out=lambda _: None).open()  # believes round k-1
    later = send_many(spark, cfg, mixed_messages(6), clock)
    for _ in range(8):
        clock.advance(seconds=1)
        with contextlib.suppress(RetryableError):  # the engine's loop retries after a pause
            restarted.step()
    assert misses["left"] == 0
    assert restarted.delivery.progress.round > committed
    assert_exactly_once_never_early(delivered_rows(spark, cfg), first + later)


def test_producers_do_not_migrate_an_old_lakehouse_the_engine_does(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    from delta.tables import DeltaTable
    from pyspark.sql.types import StructType

    from engine.core.errors import SetupError
    from schemas import COMMITLOG

    old = StructType([f for f in COMMITLOG.fields if f.name != "deliver_at"])
    DeltaTable.create(spark).location(layout(cfg).commitlog).addColumns(old).execute()
    with pytest.raises(SetupError, match="start the engine once"):
        send_many(spark, cfg, [Message("orders", "a")], clock)
    Engine(spark, cfg, clock, out=lambda _: None).open()
    [msg_id] = send_many(spark, cfg, [Message("orders", "a", delay="1s")], clock)
    clock.advance(seconds=1)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    engine.step()
    assert [r["msg_id"] for r in delivered_rows(spark, cfg)] == [msg_id]


def test_a_topic_table_made_by_delta_rs_reads_like_one_made_by_spark(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    from delta.tables import DeltaTable
    from pyspark.sql.pandas.types import to_arrow_schema

    from engine.lakehouse.delta.arrow_delta import create_table
    from engine.lakehouse.delta.tables import ensure_topic_table
    from schemas import TOPIC

    path = ensure_topic_table(spark, cfg, "orders")
    assert not create_table(path, to_arrow_schema(TOPIC, timezone="UTC"))  # it exists
    by_spark = layout(cfg).topic("by_spark")
    DeltaTable.createIfNotExists(spark).location(by_spark).addColumns(TOPIC).execute()
    made, expected = (spark.read.format("delta").load(p).schema for p in (path, by_spark))
    assert made == expected


def test_a_round_planned_ahead_shows_its_rows_at_its_watermark_never_before(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    """Real clock. A round started 1 s before its rows are due and planned 1.5 s ahead
    delivers them: it writes their files, waits for its watermark, then commits. Every topic
    commit (its Delta log timestamp, written just before the commit appears) is at or after
    the deliver_ts of each of its rows."""
    clock = SystemClock()
    topics = ("orders", "audit")
    ids = send_many(
        spark, cfg, [Message(topics[i % 2], f"m{i}", delay="8s") for i in range(10)], clock
    )
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    engine.stamp_available()
    first = engine.delivery.run_round()  # nothing is due yet (Spark's first jobs take a while)
    assert first.delivered == 0
    schedule = spark.read.format("delta").load(layout(cfg).schedule)
    due = schedule.agg(F.min("deliver_ts"), F.max("deliver_ts")).first()
    assert due is not None
    earliest, latest = (t.astimezone(UTC) for t in due)  # (Spark gives local time)
    assert latest - earliest < timedelta(milliseconds=100), "one send: one store time"
    time.sleep(max(0.0, (earliest - clock.now()).total_seconds() - 1.0))

    result = engine.delivery.run_round(lead_ms=1500)

    assert result.delivered == len(ids), "the round's watermark is past their time"
    assert result.stages["wait"] > 0.05, result.stages  # the files were ready before it
    rows = delivered_rows(spark, cfg)
    assert {r["topic"] for r in rows} == set(topics)
    assert_exactly_once_never_early(rows, ids, cfg)  # by delivered_ts and by the Delta log
    for row in rows:
        assert row["delivered_ts"].astimezone(UTC) == result.watermark  # type: ignore[union-attr]


def test_a_round_after_a_quiet_one_is_planned_at_the_next_rows_time_unless_a_table_moved(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    """Real clock. The last round found the next row due at T; a round 180 ms before T with
    a 10 ms lead would take rows up to 10 ms later only (T's rows wait for the next one, a
    poll interval on). It is planned at T instead (within a poll interval and the batch's
    watermark), and waits for T before it shows T's rows. After a new ``schedule`` version
    (rows the record does not know of) the round keeps its own lead."""
    clock = SystemClock()
    ids = send_many(spark, cfg, [Message("orders", f"m{i}", delay="8s") for i in range(5)], clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    engine.stamp_available()
    assert engine.delivery.run_round().delivered == 0
    record = engine.delivery.quiet(clock.now())
    assert record is not None and record.due_us is not None
    due = from_micros(record.due_us)
    time.sleep(max(0.0, (due - clock.now()).total_seconds() - 0.18))
    result = engine.delivery.run_round(lead_ms=10, until=clock.now() + timedelta(seconds=0.2))
    assert result.delivered == len(ids) and result.watermark == due
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, ids, cfg)

    later = send_many(spark, cfg, [Message("orders", "n", delay="8s")], clock)
    engine.stamp_available()
    assert engine.delivery.run_round().delivered == 0
    record = engine.delivery.quiet(clock.now())  # (knows n's time)
    assert record is not None and record.due_us is not None
    send_many(spark, cfg, [Message("orders", "o", delay="1h")], clock)
    engine.stamp_available()  # (a version the record does not know)
    due = from_micros(record.due_us)
    time.sleep(max(0.0, (due - clock.now()).total_seconds() - 0.18))
    result = engine.delivery.run_round(lead_ms=10, until=clock.now() + timedelta(seconds=0.2))
    assert result.delivered == 0 and result.watermark < due
    time.sleep(max(0.0, (due - clock.now()).total_seconds()))
    assert engine.delivery.run_round().delivered == len(later)
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids + later, cfg)


def test_a_round_planned_ahead_with_nothing_due_records_progress_up_to_now(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    """Nothing to show, so nothing to wait for: the progress of a round planned ahead that
    only counts new stamped rows goes up to the time it commits, not past it."""
    clock = SystemClock()
    send_many(spark, cfg, [Message("orders", "later", delay="1h")], clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    engine.stamp_available()
    before = clock.now()
    result = engine.delivery.run_round(lead_ms=500)
    assert result.committed and result.delivered == 0
    assert result.stages["wait"] < 0.1, result.stages  # no wait for a watermark 500 ms on
    assert result.watermark <= clock.now()
    assert result.watermark < before + timedelta(milliseconds=500)
    assert engine.delivery.progress.watermark == result.watermark


def test_crash_after_the_files_before_the_commits_shows_nothing_then_replays_once(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    """The topic files of a round are written before any commit shows them; a crash in
    between leaves nothing visible, and the replay delivers every row once."""
    ids = send_many(spark, cfg, mixed_messages(12), clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None, sinks=crash_before_commits()).open()
    clock.advance(seconds=4)
    with pytest.raises(Crash):
        engine.step()
    assert delivered_rows(spark, cfg) == [], "files written, none committed: none seen"
    staged = [p for t in ("orders", "audit") for p in Path(layout(cfg).topic(t)).glob("*.parquet")]
    assert staged, "the crashed round wrote its data files"

    Engine(spark, cfg, clock, out=lambda _: None).open()  # replays the planned round
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)


def test_the_lead_follows_the_rounds_and_is_dropped_when_rows_may_be_overdue(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    """The engine plans a round ahead by about the time the last rounds took to write their
    files, never more than 3/4 of the poll interval (150 ms here), and not at all once the
    last round's watermark is older than a poll interval and that cap (after a long round,
    rows are overdue: no holding back). A round that found nothing due counts as the last."""
    ids = send_many(spark, cfg, mixed_messages(6), clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    delivery = engine.delivery
    assert delivery.lead_ms() == 0, "no round has written yet"
    clock.advance(seconds=4)
    assert engine.step().delivered == len(ids)
    lead = delivery.lead_ms()
    assert 0 < lead <= 150
    clock.advance(millis=cfg.poll_interval_ms)
    assert delivery.lead_ms() == lead, "the next round, a poll interval later"
    clock.advance(millis=150 + 1)
    assert delivery.lead_ms() == 0, "a long round: rows may be overdue"
    assert engine.step().delivered == 0  # nothing due, nothing committed
    assert delivery.lead_ms() == lead, "it looked up to now: nothing is overdue"
    delivery._preps.extend([1.0] * 5)  # rounds that took a second to write their files
    assert delivery.lead_ms() == 150


class _SteppingBack(FakeClock):
    """A fake clock that steps back 5 s right after its first reading (an NTP step)."""

    def __init__(self, start: datetime) -> None:
        super().__init__(start)
        self.readings = 0

    def now(self) -> datetime:
        self.readings += 1
        now = super().now()
        return now if self.readings == 1 else now - timedelta(seconds=5)


def test_a_clock_stepping_back_in_a_round_planned_ahead_never_moves_progress_back(
    spark: SparkSession, make_cfg: Any, clock: FakeClock
) -> None:
    """A round planned ahead with nothing due records progress up to the clock; if the clock
    stepped back meanwhile, not below the progress before it (a window going back would
    deliver its rows again)."""
    cfg = make_cfg(checkpoint_flush_ms=1)  # a round with nothing due commits its progress
    ids = send_many(
        spark, cfg, [Message("orders", f"m{i}", delay_level=1) for i in range(3)], clock
    )
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    clock.advance(seconds=2)
    assert engine.step().delivered == len(ids)
    before = engine.delivery.progress.watermark

    stepping = _SteppingBack(clock.now() + timedelta(milliseconds=100))
    moved = Delivery(spark, cfg, layout(cfg), stepping).open()
    with contextlib.suppress(RetryableError):  # it waits a while for the clock to come back
        moved.run_round(lead_ms=500)
    assert moved.progress.watermark >= before

    clock.advance(seconds=1)
    later = Delivery(spark, cfg, layout(cfg), clock).open()
    later.run_round()  # (the replay of a plan left pending)
    later.run_round()
    assert later.progress.watermark >= before
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)


def test_the_running_engine_plans_rounds_ahead_and_never_shows_a_row_before_it_is_due(
    spark: SparkSession, make_cfg: Any
) -> None:
    """The engine's own loop on the system clock, with its lead on: messages due every 10 ms
    over 3 s are delivered by rounds planned ahead of the clock (a round's plan, written as
    it starts, holds the clock then and a later watermark), some of them before they are due
    (the rows the lead is about), and not one is shown early: every topic commit, by its
    Delta log time, is at or after the deliver_ts of each row it shows."""
    cfg = make_cfg(max_lead_ms=500, poll_interval_ms=200)  # the defaults: a lead of <= 150 ms
    engine = Engine(spark, cfg, out=lambda _: None)
    rounds: list[RoundResult] = []
    engine.add_listener(rounds.append)
    engine.start()
    try:
        engine.wait_until_warm()
        due_in = [timedelta(milliseconds=2_000 + 10 * i) for i in range(300)]
        messages = [Message(f"t{i % 3}", f"m{i}", delay=d) for i, d in enumerate(due_in)]
        ids = send_many(spark, cfg, messages)
        deadline = time.monotonic() + 60
        while engine.stats.delivered < len(ids) and time.monotonic() < deadline:
            engine.check_queries()
            time.sleep(0.1)
    finally:
        engine.stop()
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, ids, cfg)  # by delivered_ts and by the Delta log

    # Each round's plan: the clock when it was written (as the round started) and the
    # watermark it fixed. Planned ahead: a watermark later than that clock.
    plans = {
        int(p.name.split(".")[0]): json.loads(p.read_text().splitlines()[0])
        for p in Path(layout(cfg).delay_offset).glob("*.plan.json")
    }
    planned_at = {k: datetime.fromisoformat(p["updated_ts"]) for k, p in plans.items()}
    ahead = {k for k, p in plans.items() if datetime.fromisoformat(p["watermark"]) > planned_at[k]}
    seen = sorted((k, p["updated_ts"], p["watermark"]) for k, p in plans.items())
    assert ahead, f"no round was planned ahead of the clock (round, at, watermark): {seen[:3]}"
    early_risk = [
        r["msg_id"]
        for r in rows
        if r["delivery_round"] in ahead
        and r["deliver_ts"].astimezone(UTC) > planned_at[r["delivery_round"]]  # type: ignore[attr-defined]
    ]
    assert early_risk, "no row was planned for delivery before it was due"
    waited = [r for r in rounds if r.delivered and r.stages.get("wait", 0.0) > 0.001]
    assert waited, "no round waited for its watermark"
    print(
        f"\n{len(plans)} rounds planned, {len(ahead)} ahead of the clock; {len(early_risk)} "
        f"rows planned before they were due; {len(waited)} rounds waited for their watermark"
    )


def test_a_round_failing_for_a_bug_stops_the_engine_at_once_a_passing_failure_is_retried(
    spark: SparkSession, cfg: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk hiccup is retried after the back-off; a ``TypeError`` (the same every time) ends
    the delivery stage at the next try, raised as it is, so the job reports a bug (exit 70)
    instead of retrying for five minutes and exiting as a delivery failure."""
    import engine.run.engine as running

    monkeypatch.setattr(running, "ERROR_BACKOFF_S", 0.2)
    engine = Engine(spark, cfg, out=lambda _: None)
    tries: list[str] = []

    def failing(lead_ms: int = 0, until: object = None) -> RoundResult:
        tries.append("round")
        if len(tries) == 1:
            raise OSError(5, "Input/output error", "schedule/part-0.parquet")
        raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    monkeypatch.setattr(engine.delivery, "run_round", failing)
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while engine.stats.errors < 1 or len(tries) < 2:
            assert time.monotonic() < deadline, f"tries {tries}, errors {engine.stats.errors}"
            time.sleep(0.05)
        time.sleep(1.0)  # many back-offs: a retried bug would try again meanwhile
        with pytest.raises(TypeError, match="unsupported operand"):
            engine.check_queries()
        assert (len(tries), engine.stats.errors) == (2, 1), "the hiccup retried, the bug not"
    finally:
        engine.stop()
