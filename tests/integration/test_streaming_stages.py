"""The stages as Structured Streaming queries: ``delayq-stamp`` (``stamp.mode = streaming``)
and ``delayq-deliver`` (``delivery.mode = streaming``)."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQueryListener
from pyspark.sql.streaming.datasource import ReadAllAvailable

import engine.run.metrics as metrics_module
from engine.control.commands import cancel
from engine.core.clock import FakeClock, SystemClock, to_micros, to_millis
from engine.core.config import EngineConfig
from engine.core.errors import CheckpointError, FencedError
from engine.deliver.checkpoint import read_checkpoint
from engine.deliver.query import ClockReader, batch_figures
from engine.deliver.quiet import load_quiet, next_offset, save_quiet
from engine.deliver.round import Delivery, RoundResult
from engine.deliver.sinks import DeltaTopicSink
from engine.lakehouse.catalog.session import (
    CHECKPOINT_MANAGER_KEY,
    LINK_CHECKPOINT_MANAGER,
    link_checkpoints,
)
from engine.lakehouse.delta.appends import CommitlogSource, Position
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.tables import ensure_tables
from engine.lakehouse.state.offset_log import OffsetLog
from engine.lakehouse.storage.fs import spark_offset
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from engine.run.engine import DELIVER_QUERY, Engine
from engine.run.metrics import MetricsServer
from engine.stamp.query import FILES, QUERY_NAME, CommitlogReader, StampQuery, newest_plan
from engine.stamp.stamper import Stamper
from engine.stamp.tasks import stamp_on_executors
from engine.stamp.writer import StampWriter, highest_batch
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows
from tests.support.scrape import scrape

pytestmark = pytest.mark.integration


def _stamped(spark: SparkSession, cfg: EngineConfig) -> list[tuple[str, int]]:
    rows = spark.read.format("delta").load(layout(cfg).schedule)
    return sorted((r["msg_id"], r["stamp_batch"]) for r in rows.collect())


def _send(spark: SparkSession, cfg: EngineConfig, tag: str, n: int = 5) -> list[str]:
    return send_many(spark, cfg, [Message("t", f"{tag}{i}", delay_level=1) for i in range(n)])


class _Heard(StreamingQueryListener):
    def __init__(self) -> None:
        self.progress: list[tuple[str, int]] = []
        self.figures: list[dict[str, float]] = []  # the delivery batches' observed metrics

    def onQueryStarted(self, event: Any) -> None:
        return None

    def onQueryProgress(self, event: Any) -> None:
        self.progress.append((event.progress.name, event.progress.numInputRows))
        found = batch_figures(event.progress)
        if event.progress.name == DELIVER_QUERY and found is not None:
            self.figures.append(found)

    def onQueryIdle(self, event: Any) -> None:
        return None

    def onQueryTerminated(self, event: Any) -> None:
        return None


def test_the_query_goes_on_from_the_driver_path_and_a_replayed_batch_stores_nothing_twice(
    spark: SparkSession, make_cfg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver path's last batch cut short between its two tables' commits (a kill there,
    as an engine on driver threads may leave a lakehouse): the query's first start finishes
    it, storing nothing twice. Spark's checkpoint one step behind the tables (killed after
    the writes, before Spark's commit): the batch runs again, over the same files, and
    stores nothing twice. Its batch numbers go on from the driver path's, which then refuses
    the lakehouse. Spark's record of a batch lost altogether: the stamping log's gives the
    batch its range back; another range held under its number is refused."""
    cfg: EngineConfig = make_cfg()
    lay, clock = layout(cfg), SystemClock()
    ensure_tables(spark, cfg)
    first = _send(spark, cfg, "a")
    driver = Stamper(spark, cfg, lay, clock)
    assert driver.run_available() == 5

    class Cut(Exception):
        pass

    append = StampWriter._append

    by_then = highest_batch(ArrowDelta(lay.schedule))

    def cut_after_schedule(
        self: StampWriter, rows: Any, path: str, batch_id: int, *args: Any
    ) -> None:
        append(self, rows, path, batch_id, *args)
        if path == lay.schedule and batch_id > by_then:  # (not a replay of an earlier one)
            raise Cut  # the process dies here: `quarantine` and the batch's end not written

    cut = _send(spark, cfg, "i")
    with monkeypatch.context() as patched:
        patched.setattr(StampWriter, "_append", cut_after_schedule)
        with pytest.raises(Cut):
            Stamper(spark, cfg, lay, clock).run_available()
    cut_plan = newest_plan(lay)
    assert cut_plan is not None and cut_plan.batch == by_then + 1  # cut short in schedule
    driver_batch = cut_plan.batch
    assert {b for m, b in _stamped(spark, cfg) if m in cut} == {driver_batch}

    stamping = StampQuery(spark, cfg, lay, clock)
    second = _send(spark, cfg, "b")
    assert stamping.run_available() == 5  # "b" (the cut batch is finished at its open)
    third = _send(spark, cfg, "c")
    assert stamping.run_available() == 5
    rows = _stamped(spark, cfg)
    assert sorted(m for m, _ in rows) == sorted(first + cut + second + third)  # each once
    assert {b for m, b in rows if m in cut} == {driver_batch}  # under the driver's number
    query_batches = sorted({b for _, b in rows} - {driver_batch - 1, driver_batch})
    assert query_batches == [driver_batch + 1, driver_batch + 2]
    plan = newest_plan(lay)
    assert plan is not None and plan.batch == driver_batch + 2  # what maintenance reads

    # Spark's commit of the last batch lost (the process died after the tables' commits)
    commits = Path(lay.checkpoint("stamp-query")) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    for lost in (commits / str(last), commits / f".{last}.crc"):
        lost.unlink(missing_ok=True)
    restarted = StampQuery(spark, cfg, lay, clock)
    assert restarted.run_available() == 5  # the batch ran again, over the same files
    assert _stamped(spark, cfg) == rows  # ... and stored nothing twice
    assert restarted.stats.recent[-1].batch == driver_batch + 2

    with pytest.raises(CheckpointError, match=r"stamp\.mode=streaming"):
        Stamper(spark, cfg, lay, clock).open()

    # Spark's record of the batch lost altogether (a power cut, a hand "repair") while more
    # was sent: the stamping log's record of the batch gives Spark its range back, so the
    # batch runs again over the same files (storing nothing twice) and the rest comes next.
    more = _send(spark, cfg, "d")
    offsets = Path(lay.checkpoint("stamp-query")) / "offsets"

    def lose_sparks_record() -> None:
        for folder in (offsets, commits):
            for lost in (folder / str(last), folder / f".{last}.crc"):
                lost.unlink(missing_ok=True)

    lose_sparks_record()
    assert StampQuery(spark, cfg, lay, clock).run_available() == 10  # again, and "d"
    stamped = _stamped(spark, cfg)
    assert [r for r in stamped if r[0] not in more] == rows
    assert {b for m, b in stamped if m in more} == {driver_batch + 3}

    # ... and when the stamping log holds another range for that number (a copy of another
    # lakehouse's), Spark's new plan of it is refused: it would skip or repeat messages.
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    lose_sparks_record()
    held = newest_plan(lay)
    assert held is not None and held.batch == driver_batch + 3
    other = dataclasses.replace(held, start=Position(held.start.version - 1, 0))
    plans = OffsetLog(lay.checkpoint("stamp") + "/batches")
    plans.write(held.batch, [other.row()])
    with pytest.raises(CheckpointError, match=f"stamping batch {driver_batch + 3} covers"):
        StampQuery(spark, cfg, lay, clock).run_available()
    assert _stamped(spark, cfg) == stamped


def test_a_start_stamps_what_waits_while_the_query_starts_and_the_query_finds_it_done(
    spark: SparkSession, make_cfg: Any
) -> None:
    """What was sent while the engine was stopped is stamped on the driver while Spark starts
    the query, as the batch the query's next one will be (``plan_first``, ``stamp_first``).
    A start that claimed the batch and died, or stamped it and stopped before Spark ran it,
    is followed by one that claims that same range (what was sent since is not added to
    it); the query then plans exactly that range, finds it done, and stamps the rest in the
    next batch: every message once."""
    cfg: EngineConfig = make_cfg()
    lay, clock = layout(cfg), SystemClock()
    ensure_tables(spark, cfg)
    first = _send(spark, cfg, "a")
    assert Stamper(spark, cfg, lay, clock).run_available() == 5  # the driver path, before
    waiting = _send(spark, cfg, "w")
    died = StampQuery(spark, cfg, lay, clock).plan_first()  # ... and the process died
    assert len(died) == 1
    b = died[0].batch
    later = _send(spark, cfg, "l")

    stopped = StampQuery(spark, cfg, lay, clock)
    assert stopped.plan_first() == died  # the claimed range, nothing added to it
    assert [(r.batch, r.rows, r.where) for r in stopped.stamp_first()] == [(b, 5, "driver")]
    assert stopped.stamp_first() == []  # (once) ... and it stopped before Spark ran it
    last = _send(spark, cfg, "z")
    restarted = StampQuery(spark, cfg, lay, clock)
    assert restarted.plan_first() == died  # Spark has not planned it: the same claim
    restarted.stamp_first()  # (stores nothing twice)
    assert restarted.run_available() == 10  # Spark's batch 0 was done: later + last

    rows = _stamped(spark, cfg)
    assert sorted(m for m, _ in rows) == sorted(first + waiting + later + last)  # each once
    assert {n for m, n in rows if m in waiting} == {b}
    assert {n for m, n in rows if m in later + last} == {b + 1}
    end = died[0].end  # Spark planned the claimed range for its batch 0
    assert spark_offset(lay.checkpoint("stamp-query"), 0) == {
        "version": end.version,
        "index": end.index,
    }


def test_executors_stamp_and_write_a_batch_as_the_driver_path_does(
    spark: SparkSession, make_cfg: Any
) -> None:
    """With ``stamp.driver_batch_bytes = 0`` every batch is stamped and written by Spark
    tasks (Spark's progress counts its files); the rows stamped are the driver path's,
    quarantine and duplicates (in one batch, and of an earlier batch) included."""
    by_spark: EngineConfig = make_cfg(stamp_driver_bytes=0, max_body_bytes=4)
    by_driver = dataclasses.replace(by_spark, lakehouse=by_spark.lakehouse + "-driver")
    messages = [
        Message("t", "ok", delay_level=2, msg_id="ok"),
        Message("t", "late", delay="5s", msg_id="timer"),
        Message("t", "ok", delay_level=9, msg_id="clamped"),
    ]
    sent = FakeClock(datetime.now(UTC))  # the same store times in both lakehouses
    for cfg in (by_spark, by_driver):
        ensure_tables(spark, cfg)
        send_many(spark, cfg, messages, sent)
        send_many(spark, cfg, [Message("t", "ok", msg_id="ok")], sent)  # a retry
        spark.sql(
            f"INSERT INTO delta.`{layout(cfg).commitlog}` (msg_id, topic, body, store_ts) "
            "VALUES ('big', 't', X'0102030405', current_timestamp())"
        )
    stamping = StampQuery(spark, by_spark, layout(by_spark), SystemClock())
    heard = _Heard()
    spark.streams.addListener(heard)
    try:
        assert stamping.run_available() == 5
        deadline = time.monotonic() + 30  # (events reach the listener asynchronously)
        while sum(n for name, n in heard.progress if name == QUERY_NAME) < 5:
            assert time.monotonic() < deadline, heard.progress
            time.sleep(0.1)
    finally:
        spark.streams.removeListener(heard)
    driver = Stamper(spark, by_driver, layout(by_driver), SystemClock())
    assert driver.run_available() == 5
    assert {r.where for r in stamping.stats.recent} == {"executors"}
    for cfg in (by_spark, by_driver):  # a copy of an earlier batch's id, and one sent twice
        send_many(spark, cfg, [Message("t", "ag", msg_id="timer")], sent)
        send_many(spark, cfg, [Message("t", "w", msg_id="twice")] * 2, sent)
    assert stamping.run_available() == 3
    assert driver.run_available() == 3

    def seen(cfg: EngineConfig, table: str, *columns: str) -> list[tuple[Any, ...]]:
        frame = spark.read.format("delta").load(layout(cfg).table(table))
        return sorted(tuple(r) for r in frame.select(*columns).collect())

    columns = ("msg_id", "queue_id", "deliver_ts", "body")
    assert seen(by_spark, "schedule", *columns) == seen(by_driver, "schedule", *columns)
    assert [r[0] for r in seen(by_spark, "schedule", *columns)] == [
        "clamped", "ok", "timer", "twice"
    ]  # fmt: skip
    refused = seen(by_spark, "quarantine", "msg_id", "reason")
    assert refused == seen(by_driver, "quarantine", "msg_id", "reason")
    assert [m for m, _ in refused] == ["big", "ok", "timer", "twice"]
    assert refused[0][1] == "body is 5 bytes, over messages.max_body_bytes=4"
    assert all(why.startswith("duplicate: ") for _, why in refused[1:])


def test_files_written_by_tasks_count_once_their_batch_commits_even_when_run_again(
    spark: SparkSession, cfg: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch whose tasks wrote their files but whose commit never came (the driver died
    between, or was fenced meanwhile) adds nothing; run again, its rows are in once; run
    once more, nothing twice, and the next batch still knows the ids it holds."""
    lay = layout(cfg)
    ensure_tables(spark, cfg)
    sent = [m for tag in "xyz" for m in _send(spark, cfg, tag, n=7)]  # three files
    source, start = CommitlogSource(lay.commitlog), Position(0, 0)
    files = source.between(start, source.changes(start, 100, 1 << 30)[1])
    listed = [(i, f.path, f.size) for i, f in enumerate(files)]
    frame = spark.createDataFrame(listed, FILES).repartition(2)  # as the source's rows
    died = StampWriter(cfg, lay, SystemClock())

    def dies(*args: Any) -> tuple[int, int]:
        raise OSError("the driver died before its commit")

    monkeypatch.setattr(died, "adopt", dies)
    with pytest.raises(OSError, match="before its commit"):
        stamp_on_executors(frame, died, 7)
    assert _stamped(spark, cfg) == []  # files written, none of them in the table

    def fenced() -> None:  # another engine took the lakehouse over while the tasks ran
        raise FencedError("the lease is another engine's")

    with pytest.raises(FencedError):
        stamp_on_executors(frame, StampWriter(cfg, lay, SystemClock()), 7, fenced)
    assert _stamped(spark, cfg) == []
    writer = StampWriter(cfg, lay, SystemClock())
    assert stamp_on_executors(frame, writer, 7) == (21, 0)
    assert stamp_on_executors(frame, writer, 7) == (0, 0)  # `schedule` holds the batch
    replayed = StampWriter(cfg, lay, SystemClock())  # (a restart: its memory is rebuilt)
    assert stamp_on_executors(frame, replayed, 7) == (0, 0)
    assert _stamped(spark, cfg) == sorted((m, 7) for m in sent)

    # The next batch: a producer's retry of an id the replayed batch holds is a duplicate.
    after = source.changes(start, 100, 1 << 30)[1]
    send_many(spark, cfg, [Message("t", "x0", delay_level=1, msg_id=sent[0])])
    retry = [(0, f.path, f.size) for f in source.changes(after, 100, 1 << 30)[0]]
    assert stamp_on_executors(spark.createDataFrame(retry, FILES), replayed, 8) == (0, 1)
    assert _stamped(spark, cfg) == sorted((m, 7) for m in sent)


def test_executors_deliver_rounds_as_the_driver_path_does_and_a_replay_commits_the_rest(
    spark: SparkSession, make_cfg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``delivery.driver_round_rows = 0`` Spark tasks read every round's window and write
    its topic files, new tables and a cancel included; the topic rows are the driver path's
    and the progress too. A round whose driver dies between two tables' commits is replayed
    by the next engine: the committed table is not written twice, the other gets its rows."""
    by_spark: EngineConfig = make_cfg(delivery_mode="streaming", deliver_driver_rows=0)
    by_driver = dataclasses.replace(
        by_spark, lakehouse=by_spark.lakehouse + "-driver", delivery_mode="driver"
    )
    clock = FakeClock(datetime.now(UTC))
    messages = [
        Message(("Orders", "orders", "audit")[i % 3], f"b{i}", msg_id=f"m{i}", delay_level=i % 4)
        for i in range(30)
    ]
    for cfg in (by_spark, by_driver):
        ensure_tables(spark, cfg)
        send_many(spark, cfg, messages, clock)
        Stamper(spark, cfg, layout(cfg), clock).run_available()
        cancel(spark, cfg, "m6", wait=0, clock=clock)  # (level 2: due at 2 s)
    rounds: dict[str, list[RoundResult]] = {"spark": [], "driver": []}
    deliveries = {
        n: Delivery(spark, c, layout(c), clock)
        for n, c in (("spark", by_spark), ("driver", by_driver))
    }
    for _ in range(4):  # 0 s, then 1, 2, 3 s: each level's rows in a round of their own
        for name, delivery in deliveries.items():  # (new tables guessed, then known ones)
            rounds[name].append(delivery.run_round())
        clock.advance(seconds=1)
    assert [r.where for r in rounds["spark"]] == ["executors"] * 4
    assert [r.where for r in rounds["driver"]] == ["driver"] * 4
    for a, b in zip(rounds["spark"], rounds["driver"], strict=True):
        assert (a.delivered, a.per_topic) == (b.delivered, b.per_topic)
        assert (a.lateness.counts, a.lateness.n) == (b.lateness.counts, b.lateness.n)
    columns = ("msg_id", "topic", "queue_id", "deliver_ts", "delivered_ts", "delivery_round")

    def topics(cfg: EngineConfig) -> list[tuple[Any, ...]]:  # (delta-rs: no Spark job)
        tables = [ArrowDelta(layout(cfg).topic(t)) for t in ("orders", "audit")]
        rows = [r for t in tables for r in t.dataset(t.latest()).to_table().to_pylist()]
        return sorted(tuple(r[c] for c in columns) for r in rows)

    assert topics(by_spark) == topics(by_driver)
    assert len(topics(by_spark)) == 29  # every message but the cancelled one
    assert read_checkpoint(spark, layout(by_spark))[0].queues == (
        read_checkpoint(spark, layout(by_driver))[0].queues
    )

    # The driver dies after the first table's commit of a round, before the second's.
    more = [Message(t, "x", msg_id=f"x{t}", delay_level=1) for t in ("orders", "audit")]
    send_many(spark, by_spark, more, clock)
    Stamper(spark, by_spark, layout(by_spark), clock).run_available()
    clock.advance(seconds=1)
    commit = DeltaTopicSink.commit_files
    calls: list[str] = []

    def dies_after_one(self: DeltaTopicSink, round_: int, table: str, *args: Any) -> None:
        if calls:
            raise OSError("the driver died between two commits")
        calls.append(table)
        commit(self, round_, table, *args)

    monkeypatch.setattr(DeltaTopicSink, "commit_files", dies_after_one)
    with pytest.raises(OSError, match="between two commits"):
        Delivery(spark, by_spark, layout(by_spark), clock).run_round()
    assert len(topics(by_spark)) == 30  # one of the two tables committed
    monkeypatch.setattr(DeltaTopicSink, "commit_files", commit)
    replay = Delivery(spark, by_spark, layout(by_spark), clock).run_round()
    assert replay.replayed and replay.where == "executors"
    assert_exactly_once_never_early(
        delivered_rows(spark, by_spark),
        [f"m{i}" for i in range(30) if i != 6] + ["xorders", "xaudit"],
    )


def test_a_mass_due_at_one_instant_is_written_ahead_and_shown_at_it_a_cancel_rewrites_it(
    spark: SparkSession, make_cfg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``delivery.mode = streaming``, 40 rows due at one instant 20 s ahead (over
    ``delivery.driver_round_rows = 30``) are written ahead by Spark tasks: the rounds before
    stop short of the instant, and the round at it shows them, 40 more written ahead as a
    second layer and a row stamped since (written by the driver), with
    its number ahead of the rounds between, never before the instant. A cancel sent while a
    second mass is written ahead drops that round; once the cancel is decided the mass is
    written ahead again, without the cancelled row; the driver dies between that round's two
    commits, and the restarted engine replays the rest of it once."""
    cfg: EngineConfig = make_cfg(delivery_mode="streaming", deliver_driver_rows=30)
    lay = layout(cfg)
    clock = FakeClock(datetime.now(UTC).replace(microsecond=0))
    ensure_tables(spark, cfg)
    stamper = Stamper(spark, cfg, lay, clock)
    delivery = Delivery(spark, cfg, lay, clock)
    sent: list[str] = []

    def mass(tag: str, at: datetime | None = None) -> datetime:
        at = at or clock.now() + timedelta(seconds=20)
        topics = ("orders", "audit")
        wave = [Message(topics[i % 2], tag, msg_id=f"{tag}{i}", deliver_at=at) for i in range(40)]
        wave.append(Message("orders", "s", msg_id=f"{tag}-soon", delay_level=1))
        sent.extend(send_many(spark, cfg, wave, clock))
        stamper.run_available()
        return at

    def rounds_until(when: datetime) -> list[RoundResult]:
        done = []
        while clock.now() < when:
            clock.advance(seconds=0.5)
            stamper.run_available()
            done.append(delivery.run_round())
        return done

    at = mass("m")
    first = delivery.run_round()  # (new rows: committed, then it looks ahead)
    mass("k", at)  # as many again at the same instant: written ahead as a second layer
    second = delivery.run_round()
    late = [Message("audit", "late", msg_id="late", deliver_at=at)]  # stamped since
    sent.extend(send_many(spark, cfg, late, clock))
    results = rounds_until(at + timedelta(seconds=1))
    [ahead] = [r for r in results if r.where == "ahead"]
    before = [first, second, *results[: results.index(ahead)]]
    assert ahead.delivered == 81 and ahead.per_topic == {"orders": 40, "audit": 41}
    assert ahead.watermark == at + timedelta(milliseconds=1)  # (statistics: ms, rounded up)
    assert all(r.watermark < at for r in before)
    assert ahead.round > max(r.round for r in before) + 100
    rows = delivered_rows(spark, cfg)
    shown = [r for r in rows if r["delivery_round"] == ahead.round]
    assert {r["delivered_ts"] for r in shown} == {ahead.watermark.replace(tzinfo=None)}

    at = mass("n")
    delivery.run_round()
    cancel(spark, cfg, "n3", wait=0, clock=clock)  # while the second mass is written ahead
    commit = DeltaTopicSink.commit_files

    def dies_at_the_instant(self: DeltaTopicSink, round_: int, table: str, *args: Any) -> None:
        if table == "orders" and round_ > ahead.round + 100:  # (the round written ahead)
            raise OSError("the driver died between two commits")
        commit(self, round_, table, *args)

    monkeypatch.setattr(DeltaTopicSink, "commit_files", dies_at_the_instant)
    with pytest.raises(OSError, match="between two commits"):
        rounds_until(at + timedelta(seconds=1))
    died = delivery.pending
    assert died is not None and died.watermark == at + timedelta(milliseconds=1)
    monkeypatch.setattr(DeltaTopicSink, "commit_files", commit)
    delivery = Delivery(spark, cfg, lay, clock)  # a restart: the plan is replayed
    replay = delivery.run_round()
    assert replay.replayed and replay.round == died.round
    assert replay.delivered == 39  # the round's rows ("n3" was cancelled), each table once
    sent.remove("n3")
    assert_exactly_once_never_early(delivered_rows(spark, cfg), sent)


def test_a_running_engine_stamps_and_delivers_through_named_queries_a_listener_hears(
    spark: SparkSession, make_cfg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both stages as streaming queries on the real clock: every message once and never
    early by the topic tables' Delta commit times (not the engine's own ``delivered_ts``).
    A listener hears each delivery batch's rows and lateness (observed metrics ``delayq``):
    the rows sum to the messages, the latest is the topic tables' latest; the progress line
    and the scraped metrics show them."""
    cfg: EngineConfig = make_cfg(
        stamp_mode="streaming", stamp_driver_bytes=0, delivery_mode="streaming"
    )
    heard = _Heard()
    spark.streams.addListener(heard)
    engine = Engine(spark, cfg, SystemClock(), out=lambda _line: None)
    try:
        engine.start()
        engine.wait_until_warm(timeout_s=120)
        names = [q.name for q in spark.streams.active]
        assert QUERY_NAME in names and DELIVER_QUERY in names
        ids = send_many(
            spark,
            cfg,
            [Message("t", f"m{i}", delay=f"{i * 10}ms") for i in range(150)]
            + [Message("u", f"l{i}", delay_level=1 + i % 3) for i in range(30)],
        )
        deadline = time.monotonic() + 90
        while len(delivered_rows(spark, cfg)) < len(ids) and time.monotonic() < deadline:
            engine.check_queries()
            time.sleep(0.3)
        deadline = time.monotonic() + 30  # (its input rows are the commitlog files read)
        while sum(n for name, n in heard.progress if name == QUERY_NAME) < 1:
            assert time.monotonic() < deadline, heard.progress[-5:]
            time.sleep(0.2)
        assert any(name == DELIVER_QUERY for name, _ in heard.progress)
        deadline = time.monotonic() + 30  # (the listener hears a batch after it ends)
        while sum(f["delivered_rows"] for f in heard.figures) < len(ids):
            assert time.monotonic() < deadline, heard.figures[-5:]
            time.sleep(0.2)
        line = engine.progress_line()
        # (no Kafka here: the ingest lag would wait 5 s for the default broker)
        monkeypatch.setattr(metrics_module, "_ingest_lag", lambda _cfg: {})
        server = MetricsServer(cfg, engine, spark.newSession()).start()
        try:
            got = scrape(server.url)
        finally:
            server.stop()
    finally:
        engine.stop()
        spark.streams.removeListener(heard)
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, ids, cfg)
    assert sum(f["delivered_rows"] for f in heard.figures) == len(ids)
    latest_ms = max((r["delivered_ts"] - r["deliver_ts"]) / timedelta(milliseconds=1) for r in rows)  # type: ignore[operator]
    assert max(f["lateness_max_ms"] for f in heard.figures) == pytest.approx(latest_ms, abs=0.01)
    assert all(0 <= f["lateness_p99_ms"] <= f["lateness_max_ms"] and
               f["lateness_avg_ms"] <= f["lateness_max_ms"] for f in heard.figures)  # fmt: skip
    newest = engine.deliver_query.figures()
    assert newest is not None and f"{DELIVER_QUERY} batch: " in line
    assert got[("delayq_delivery_batch_rows", ())] > 0
    assert got[("delayq_delivery_batch_lateness_seconds", (("stat", "max"),))] <= latest_ms / 1000
    assert got[("delayq_query_last_batch_id", (("query", DELIVER_QUERY),))] >= 1
    assert (("query", QUERY_NAME),) in {
        labels for (name, labels) in got if name == "delayq_query_last_batch_seconds"
    }
    active = [q.name for q in spark.streams.active]
    assert QUERY_NAME not in active and DELIVER_QUERY not in active


def _batches(engine: Engine) -> int:
    """Batches the delivery query has planned (entries of its offsets log)."""
    offsets = Path(engine.deliver_query.checkpoint.removeprefix("file:")) / "offsets"
    return sum(1 for p in offsets.iterdir() if p.name.isdigit())


def test_an_idle_delivery_query_holds_its_watermark_and_a_message_sent_meanwhile_is_on_time(
    spark: SparkSession, make_cfg: Any
) -> None:
    """Nothing can fall due: the query runs no batch for up to ``delivery.idle_interval``
    (30 s here). Messages stamped while it holds end the hold (a new ``schedule`` version)
    and are delivered once, never early, and within 2 s of their time (a hold that missed
    them would keep them until the interval ends)."""
    cfg: EngineConfig = make_cfg(
        stamp_mode="streaming", delivery_mode="streaming", idle_interval_ms=30_000
    )
    engine = Engine(spark, cfg, SystemClock(), out=lambda _line: None)
    try:
        engine.start()
        engine.wait_until_warm(timeout_s=120)
        time.sleep(0.5)  # (the first batches: no record yet, no hold)
        before = _batches(engine)
        time.sleep(2.5)  # 12 triggers of 200 ms
        assert _batches(engine) - before <= 1
        now = datetime.now(UTC)
        ids = send_many(
            spark,
            cfg,
            [Message("t", f"a{i}", deliver_at=now + timedelta(seconds=2)) for i in range(5)]
            + [Message("t", f"l{i}", delay_level=1) for i in range(5)],
        )
        deadline = time.monotonic() + 60
        while len(delivered_rows(spark, cfg)) < len(ids) and time.monotonic() < deadline:
            engine.check_queries()
            time.sleep(0.3)
    finally:
        engine.stop()
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, ids, cfg)
    late = [r["delivered_ts"] - r["deliver_ts"] for r in rows]  # type: ignore[operator]
    assert max(late) < timedelta(seconds=2), late


def test_a_hold_ends_with_a_new_schedule_or_commands_version_or_when_a_row_falls_due(
    spark: SparkSession, make_cfg: Any, tmp_path: Path
) -> None:
    """The record a round leaves, read as the clock source reads it: it holds while the
    planned watermark is before the next row's time and no table has moved; a stamped
    message (a ``schedule`` version) or a cancel (a ``commands`` version) ends it."""
    cfg: EngineConfig = make_cfg()
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    clock = FakeClock(t0)
    engine = Engine(spark, cfg, clock, out=lambda _line: None)
    later = send_many(spark, cfg, [Message("t", f"a{i}", delay_level=3) for i in range(3)], clock)
    engine.step()
    quiet = engine.delivery.quiet(t0)
    assert quiet is not None and quiet.due_us == to_micros(t0 + timedelta(seconds=3))
    lay = layout(cfg)
    record = str(tmp_path / "quiet.json")
    save_quiet(record, quiet)
    start = to_millis(t0)
    reader = ClockReader(
        {"start": str(start), "lead": "0", "quiet": record, "idle": "10000",
         "schedule": lay.schedule, "commands": lay.commands}
    )  # fmt: skip

    def held(planned_ms: int) -> bool:
        offset = next_offset(
            load_quiet(record), start, planned_ms, planned_ms, 10_000, reader._newer
        )
        return offset == start

    assert held(start + 2_999)
    assert not held(start + 3_000)  # (the rows fall due)
    send_many(spark, cfg, [Message("t", "b", delay_level=1)], clock)
    assert held(start + 2_999)  # (in commitlog only: not due before it is stamped)
    engine.stamp_available()
    assert not held(start + 500)
    engine.step()
    quiet = engine.delivery.quiet(t0)
    assert quiet is not None and quiet.due_us == to_micros(t0 + timedelta(seconds=1))
    save_quiet(record, quiet)
    assert held(start + 999)
    assert cancel(spark, cfg, later[0], wait=0, clock=clock).status == "pending"
    assert not held(start + 500)


def test_an_idle_stamping_look_waits_for_the_next_commit_and_ends_as_soon_as_one_lands(
    spark: SparkSession, make_cfg: Any
) -> None:
    """The ``commitlog`` source as Spark asks it at each trigger: once a look found nothing,
    the next waits (``stamp.idle_wait``) instead of letting Spark trigger again every 50 ms,
    and returns the new end as soon as a message is sent, not at the end of the wait."""
    cfg: EngineConfig = make_cfg()
    ensure_tables(spark, cfg)
    options = {
        "path": layout(cfg).commitlog,
        "start": "{}",
        "max_files": "1000",
        "max_bytes": str(1 << 24),
        "idle_wait_ms": "20000",
        "idle_poll_ms": "10",
    }
    reader = CommitlogReader(options, None)
    start = reader.latestOffset({"version": 0, "index": 0}, ReadAllAvailable())  # found nothing
    _send(spark, cfg, "a")
    # A message was sent since: no wait, the batch takes it.
    sent = reader.latestOffset(start, ReadAllAvailable())
    assert sent["version"] > start["version"]
    reader.latestOffset(sent, ReadAllAvailable())  # nothing more: the next look waits

    timer = threading.Timer(0.5, lambda: _send(spark, cfg, "b"))
    timer.start()
    began = time.monotonic()
    ended = reader.latestOffset(sent, ReadAllAvailable())
    waited = time.monotonic() - began
    timer.join()
    assert ended["version"] > sent["version"]
    assert 0.4 < waited < 15  # it waited for the send, and not its whole 20 s

    quick = CommitlogReader({**options, "idle_wait_ms": "0"}, None)
    began = time.monotonic()
    assert quick.latestOffset(ended, ReadAllAvailable()) == ended
    assert quick.latestOffset(ended, ReadAllAvailable()) == ended  # "off": never waits
    assert time.monotonic() - began < 5


def test_a_delivery_batch_replayed_below_the_progress_never_takes_the_window_back(
    spark: SparkSession, make_cfg: Any
) -> None:
    """Spark's commit of a delivery batch lost after its round committed: the batch runs
    again with its older watermark. The round must not move progress back (the rows between
    would be delivered again); rows stamped since, and due by then, still go out once."""
    cfg: EngineConfig = make_cfg()
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    clock = FakeClock(t0)
    engine = Engine(spark, cfg, clock, out=lambda _line: None)
    due = [Message("t", f"a{i}", delay_level=1 + i % 3) for i in range(9)]
    first = send_many(spark, cfg, due, clock)
    clock.advance(5)
    engine.step()
    ahead = engine.delivery.progress.watermark
    assert ahead == t0 + timedelta(seconds=5)
    overdue = [Message("t", f"b{i}", deliver_at=t0 + timedelta(seconds=1)) for i in range(3)]
    late = send_many(spark, cfg, overdue, clock)
    engine.stamp_available()
    replayed = engine.delivery.run_round(until=t0 + timedelta(seconds=2))  # the old batch
    assert replayed.delivered == 3
    assert engine.delivery.progress.watermark == ahead  # not back to the batch's
    engine.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), first + late)


def test_the_stages_checkpoint_entries_are_created_put_if_absent(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The stages' queries write Spark's offsets and commit entries through
    ``delayq.fs.LinkCheckpointFileManager``: a second writer of an entry is refused and the
    first one's bytes stay (Spark's default renames; Hadoop's FileSystem-based one may replace)."""
    assert link_checkpoints(spark)
    assert spark.conf.get(CHECKPOINT_MANAGER_KEY) == LINK_CHECKPOINT_MANAGER
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()  # type: ignore[union-attr]
    folder = jvm.org.apache.hadoop.fs.Path(f"file://{tmp_path}/offsets")
    manager = jvm.delayq.fs.LinkCheckpointFileManager(folder, hadoop)
    entry = jvm.org.apache.hadoop.fs.Path(f"file://{tmp_path}/offsets/7")
    first = manager.createAtomic(entry, False)
    second = manager.createAtomic(entry, False)  # both open at once: a race
    first.write(b"first")
    second.write(b"second")
    first.close()
    with pytest.raises(Exception, match="FileAlreadyExistsException"):
        second.close()
    assert (tmp_path / "offsets" / "7").read_bytes() == b"first"
    assert [p.name for p in (tmp_path / "offsets").iterdir()] == ["7"]  # no temporary left
