"""Recurring schedules managed in SQL: rows inserted into ``schedule_requests`` are applied
once each, in order, by the running engine; refusals say why."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from engine.core.clock import FakeClock
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.storage.layout import layout
from engine.recur.defs import create_schedule, list_schedules, pause_schedule, read_revisions
from engine.recur.requests import ScheduleRequests
from tests.support.lakehouse import delivered_rows, quiet_engine

pytestmark = pytest.mark.integration


def test_schedules_created_changed_and_refused_from_sql(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> None:
    cfg = make_cfg(register_tables=True)  # type: ignore[operator]
    start = clock.now().replace(microsecond=0)
    clock.set(start)
    engine = quiet_engine(spark, cfg, clock)  # (makes and names the table)
    db = cfg.database
    spark.sql(
        f"INSERT INTO {db}.schedule_requests (name, action, topic, body, every, cron, time_zone) "
        "VALUES ('tick', 'create', 'ticks', 'tick', '2s', NULL, NULL), "
        "('nightly', 'create', 'reports', 'run', NULL, '30 2 * * *', 'Europe/Berln'), "
        "('tick', 'create', 'ticks', 'again', '5s', NULL, NULL)"
    )
    spark.sql(
        f"INSERT INTO {db}.schedule_requests (name, action, body, cron, time_zone) "
        "VALUES ('tick', 'update', 'tock', NULL, NULL), "
        "('nightly', 'create', NULL, '30 2 * * *', 'Europe/Berlin'), "
        "('gone', 'pause', NULL, NULL, NULL), ('tick', 'stop', NULL, NULL, NULL)"
    )
    for _ in range(9):  # 4 s: tick fires
        engine.step()
        clock.advance(seconds=0.5)
    spark.sql(
        f"INSERT INTO {db}.schedule_requests (name, action, topic, body, every, catch_up_window) "
        "VALUES ('huge', 'create', 't', 'b', '1m', '99999999999d')"
    )
    # (not an append: its rows are not taken as requests, and the ones after still are)
    spark.sql(
        f"INSERT OVERWRITE {db}.schedule_requests (name, action, topic, body, every) "
        "VALUES ('over', 'create', 't', 'b', '1m')"
    )
    spark.sql(f"INSERT INTO {db}.schedule_requests (name, action) VALUES ('tick', 'pause')")
    engine.step()
    results = spark.sql(
        f"SELECT request_version, request_row, name, action, result, revision, detail "
        f"FROM {db}.schedule_request_results ORDER BY request_version, request_row"
    ).collect()
    assert [(r.name, r.action, r.result, r.revision) for r in results] == [
        ("tick", "create", "applied", 1),
        ("nightly", "create", "refused", None),
        ("tick", "create", "refused", None),
        ("tick", "update", "applied", 2),
        ("nightly", "create", "refused", None),
        ("gone", "pause", "refused", None),
        ("tick", "stop", "refused", None),
        ("huge", "create", "refused", None),
        (None, None, "ignored", None),
        ("tick", "pause", "applied", 3),
    ]
    details = [r.detail for r in results]
    assert "Europe/Berln" in details[1] and "IANA" in details[1]
    assert "exists" in details[2]
    assert "topic" in details[4], "a create needs its topic"
    assert "no such schedule" in details[5]
    assert "create, update, pause, resume, delete" in details[6]
    assert "catch_up_window" in details[7] and "366d" in details[7]
    assert "append-only" in details[8]
    assert [(s.name, s.revision, s.state) for s in list_schedules(cfg)] == [("tick", 3, "paused")]
    ticks = [r for r in delivered_rows(spark, cfg) if r["topic"] == "ticks"]
    assert ticks, "the schedule made in SQL fires"
    assert all(r["delivered_ts"] >= r["deliver_ts"] for r in ticks)


def test_requests_decided_once_across_a_restart_between_their_commit_and_their_outcome(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> None:
    cfg = make_cfg(register_tables=True)  # type: ignore[operator]
    quiet_engine(spark, cfg, clock)
    spark.sql(
        f"INSERT INTO {cfg.database}.schedule_requests (name, action, topic, body, every) "
        "VALUES ('a', 'create', 't', 'x', '1m'), ('b', 'create', 't', 'y', '1h')"
    )
    assert ScheduleRequests(cfg, clock).apply() == 2
    # the engine died after the revisions' commit, before the outcome was marked applied
    outcomes = Path(layout(cfg).checkpoint("schedule-requests"))
    applied = sorted(p for p in outcomes.glob("*.json") if not p.name.endswith(".plan.json"))
    applied[-1].unlink()
    clock.advance(seconds=300)
    assert ScheduleRequests(cfg, clock).apply() == 2  # the same decision, nothing twice
    revisions = read_revisions(ArrowDelta(layout(cfg).recurring))
    assert {n: [r.revision for r in revs] for n, revs in revisions.items()} == {
        "a": [1], "b": [1],
    }  # fmt: skip
    assert ScheduleRequests(cfg, clock).apply() == 0


def test_a_decision_not_appended_before_a_restart_is_made_again_when_the_schedule_changed(
    spark: SparkSession, make_cfg: object, clock: FakeClock
) -> None:
    cfg = make_cfg(register_tables=True)  # type: ignore[operator]
    quiet_engine(spark, cfg, clock)
    create_schedule(cfg, "a", "t", "old", every="1m", clock=clock)
    spark.sql(
        f"INSERT INTO {cfg.database}.schedule_requests (name, action, body) "
        "VALUES ('a', 'update', 'new')"
    )
    version = ArrowDelta(layout(cfg).schedule_requests).latest()
    ScheduleRequests(cfg, clock)._decide(version)  # revision 2, then the engine died
    clock.advance(seconds=60)
    pause_schedule(cfg, "a", clock=clock)  # revision 2 too, from the command line
    assert ScheduleRequests(cfg, clock).apply() == 1
    revisions = read_revisions(ArrowDelta(layout(cfg).recurring))["a"]
    assert [(r.revision, r.action, r.state, r.body) for r in revisions] == [
        (1, "create", "active", b"old"),
        (2, "pause", "paused", b"old"),
        (3, "update", "paused", b"new"),
    ]
