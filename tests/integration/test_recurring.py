"""Recurring schedules fired by an engine: each occurrence once in its topic, never before its
time, across a pause, an update and a restart."""

from __future__ import annotations

from datetime import UTC, timedelta

import pytest
from pyspark.sql import SparkSession

from engine.core.clock import FakeClock, to_millis
from engine.core.config import EngineConfig
from engine.lakehouse.catalog.names import register_all
from engine.recur.defs import create_schedule, pause_schedule, resume_schedule, update_schedule
from engine.run.engine import Engine
from engine.run.metrics import EngineCollector
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows

pytestmark = pytest.mark.integration


def test_each_occurrence_arrives_once_at_its_time_across_pause_update_and_restart(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    start = clock.now().replace(microsecond=0)
    clock.set(start)
    tick = create_schedule(cfg, "tick", "ticks", "tick", every="2s", clock=clock)
    create_schedule(cfg, "once", "ticks", "once", at=[start + timedelta(seconds=5)], clock=clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()

    def run_for(seconds: float, e: Engine) -> None:
        for _ in range(int(seconds * 2)):
            e.step()
            clock.advance(seconds=0.5)
        e.step()

    run_for(6, engine)  # 2, 4, 6 s and "once" at 5 s
    shown = {r["msg_id"]: r for r in delivered_rows(spark, cfg)}
    ids = [tick.message_id(start + timedelta(seconds=s)) for s in (2, 4, 6)]
    assert sorted(shown) == sorted([*ids, f"once:r1:{to_millis(start) + 5000}"])
    due = sorted(r["deliver_ts"].astimezone(UTC) - start for r in shown.values())
    assert due == [timedelta(seconds=s) for s in (2, 4, 5, 6)]  # at the occurrences

    register_all(spark, cfg)  # (a session's start does it)
    view = f"{cfg.database}.schedules"
    shown_sql = spark.sql(f"SELECT * FROM {view} ORDER BY name").collect()
    states = [(r.name, r.revision, r.state) for r in shown_sql]
    assert states == [("once", 1, "active"), ("tick", 1, "active")]
    assert shown_sql[0].next_fire_ts is None  # its one time has come
    assert shown_sql[1].next_fire_ts.astimezone(UTC) == start + timedelta(seconds=8)

    pause_schedule(cfg, "tick", clock=clock)  # at 6 s: 8 to 16 s were sent ahead
    run_for(5, engine)
    assert len(delivered_rows(spark, cfg)) == 4, "a paused schedule fires nothing"
    resume_schedule(cfg, "tick", clock=clock)  # at 11 s, as revision 3
    moved = update_schedule(cfg, "tick", body="tock", clock=clock)  # revision 4, from 11 s
    run_for(3, engine)  # to 14 s
    engine.stop()

    # a new engine (a restart) goes on from the last batch's horizon: nothing twice
    restarted = Engine(spark, cfg, clock, out=lambda _: None).open()
    run_for(3, restarted)  # to 17 s
    rows = delivered_rows(spark, cfg)
    after = [moved.message_id(start + timedelta(seconds=s)) for s in (12, 14, 16)]
    expected = [*ids, f"once:r1:{to_millis(start) + 5000}", *after]
    assert_exactly_once_never_early(rows, expected)
    bodies = {r["msg_id"]: r["body"] for r in rows}
    assert {bodies[i] for i in after} == {b"tock"}
    assert restarted.recurring.skipped == 0
    families = EngineCollector(restarted).collect()
    scraped = {m.name: m.samples[0].value for m in families if m.samples}
    assert scraped["delayq_recurring_sent"] == restarted.recurring.sent >= 1
    assert scraped["delayq_recurring_skipped"] == 0
