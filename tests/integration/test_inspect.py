"""What is pending, what comes due per minute, and a message's history."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pyspark.sql import SparkSession

from engine.control.inspect import forecast, history, pending
from engine.core.clock import FakeClock
from engine.core.errors import DelayQError
from engine.lakehouse.catalog.names import register_all
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from engine.run.engine import Engine

pytestmark = pytest.mark.integration


def test_pending_forecast_and_history(spark: SparkSession, make_cfg: Any, clock: FakeClock) -> None:
    cfg = make_cfg(levels="1s 2s 3s", register_tables=True)
    t0 = clock.now()
    ids = send_many(
        spark,
        cfg,
        [
            Message("orders", "now", keys=["k-now"]),
            Message("orders", "in 90 s", keys=["k-later"], delay="90s"),
            Message("orders", "in 150 s", keys=["k-later"], delay="150s"),
            Message("audit", "in 2 h", keys=["k-far"], deliver_at=t0 + timedelta(hours=2)),
        ],
        clock,
    )
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    engine.step()

    waiting = pending(spark, cfg)
    assert sorted(r["msg_id"] for r in waiting.collect()) == sorted(ids[1:])
    assert waiting.where("topic = 'orders'").count() == 2
    assert waiting.where("array_contains(keys, 'k-later')").count() == 2

    due = [(r["minute"], r["due"]) for r in forecast(spark, cfg, t0, minutes=60).collect()]
    minute = t0.replace(second=0, microsecond=0, tzinfo=None)
    assert due == [(minute + timedelta(minutes=1), 1), (minute + timedelta(minutes=2), 1)]

    # the same, in SQL (the views read the committed checkpoint)
    in_sql = spark.sql(f"SELECT msg_id FROM {cfg.database}.pending").collect()
    assert sorted(r["msg_id"] for r in in_sql) == sorted(ids[1:])
    # due_forecast is forecast() at SQL's own clock, current_timestamp(): the real time, months
    # after the fake clock's t0. By then all three pending messages are overdue, the one due
    # 2 h after t0 too, so they count in the current minute (overdue ones count at "now").
    before = datetime.now(UTC).replace(second=0, microsecond=0, tzinfo=None)
    in_view = spark.sql(f"SELECT minute, due FROM {cfg.database}.due_forecast").collect()
    after = datetime.now(UTC).replace(second=0, microsecond=0, tzinfo=None)
    view = [(r["minute"], r["due"]) for r in in_view]
    assert len(view) == 1 and before <= view[0][0] <= after, (view, before, after)
    assert view[0][1] == 3
    at_view = view[0][0].replace(tzinfo=UTC)
    assert view == [(r["minute"], r["due"]) for r in forecast(spark, cfg, at_view).collect()]

    events = [(r["event"], r["detail"]) for r in history(spark, cfg, msg_id=ids[0]).collect()]
    assert [e for e, _ in events] == ["sent", "stamped", "delivered"]
    assert events[0][1] == "not delayed"
    assert events[2][1] == f"{cfg.database}.orders, round 0"
    later = history(spark, cfg, key="k-later").collect()
    assert {r["event"] for r in later} == {"sent", "stamped"}
    assert {r["detail"] for r in later if r["event"] == "sent"} == {
        f"deliver at {(t0 + timedelta(seconds=s)).replace(tzinfo=None)}" for s in (90, 150)
    }
    with pytest.raises(DelayQError, match="id or a key"):
        history(spark, cfg)


def test_history_shows_quarantine_reason(
    spark: SparkSession, make_cfg: Any, clock: FakeClock
) -> None:
    cfg = make_cfg()
    Engine(spark, cfg, clock, out=lambda _: None).open()
    spark.sql(
        f"INSERT INTO delta.`{layout(cfg).commitlog}` VALUES ('BAD1', 'bad-topic', array('kq'),"
        " NULL, map(), X'01', 1, NULL, TIMESTAMP'2026-01-01 12:00:00', NULL)"
    )
    Engine(spark, cfg, clock, out=lambda _: None).step()
    rows = [(r["event"], r["detail"]) for r in history(spark, cfg, key="kq").collect()]
    assert rows == [
        ("sent", "delay level 1"),
        ("quarantined", "topic 'bad-topic' is not a valid topic name"),
    ]
    register_all(spark, cfg)
    view = spark.sql(f"SELECT event, detail FROM {cfg.database}.history ORDER BY at, event DESC")
    assert [(r["event"], r["detail"]) for r in view.collect()] == rows
