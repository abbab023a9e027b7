"""The status's row counts come from the tables' logs, and always equal Spark's ``count()``:
whoever wrote the table, after compaction, and (counted by Spark) with files without
statistics or with deletion vectors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from engine.control import status
from engine.control.status import RowCounts
from engine.core.config import EngineConfig
from engine.lakehouse.delta.live_files import LiveFiles
from engine.lakehouse.delta.tables import ensure_tables
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many

pytestmark = pytest.mark.integration


def _spark_count(spark: SparkSession, path: str) -> int:
    return int(spark.read.format("delta").load(path).count())


def test_counts_follow_every_writer_and_compaction_as_spark_counts(
    spark: SparkSession, cfg: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_spark(_spark: SparkSession, path: str) -> int:
        raise AssertionError(f"{path} was counted by Spark, not from its log")

    monkeypatch.setattr(status, "_spark_count", no_spark)  # every count below from the logs
    ensure_tables(spark, cfg)
    commitlog = layout(cfg).commitlog
    counts = RowCounts()  # one counter for every question, as the engine keeps one
    assert counts(spark, commitlog) == 0
    for i in range(3):  # the log appender: a commit a send
        send_many(spark, cfg, [Message("orders", f"m{i}-{j}") for j in range(i + 1)])
    assert counts(spark, commitlog) == _spark_count(spark, commitlog) == 6
    spark.sql(  # Spark's own writer, beside it
        f"INSERT INTO delta.`{commitlog}` (msg_id, topic, body, store_ts) "
        "VALUES ('sql-1', 'orders', CAST('x' AS BINARY), current_timestamp())"
    )
    assert counts(spark, commitlog) == _spark_count(spark, commitlog) == 7
    spark.sql(f"OPTIMIZE delta.`{commitlog}`")  # files removed and one added, same rows
    assert counts(spark, commitlog) == _spark_count(spark, commitlog) == 7
    send_many(spark, cfg, [Message("orders", "after")])
    assert counts(spark, commitlog) == 8


def test_files_without_statistics_or_with_deletion_vectors_are_counted_by_spark(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_spark: list[str] = []

    def spark_count(session: SparkSession, path: str) -> int:
        by_spark.append(Path(path).name)
        return _spark_count(session, path)

    monkeypatch.setattr(status, "_spark_count", spark_count)
    bare, deleted = str(tmp_path / "bare"), str(tmp_path / "deleted")
    counts = RowCounts()
    session = spark.newSession()
    session.conf.set("spark.databricks.delta.stats.collect", "false")
    session.range(5).write.format("delta").save(bare)
    assert {f.rows for f in LiveFiles(bare).files(0)} == {None}  # no statistics
    assert counts(spark, bare) == 5
    spark.sql(
        f"CREATE TABLE delta.`{deleted}` (id BIGINT) USING delta "
        "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"
    )
    spark.range(10).coalesce(1).write.format("delta").mode("append").save(deleted)
    spark.sql(f"DELETE FROM delta.`{deleted}` WHERE id < 3")  # a deletion vector, same file
    assert counts(spark, deleted) == _spark_count(spark, deleted) == 7
    assert counts(spark, bare) == 5
    assert by_spark == ["bare", "deleted", "bare"]
