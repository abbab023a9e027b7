"""Names in a persistent catalog: re-pointed when a lakehouse moves, never over a table
delayq does not own; the SQL server refuses a taken port by name."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.core.errors import ConfigError, SetupError
from engine.lakehouse.catalog.names import ensure_database, put_view, register_all, register_table
from engine.produce.send import Message, send_many
from engine.run.engine import Engine
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
    register_table(spark, cfg, "orders", old)
    assert spark.table(f"{cfg.database}.orders").count() == 2
    register_table(spark, cfg, "orders", old)  # idempotent
    (tmp_path / "old").rename(tmp_path / "new")  # the lakehouse folder moved
    new = str(tmp_path / "new" / "orders")
    register_table(spark, cfg, "orders", new)
    assert spark.table(f"{cfg.database}.orders").count() == 2
    assert sorted(r.id for r in spark.read.format("delta").load(new).collect()) == [0, 1]


def test_a_name_held_by_another_existing_table_is_never_taken(
    spark: SparkSession, cfg: EngineConfig, tmp_path: Path
) -> None:
    theirs = _table(spark, tmp_path / "other-lakehouse" / "orders", 2)
    ours = _table(spark, tmp_path / "ours" / "orders", 3)
    register_table(spark, cfg, "orders", theirs)
    with pytest.raises(SetupError, match=rf"{cfg.database}\.orders already names .*{theirs}"):
        register_table(spark, cfg, "orders", ours)
    assert spark.table(f"{cfg.database}.orders").count() == 2  # still theirs, data intact

    spark.sql(f"CREATE TABLE {cfg.database}.audit (id BIGINT) USING delta")  # managed
    spark.sql(f"INSERT INTO {cfg.database}.audit VALUES (7)")
    with pytest.raises(SetupError, match=rf"{cfg.database}\.audit already names a managed"):
        register_table(spark, cfg, "audit", _table(spark, tmp_path / "ours" / "audit", 1))
    assert [r.id for r in spark.table(f"{cfg.database}.audit").collect()] == [7]


def test_a_topic_named_history_takes_the_name_from_the_view(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    send_many(spark, cfg, [Message("orders", "a")], clock)
    Engine(spark, cfg, clock, out=lambda _: None).open().step()
    register_all(spark, cfg)
    assert spark.table(f"{cfg.database}.history").where("event = 'delivered'").count() == 1
    send_many(spark, cfg, [Message("history", "b")], clock)
    Engine(spark, cfg, clock, out=lambda _: None).open().step()
    register_all(spark, cfg)
    assert [r.body for r in spark.table(f"{cfg.database}.history").collect()] == [b"b"]


def test_a_view_named_again_is_never_missing_for_a_reader(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    # A reader of a view over a view, as `pending` reads `delay_offset`, while the inner one
    # is named again (as a session start does) and changed (as a new topic changes `history`).
    db = cfg.database
    ensure_database(spark, cfg)
    put_view(spark, db, "inner", "SELECT 0 AS one")
    put_view(spark, db, "outer", f"SELECT one FROM `{db}`.`inner`")
    catalog = spark._jsparkSession.sharedState().externalCatalog()
    created = catalog.getTable(db, "inner").createTime()
    failures: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                spark.sql(f"SELECT count(*) FROM `{db}`.`outer`").collect()
            except Exception as err:
                failures.append(str(err).splitlines()[0])

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(1, 16):
            put_view(spark, db, "inner", f"SELECT {i - 1} AS one")  # unchanged: no write
            put_view(spark, db, "inner", f"SELECT {i} AS one")
    finally:
        done.set()
        reader.join()
    assert failures == []
    assert [r.one for r in spark.table(f"{db}.outer").collect()] == [15]
    assert catalog.getTable(db, "inner").createTime() == created  # altered, never re-created

    spark.sql(f"CREATE TABLE `{db}`.`pending` (id BIGINT) USING delta")
    with pytest.raises(SetupError, match=rf"{db}\.pending already names a managed table"):
        put_view(spark, db, "pending", "SELECT 1 AS one")


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
