"""Timer messages (an absolute deliver time or a relative delay) on the same exactly-once path."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.core.errors import InvalidMessageError
from engine.produce.send import Message, send_df, send_many
from engine.run.engine import Engine
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows

pytestmark = pytest.mark.integration


def test_levels_and_times_mixed_in_one_run(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    t0 = clock.now()
    messages = [
        Message("orders", "level 2", delay_level=2),
        Message("orders", "in 1.5 s", delay="1500ms"),
        Message("audit", "at t0 + 2.25 s", deliver_at=t0 + timedelta(milliseconds=2250)),
        Message("audit", "an hour ago", deliver_at=t0 - timedelta(hours=1)),
        Message(
            "orders", "epoch ms", deliver_at=int((t0 + timedelta(seconds=1)).timestamp() * 1000)
        ),
        Message("orders", "now"),
    ]
    ids = send_many(spark, cfg, messages, clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    engine.step()
    first = {r["body"].decode() for r in delivered_rows(spark, cfg)}  # type: ignore[union-attr]
    assert first == {"an hour ago", "now"}, "past and immediate messages go at once"
    for _ in range(6):
        clock.advance(seconds=0.5)
        engine.step()
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, ids)
    by_body = {r["body"].decode(): r for r in rows}  # type: ignore[union-attr]
    at = by_body["at t0 + 2.25 s"]
    assert at["queue_id"] == -1
    assert at["deliver_ts"] - at["store_ts"] == timedelta(milliseconds=2250), "no rounding"
    assert by_body["in 1.5 s"]["deliver_ts"] - by_body["in 1.5 s"]["store_ts"] == timedelta(
        milliseconds=1500
    )
    assert engine.status().idle


def test_ten_milliseconds_apart_stay_in_order(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    t0 = clock.now()
    first, second = send_many(
        spark,
        cfg,
        [
            Message("orders", "b", deliver_at=t0 + timedelta(milliseconds=1010)),
            Message("orders", "a", deliver_at=t0 + timedelta(milliseconds=1000)),
        ],
        clock,
    )
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    clock.set(t0 + timedelta(milliseconds=1005))
    engine.step()
    assert [r["msg_id"] for r in delivered_rows(spark, cfg)] == [second]
    clock.set(t0 + timedelta(milliseconds=1010))
    engine.step()
    rows = sorted(delivered_rows(spark, cfg), key=lambda r: r["delivery_round"])  # type: ignore[arg-type, return-value]
    assert [r["msg_id"] for r in rows] == [second, first]


def test_delay_above_the_maximum_is_refused(
    spark: SparkSession, make_cfg: Any, clock: FakeClock
) -> None:
    cfg = make_cfg(max_delay_ms=60_000)
    with pytest.raises(InvalidMessageError, match="max_delay=60s"):
        send_many(spark, cfg, [Message("orders", "x", delay="61s")], clock)
    send_many(spark, cfg, [Message("orders", "x", delay="60s")], clock)


def test_far_future_backlog_is_skipped(
    spark: SparkSession, make_cfg: Any, clock: FakeClock
) -> None:
    cfg = make_cfg(stamp_file_rows=20_000)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    parked = spark.range(200_000).select(
        F.lit("parked").alias("topic"),
        F.col("id").cast("string").alias("body"),
        (F.lit(clock.now() + timedelta(days=2)) + F.make_interval(secs=F.col("id") / 10)).alias(
            "deliver_at"
        ),
    )
    send_df(spark, cfg, parked, clock)
    engine.step()  # stamps the backlog (read once, as new arrivals)
    t0 = clock.now()
    send_many(spark, cfg, [Message("orders", f"m{i}", delay="1s") for i in range(10)], clock)
    clock.set(t0 + timedelta(seconds=1))
    result = engine.step()
    assert result.delivered == 10
    read = f"{result.files_read} files / {result.rows_read} rows"
    print(f"\n200k timers 2 days ahead: a round read {read}")
    assert result.rows_read == 10, "the parked timers are skipped, not read and filtered"
