"""A round's cost follows new and due rows, not the rows waiting far in the future."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.core.clock import FakeClock
from engine.deliver.round import RoundResult
from engine.produce.send import Message, send_df, send_many
from engine.run.engine import Engine

pytestmark = pytest.mark.integration

BACKLOG_ROWS = 200_000
BACKLOG_COMMITS = 8


def steady_round(spark: SparkSession, cfg: Any, clock: FakeClock, backlog: int) -> RoundResult:
    """Optionally park ``backlog`` rows at the 1 h level, then measure a steady round."""
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    per_commit = backlog // BACKLOG_COMMITS
    for part in range(BACKLOG_COMMITS if backlog else 0):
        rows = spark.range(part * per_commit, (part + 1) * per_commit).select(
            F.lit("parked").alias("topic"),
            F.col("id").cast("string").alias("body"),
            F.lit(3).alias("delay_level"),
        )
        send_df(spark, cfg, rows, clock)
    engine.step()  # stamps the backlog; this round reads it once, as new arrivals
    results = []
    for _ in range(3):
        send_many(spark, cfg, [Message("orders", f"m{i}", delay_level=1) for i in range(10)], clock)
        clock.advance(seconds=1)
        results.append(engine.step())
    assert all(r.delivered == 10 for r in results)
    return results[-1]


def test_round_reads_the_same_files_with_or_without_a_backlog(
    spark: SparkSession, make_cfg: Any, clock: FakeClock, tmp_path: Any
) -> None:
    empty = steady_round(
        spark, make_cfg(levels="1s 2s 1h", lakehouse=str(tmp_path / "a")), clock, 0
    )
    loaded = steady_round(
        spark, make_cfg(levels="1s 2s 1h", lakehouse=str(tmp_path / "b")), clock, BACKLOG_ROWS
    )
    for label, result in (("no backlog", empty), (f"{BACKLOG_ROWS} parked", loaded)):
        print(f"\n{label}: {result.files_read} files / {result.rows_read} rows read")
    assert loaded.files_read == empty.files_read
    assert loaded.rows_read == empty.rows_read
    assert loaded.rows_read < 100  # the parked rows are skipped, not read and filtered
