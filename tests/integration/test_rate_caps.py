"""Delivery rate caps on real Spark + Delta, with levels ``1s 2s 3s`` and a fake clock."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

import pytest
from pyspark.sql import SparkSession

from engine.control.commands import cancel
from engine.control.inspect import forecast, pending
from engine.control.maintain import prune_schedule
from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.deliver.checkpoint import read_checkpoint
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from tests.support.crash import Crash, crash_after_writes
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows, quiet_engine

pytestmark = pytest.mark.integration


def burst(n: int, topic: str = "orders") -> list[Message]:
    return [Message(topic, f"{topic}-{i}", delay_level=1) for i in range(n)]


def test_a_burst_over_its_cap_drains_at_the_cap_in_order_while_other_topics_stay_on_time(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> None:
    cfg: EngineConfig = make_cfg(topic_rates={"orders": 10.0})  # type: ignore[operator]
    orders = send_many(spark, cfg, burst(30), clock)
    audit = send_many(spark, cfg, burst(4, "audit"), clock)
    engine = quiet_engine(spark, cfg, clock)
    steps = []
    for _ in range(8):  # to 4 s after the instant, in 0.5 s rounds
        clock.advance(seconds=0.5)
        engine.step()
        steps.append(clock.now().replace(tzinfo=None))
    rows = delivered_rows(spark, cfg)
    # what each step had shown (a row shows when its round commits, at its delivered_ts)
    seen = [Counter(str(r["topic"]) for r in rows if r["delivered_ts"] <= t) for t in steps]
    assert_exactly_once_never_early(rows, orders + audit)
    # the other topic: all of it in the first round at its time
    assert seen[1]["audit"] == 4
    # orders: 10 a second from the instant (the first row at it), in deliver order
    assert [c["orders"] for c in seen] == [0, 1, 6, 11, 16, 21, 26, 30]
    by_time = sorted((r for r in rows if r["topic"] == "orders"), key=lambda r: r["delivered_ts"])
    assert [r["msg_id"] for r in by_time] == sorted(r["msg_id"] for r in by_time)
    assert max(r["delivered_ts"] - r["deliver_ts"] for r in by_time) == timedelta(seconds=3)
    assert len({r["deliver_ts"] for r in by_time}) == 1, "all due at one instant"
    progress, _ = read_checkpoint(spark, layout(cfg))
    assert progress.rates["orders"].cursor is None, "nothing waits any more"
    assert engine.status().idle


def test_rows_waiting_for_a_cap_survive_a_crash_and_a_changed_cap_exactly_once(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> None:
    cfg: EngineConfig = make_cfg(topic_rates={"orders": 4.0})  # type: ignore[operator]
    ids = send_many(spark, cfg, burst(20), clock)
    engine = quiet_engine(spark, cfg, clock)
    clock.advance(seconds=2)
    engine.step()  # 1 s after the instant: 5 go, 15 wait
    assert len(delivered_rows(spark, cfg)) == 5
    crashing = quiet_engine(spark, cfg, clock, sinks=crash_after_writes())
    clock.advance(seconds=1)
    with pytest.raises(Crash):
        crashing.step()  # its topic write landed, its progress did not
    written = {r["msg_id"] for r in delivered_rows(spark, cfg)}
    assert len(written) == 9
    # restarted with the cap lifted: the crashed round replays as planned (its cap), then
    # every row still waiting goes at once
    uncapped = make_cfg(lakehouse=cfg.lakehouse, database=cfg.database)  # type: ignore[operator]
    restarted = quiet_engine(spark, uncapped, clock)
    assert {r["msg_id"] for r in delivered_rows(spark, uncapped)} == written
    clock.advance(seconds=0.5)
    restarted.step()
    assert_exactly_once_never_early(delivered_rows(spark, uncapped), ids)


def test_messages_waiting_for_their_cap_show_as_pending_forecast_at_the_cap_and_cancellable(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> None:
    cfg: EngineConfig = make_cfg(topic_rates={"orders": 1 / 60}, register_tables=True)  # type: ignore[operator]
    ids = send_many(spark, cfg, burst(5), clock)
    engine = quiet_engine(spark, cfg, clock)
    clock.advance(seconds=1.5)
    engine.step()  # due 0.5 s ago at one a minute: one goes, four wait
    behind = sorted(ids)[1:]
    assert sorted(r["msg_id"] for r in pending(spark, cfg).collect()) == behind
    in_sql = spark.sql(f"SELECT msg_id FROM {cfg.database}.pending").collect()
    assert sorted(r["msg_id"] for r in in_sql) == behind
    status = engine.status()
    assert status.capped["orders"][:2] == (4, 1 / 60) and not status.idle
    assert "orders: 4 waiting for its cap of 1/m, clear at" in status.line(str)
    # at the cap: one a minute from the minute after the first went
    minutes = [r["due"] for r in forecast(spark, cfg, clock.now(), minutes=10).collect()]
    assert minutes == [1, 1, 1, 1]
    waiting = behind[-1]
    cancel(spark, cfg, waiting, wait=0, clock=clock)
    for _ in range(5):
        clock.advance(seconds=60)
        engine.step()
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, sorted(ids)[:-1])
    outcome = spark.read.format("delta").load(layout(cfg).command_results).collect()
    assert [(r["msg_id"], r["result"]) for r in outcome] == [(waiting, "cancelled")]


def test_a_round_planned_ahead_that_shows_nothing_keeps_no_row_above_its_watermark(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> None:
    """At one a second: the first message goes at its time; two more, due 0.2 and 0.3 s
    later, are read by a round planned 0.5 s ahead that may show neither (the cap's next
    slot is 1 s after the first), so it commits up to the clock only. The rounds after read
    them again and show each once, a second apart."""
    cfg: EngineConfig = make_cfg(topic_rates={"orders": 1.0})  # type: ignore[operator]
    start = clock.now().replace(microsecond=0) + timedelta(seconds=1)
    first = send_many(spark, cfg, [Message("orders", "a", deliver_at=start)], clock)
    later = send_many(
        spark, cfg,
        [Message("orders", b, deliver_at=start + timedelta(milliseconds=ms))
         for b, ms in (("b", 200), ("c", 300))],
        clock,
    )  # fmt: skip
    engine = quiet_engine(spark, cfg, clock)
    engine.stamp_available()
    clock.set(start)
    assert engine.delivery.run_round().delivered == 1
    # (a message stamped since, due much later: the next round has something to commit)
    send_many(spark, cfg, [Message("audit", "later", delay="1h")], clock)
    engine.stamp_available()
    clock.set(start + timedelta(milliseconds=100))
    ahead = engine.delivery.run_round(lead_ms=500)
    assert (ahead.delivered, ahead.committed) == (0, True)
    assert ahead.watermark == start + timedelta(milliseconds=100), "cut back to the clock"
    for seconds in (1.1, 2.1, 3.1):
        clock.set(start + timedelta(seconds=seconds))
        engine.delivery.run_round()
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early([r for r in rows if r["topic"] == "orders"], first + later)
    shown = sorted(r["delivered_ts"] - r["deliver_ts"] for r in rows)
    assert shown == [timedelta(0), timedelta(milliseconds=900), timedelta(milliseconds=1800)]


def test_maintenance_never_prunes_rows_waiting_for_a_cap(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> None:
    cfg: EngineConfig = make_cfg(  # type: ignore[operator]
        topic_rates={"orders": 1 / 3600}, prune_after_ms=3_600_000, dedup_window_ms=0
    )
    early = send_many(spark, cfg, burst(1, "audit"), clock)
    engine = quiet_engine(spark, cfg, clock)
    clock.advance(seconds=10)
    ids = send_many(spark, cfg, burst(3), clock)
    clock.advance(seconds=1.5)
    engine.step()  # the audit message, and one of the three; two wait an hour each
    clock.advance(seconds=3600)
    engine.step()  # the second
    said = prune_schedule(spark, cfg, clock.now() + timedelta(hours=2))
    assert said.startswith("schedule: pruned 1 rows"), said
    left = spark.read.format("delta").load(layout(cfg).schedule).collect()
    assert sorted(r["msg_id"] for r in left) == sorted(ids), "the waiting one stays"
    clock.advance(seconds=3600)
    engine.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), early + ids)


def _mass(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> tuple[EngineConfig, datetime, list[str]]:
    """40 messages due at one instant 10 s from now into a topic capped at 10 a second, on
    an engine that reads a mass of more than 10 rows ahead."""
    cfg: EngineConfig = make_cfg(  # type: ignore[operator]
        topic_rates={"orders": 10.0}, deliver_driver_rows=10
    )
    instant = clock.now().replace(microsecond=0) + timedelta(seconds=10)
    ids = send_many(
        spark, cfg, [Message("orders", f"{i}", deliver_at=instant) for i in range(40)], clock
    )
    return cfg, instant, ids


def test_a_capped_mass_read_ahead_is_taken_without_reading_its_files_again(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> None:
    cfg, instant, ids = _mass(spark, make_cfg, clock)
    engine = quiet_engine(spark, cfg, clock)
    engine.step()  # stamps them; the round after looks ahead: 40 due in 10 s, more than 10
    read = engine.delivery._read
    assert read is not None and read.job.result()[0]["orders"].size == 40
    clock.set(instant + timedelta(milliseconds=500))
    at = engine.step()
    assert (at.delivered, at.files_read) == (6, 0), "taken from what was read ahead"
    for _ in range(8):
        clock.advance(seconds=0.5)
        engine.step()
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, ids)
    per_round = Counter(r["delivery_round"] for r in rows)
    assert sorted(per_round.values(), reverse=True)[:2] == [6, 5]


def test_a_round_taking_rows_read_ahead_killed_after_its_writes_is_replayed_from_storage(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> None:
    cfg, instant, ids = _mass(spark, make_cfg, clock)
    crashing = quiet_engine(spark, cfg, clock, sinks=crash_after_writes())
    crashing.step()
    assert crashing.delivery._read is not None
    clock.set(instant + timedelta(milliseconds=500))
    with pytest.raises(Crash):
        crashing.step()
    written = {r["msg_id"] for r in delivered_rows(spark, cfg)}
    assert len(written) == 6
    restarted = quiet_engine(spark, cfg, clock)  # replays the round, reading schedule
    assert {r["msg_id"] for r in delivered_rows(spark, cfg)} == written
    for _ in range(8):
        clock.advance(seconds=0.5)
        restarted.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)
