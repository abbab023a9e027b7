"""Test settings and what a user would look at in a lakehouse: the delivered rows."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pyspark.sql import SparkSession

from engine.core.clock import FakeClock, to_millis
from engine.core.config import EngineConfig
from engine.lakehouse.delta.delta_log import list_topics
from engine.lakehouse.storage.layout import layout
from engine.run.engine import Engine
from jobs.tools.benchmark import commit_times

START = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
TEST_SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.databricks.delta.snapshotPartitions": "1",
    "spark.sql.adaptive.coalescePartitions.initialPartitionNum": "2",
    # One JVM serves the whole suite, and a stamping batch is collected to the driver as
    # Arrow: the default 1g heap ran out in CI once the suite had grown.
    "spark.driver.memory": "3g",
}


def quiet_engine(spark: SparkSession, cfg: EngineConfig, clock: FakeClock, **kw: Any) -> Engine:
    """An opened engine that prints nothing."""
    return Engine(spark, cfg, clock, out=lambda _: None, **kw).open()


def delivered_rows(spark: SparkSession, cfg: EngineConfig) -> list[dict[str, object]]:
    """Every row in every topic table of ``cfg``'s lakehouse, as dicts."""
    rows: list[dict[str, object]] = []
    for name in list_topics(cfg):
        table = spark.read.format("delta").load(layout(cfg).topic(name))
        rows.extend(r.asDict() for r in table.collect())
    return rows


def assert_exactly_once_never_early(
    rows: list[dict[str, object]], sent_ids: list[str], cfg: EngineConfig | None = None
) -> None:
    """Each sent id is in exactly one topic row, and no row arrived before its deliver time.

    With ``cfg`` (an engine on the real clock), also by the Delta log: the commit that
    showed each row (its ``commitInfo`` time, taken just before the commit appears) is not
    before the row's ``deliver_ts``, whatever ``delivered_ts`` says.
    """
    ids = [r["msg_id"] for r in rows]
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates, f"delivered twice: {sorted(duplicates)[:5]}"
    assert set(ids) == set(sent_ids), f"missing: {sorted(set(sent_ids) - set(ids))[:5]}"
    early = [r["msg_id"] for r in rows if r["delivered_ts"] < r["deliver_ts"]]  # type: ignore[operator]
    assert not early, f"delivered before deliver_ts: {early[:5]}"
    if cfg is not None:
        commits = {t: commit_times(layout(cfg).topic(t)) for t in list_topics(cfg)}
        shown_early = [
            r["msg_id"]
            for r in rows
            if commits[str(r["topic"]).lower()][int(r["delivery_round"])]  # type: ignore[call-overload]
            < to_millis(r["deliver_ts"].astimezone(UTC))  # type: ignore[attr-defined]
        ]
        assert not shown_early, f"committed before deliver_ts: {shown_early[:5]}"
