"""Shared fixtures: one Delta-enabled Spark session, a temporary lakehouse, a fake clock."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from pyspark.sql import SparkSession

from engine.clock import FakeClock
from engine.config import EngineConfig
from engine.levels import parse_levels
from engine.session import build_spark

START = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
TEST_SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.databricks.delta.snapshotPartitions": "1",
    "spark.sql.adaptive.coalescePartitions.initialPartitionNum": "2",
}


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    """The one Spark session of the test run (local[2], Delta enabled)."""
    base = EngineConfig(
        lakehouse=str(tmp_path_factory.mktemp("session-lakehouse")),
        register_tables=False,
        log_level="ERROR",
        spark_conf=TEST_SPARK_CONF,
    )
    session = build_spark(base)
    yield session
    session.stop()


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when a test says so."""
    return FakeClock(START)


@pytest.fixture
def make_cfg(tmp_path: pytest.TempPathFactory) -> object:
    """Factory for configs on a fresh lakehouse with compressed levels ``1s 2s 3s``."""

    def make(levels: str = "1s 2s 3s", **changes: object) -> EngineConfig:
        settings: dict[str, object] = {
            "lakehouse": str(tmp_path / "lakehouse"),  # type: ignore[operator]
            "database": f"t_{uuid.uuid4().hex[:8]}",
            "levels": parse_levels(levels),
            "register_tables": False,
            "log_level": "ERROR",
            "spark_conf": TEST_SPARK_CONF,
        }
        settings.update(changes)
        return EngineConfig(**settings)  # type: ignore[arg-type]

    return make


@pytest.fixture
def cfg(make_cfg: object) -> EngineConfig:
    """A config on a fresh lakehouse with levels ``1s 2s 3s``."""
    return make_cfg()  # type: ignore[operator, no-any-return]


def delivered_rows(spark: SparkSession, cfg: EngineConfig) -> list[dict[str, object]]:
    """Every row in every topic table of ``cfg``'s lakehouse, as dicts."""
    from engine.tables import layout, list_topics

    rows: list[dict[str, object]] = []
    for name in list_topics(spark, cfg):
        table = spark.read.format("delta").load(layout(cfg).topic(name))
        rows.extend(r.asDict() for r in table.collect())
    return rows


def assert_exactly_once_never_early(rows: list[dict[str, object]], sent_ids: list[str]) -> None:
    """Each sent id is in exactly one topic row, and no row arrived before its deliver time."""
    ids = [r["msg_id"] for r in rows]
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates, f"delivered twice: {sorted(duplicates)[:5]}"
    assert set(ids) == set(sent_ids), f"missing: {sorted(set(sent_ids) - set(ids))[:5]}"
    early = [r["msg_id"] for r in rows if r["delivered_ts"] < r["deliver_ts"]]  # type: ignore[operator]
    assert not early, f"delivered before deliver_ts: {early[:5]}"
