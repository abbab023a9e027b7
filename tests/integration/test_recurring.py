"""Recurring schedules fired by an engine: each occurrence once in its topic, never before its
time, across a pause, a resume, an update and a restart."""

from __future__ import annotations

from datetime import UTC, timedelta

import pytest
from pyspark.sql import SparkSession

from engine.core.clock import FakeClock, to_millis
from engine.core.config import EngineConfig
from engine.lakehouse.catalog.names import register_all
from engine.lakehouse.storage.layout import layout
from engine.recur.defs import create_schedule, pause_schedule, resume_schedule, update_schedule
from engine.run.engine import Engine
from engine.run.metrics import EngineCollector
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows

pytestmark = pytest.mark.integration


def test_each_occurrence_arrives_once_at_its_time_across_pause_update_and_restart(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    """Every 2 s, and once at 5 s. A pause at 6 s lets what was sent (up to 16 s) arrive as
    sent; a resume with a new body at 11 s fires from 16 s (its pause plus the 10 s sent
    ahead), so nothing is sent twice; a restart goes on from the last batch. Each
    occurrence arrives once, at its time, in the body it was sent with."""
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

    def at(seconds: int) -> str:
        return tick.message_id(start + timedelta(seconds=seconds))

    run_for(6, engine)  # 2, 4, 6 s and "once" at 5 s
    shown = {r["msg_id"]: r for r in delivered_rows(spark, cfg)}
    once = f"once:{to_millis(start) + 5000}"
    assert sorted(shown) == sorted([at(2), at(4), at(6), once])
    due = sorted(r["deliver_ts"].astimezone(UTC) - start for r in shown.values())
    assert due == [timedelta(seconds=s) for s in (2, 4, 5, 6)]  # at the occurrences

    register_all(spark, cfg)  # (a session's start does it)
    view = f"{cfg.database}.schedules"
    shown_sql = spark.sql(f"SELECT * FROM {view} ORDER BY name").collect()
    states = [(r.name, r.revision, r.state) for r in shown_sql]
    assert states == [("once", 1, "active"), ("tick", 1, "active")]
    assert shown_sql[0].next_fire_ts is None  # its one time has come
    # the next not sent yet: 8-16 s are sent (10 s ahead)
    assert shown_sql[1].next_fire_ts.astimezone(UTC) == start + timedelta(seconds=18)

    pause_schedule(cfg, "tick", clock=clock)  # at 6 s: 8 to 16 s were sent ahead
    run_for(5, engine)  # to 11 s
    assert len(delivered_rows(spark, cfg)) == 6  # 8 and 10 s, as sent
    resume_schedule(cfg, "tick", clock=clock)  # at 11 s, as revision 3
    update_schedule(cfg, "tick", body="tock", clock=clock)  # revision 4: after 16 s
    run_for(3, engine)  # to 14 s
    engine.stop()

    # a new engine (a restart) goes on from the last batch's horizon: nothing twice
    restarted = Engine(spark, cfg, clock, out=lambda _: None).open()
    run_for(5, restarted)  # to 19 s
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, [once, *(at(s) for s in range(2, 19, 2))])
    bodies = {r["msg_id"]: r["body"] for r in rows}
    assert [bodies[at(s)] for s in (10, 12, 14, 16, 18)] == [b"tick"] * 4 + [b"tock"]
    quarantine = spark.read.format("delta").load(layout(cfg).quarantine).collect()
    assert not [r.msg_id for r in quarantine], "an occurrence sent twice"
    assert restarted.recurring.skipped == 0
    families = EngineCollector(restarted).collect()
    scraped = {m.name: m.samples[0].value for m in families if m.samples}
    assert scraped["delayq_recurring_sent"] == restarted.recurring.sent >= 1
    assert scraped["delayq_recurring_skipped"] == 0
