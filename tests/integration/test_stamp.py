"""Stamping as a transform on small inline DataFrames, and its writer across replays."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from chispa import assert_df_equality
from pyspark.sql import SparkSession

from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.core.levels import parse_levels
from engine.lakehouse.tables import ensure_tables
from engine.stamp.transform import stamp
from engine.stamp.writer import StampWriter
from schemas import COMMITLOG

pytestmark = pytest.mark.integration
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
CFG = EngineConfig(levels=parse_levels("1s 2s 3s"), max_body_bytes=8)


def commitlog_rows(
    spark: SparkSession, rows: list[tuple[str, str | None, bytes | None, int | None]]
):  # type: ignore[no-untyped-def]
    return spark.createDataFrame(
        [(m, t, [], None, {}, b, lvl, T0, T0, None) for m, t, b, lvl in rows], COMMITLOG
    )


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
    got = scheduled.select("msg_id", "queue_id", "deliver_ts", "stamp_batch")
    expected = spark.createDataFrame(
        [
            ("now", 0, T0, 7),
            ("neg", 0, T0, 7),
            ("l2", 2, T0 + timedelta(seconds=2), 7),
            ("l9", 3, T0 + timedelta(seconds=3), 7),
        ],
        "msg_id string, queue_id int, deliver_ts timestamp, stamp_batch long",
    )
    assert_df_equality(got, expected, ignore_row_order=True, ignore_nullable=True)
    reasons = {r["msg_id"]: r["reason"] for r in quarantined.collect()}
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
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, valid), 1)
    StampWriter(cfg, lay, clock)(batch, 1)
    # A batch of refused rows only.
    StampWriter(cfg, lay, clock)(commitlog_rows(spark, [("bad", None, b"d", 2)]), 2)

    def stored(path: str) -> list[tuple[str, int]]:
        rows = spark.read.format("delta").load(path).select("msg_id", "stamp_batch").collect()
        return sorted((r["msg_id"], r["stamp_batch"]) for r in rows)

    assert stored(lay.schedule) == [("ok1", 0), ("ok1", 1), ("ok2", 0), ("ok2", 1)]
    assert stored(lay.quarantine) == [("bad", 2), ("notopic", 0), ("notopic", 1)]
