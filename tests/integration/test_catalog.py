"""Names in a persistent catalog: re-pointed when a lakehouse moves, never over a table
delayq does not own; the SQL server refuses a taken port by name."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from engine.core.config import EngineConfig
from engine.core.errors import ConfigError, SetupError
from engine.lakehouse.catalog import register_table
from engine.run.sql_server import SqlServer

pytestmark = pytest.mark.integration


def _table(spark: SparkSession, path: Path, rows: int) -> str:
    spark.range(rows).write.format("delta").save(str(path))
    return str(path)


def test_the_session_catalog_is_the_embedded_metastore(spark: SparkSession) -> None:
    assert spark.conf.get("spark.sql.catalogImplementation") == "hive"


def test_a_name_kept_for_a_moved_lakehouse_points_at_the_new_place(
    spark: SparkSession, cfg: EngineConfig, tmp_path: Path
) -> None:
    old = _table(spark, tmp_path / "old" / "orders", 2)
    new = _table(spark, tmp_path / "new" / "orders", 3)
    register_table(spark, cfg, "orders", old)
    assert spark.table(f"{cfg.database}.orders").count() == 2
    register_table(spark, cfg, "orders", new)
    assert spark.table(f"{cfg.database}.orders").count() == 3
    # the old table's data is untouched: only the name moved
    assert spark.read.format("delta").load(old).count() == 2
    register_table(spark, cfg, "orders", new)  # idempotent
    assert spark.table(f"{cfg.database}.orders").count() == 3


def test_a_managed_table_with_the_name_is_never_replaced(
    spark: SparkSession, cfg: EngineConfig, tmp_path: Path
) -> None:
    spark.sql(f"CREATE DATABASE IF NOT EXISTS {cfg.database}")
    spark.sql(f"CREATE TABLE {cfg.database}.audit (id BIGINT) USING delta")
    spark.sql(f"INSERT INTO {cfg.database}.audit VALUES (7)")
    ours = _table(spark, tmp_path / "audit", 1)
    with pytest.raises(SetupError, match=rf"{cfg.database}\.audit is a managed table"):
        register_table(spark, cfg, "audit", ours)
    assert [r.id for r in spark.table(f"{cfg.database}.audit").collect()] == [7]


def test_a_taken_sql_port_fails_at_start_naming_the_key(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = SqlServer(spark, cfg.with_overrides(sql_jdbc_port=port))
        with pytest.raises(ConfigError, match=rf"sql.server.jdbc_port.*127.0.0.1:{port}"):
            server.start()
