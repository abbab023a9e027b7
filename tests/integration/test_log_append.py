"""Appends written straight into the Delta log: Spark and delta-rs read them as their own,
races lose nothing and repeat nothing, and tables with rules the appender does not honour
are left to delta-rs."""

from __future__ import annotations

import os
import shutil
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from chispa import assert_df_equality
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.checkpoints import CHECKPOINTS
from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.delta.live_files import LiveFiles
from engine.lakehouse.delta.log_append import HIVE_NULL, LogAppender

T0 = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def _rows(start: int, n: int, queues: int = 1) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(start, start + n), pa.int64()),
            "name": pa.array([f"m{i}" for i in range(start, start + n)]),
            "at": pa.array(
                [T0 + timedelta(microseconds=i * 1500) for i in range(start, start + n)],
                pa.timestamp("us", tz="UTC"),
            ),
            "queue_id": pa.array([i % queues for i in range(start, start + n)], pa.int32()),
        }
    )


def _spark_table(spark: SparkSession, path: Path, partitioned: bool = False) -> str:
    where = str(path)
    part = "PARTITIONED BY (queue_id)" if partitioned else ""
    spark.sql(
        f"CREATE TABLE delta.`{where}` (id BIGINT, name STRING, at TIMESTAMP, queue_id INT)"
        f" USING delta {part}"
    )
    return where


def test_spark_reads_log_appends_as_its_own_history_rows_and_txn(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = _spark_table(spark, tmp_path / "t", partitioned=True)
    appender = LogAppender(path)
    assert appender.append(_rows(0, 30, queues=3), txn=Txn("app", 1), metadata="round 1")
    assert appender.append(_rows(30, 30, queues=3), txn=Txn("app", 2), file_rows=4)

    got = spark.read.format("delta").load(path)
    expected = spark.createDataFrame(_rows(0, 60, queues=3).to_pandas()).select(got.columns)
    assert_df_equality(got, expected, ignore_row_order=True, ignore_nullable=True)
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").orderBy("version").collect()
    assert [(h.version, h.operation, h.userMetadata) for h in history[1:]] == [
        (1, "WRITE", "round 1"),
        (2, "WRITE", None),
    ]
    # Spark honours the recorded txn: its own write of round 2 is skipped, round 3 lands.
    for version in (2, 3):
        spark.createDataFrame(_rows(100 + version, 1).to_pandas()).write.format("delta").option(
            "txnAppId", "app"
        ).option("txnVersion", version).mode("append").save(path)
    assert spark.read.format("delta").load(path).count() == 61
    # Files cut at 4 rows, in their queue's folder.
    added = pa.table(DeltaTable(path).get_add_actions(flatten=True)).to_pylist()
    assert max(a["num_records"] for a in added) == 10
    assert all(a["path"].startswith(f"queue_id={a['partition.queue_id']}/") for a in added)


def test_statistics_skip_files_without_losing_a_row(spark: SparkSession, tmp_path: Path) -> None:
    path = _spark_table(spark, tmp_path / "t")
    appender = LogAppender(path)
    for start in range(0, 100, 10):  # ten files; "at" goes up 1.5 ms a row
        assert appender.append(_rows(start, 10))
    # A cut between two rows of one file, at microseconds the millisecond stats round.
    cut = T0 + timedelta(microseconds=55 * 1500)
    frame = spark.read.format("delta").load(path).where(F.col("at") <= F.lit(cut))
    assert sorted(r.id for r in frame.collect()) == list(range(56))
    scanned = DeltaTable(path).to_pyarrow_dataset()
    assert scanned.to_table(filter=ds.field("at") > cut).num_rows == 44
    files = pa.table(DeltaTable(path).get_add_actions(flatten=True)).to_pylist()
    first = next(f for f in files if f["min.id"] == 0)  # "at" 0-13.5 ms, stats 0-14 ms
    assert (first["min.at"], first["max.at"]) == (T0, T0 + timedelta(milliseconds=14))


def test_racing_appenders_and_spark_lose_nothing_and_repeat_no_txn(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = _spark_table(spark, tmp_path / "t")
    first, second = LogAppender(path), LogAppender(path)
    assert first.append(_rows(0, 1)) and second.append(_rows(1, 1))  # both now know v2

    def run(appender: LogAppender, base: int) -> None:
        for i in range(40):
            appender.append(_rows(base + i, 1))

    threads = [threading.Thread(target=run, args=(a, b)) for a, b in ((first, 100), (second, 200))]
    for t in threads:
        t.start()
    spark.createDataFrame(_rows(300, 5).to_pandas()).write.format("delta").mode("append").save(path)
    for t in threads:
        t.join()
    ids = sorted(r.id for r in spark.read.format("delta").load(path).collect())
    assert ids == sorted([0, 1, *range(100, 140), *range(200, 240), *range(300, 305)])

    # A stale appender whose txn another writer already committed writes nothing again.
    stale = LogAppender(path)
    stale.append(_rows(400, 1))
    first.append(_rows(500, 3), txn=Txn("batch", 9))
    assert stale.append(_rows(500, 3), txn=Txn("batch", 9))
    assert spark.read.format("delta").load(path).where("id >= 500").count() == 3
    versions = sorted(int(p.name[:20]) for p in (tmp_path / "t" / "_delta_log").glob("*.json"))
    assert versions == list(range(versions[-1] + 1))
    assert not list((tmp_path / "t").glob("*.tmp")) and not list(
        (tmp_path / "t" / "_delta_log").glob(".*.tmp")
    )


def test_a_new_column_from_another_writer_is_picked_up(spark: SparkSession, tmp_path: Path) -> None:
    path = _spark_table(spark, tmp_path / "t")
    appender = LogAppender(path)
    assert appender.append(_rows(0, 2))
    spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS (extra STRING)")
    assert appender.append(_rows(2, 2).append_column("extra", pa.array(["x", "y"])))
    stale = ArrowDelta(path)  # a producer's kept handle, made before the next column
    stale.append(_rows(4, 1).append_column("extra", pa.array([None], pa.string())))
    spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS (more INT)")
    stale.append(_rows(5, 1))  # rows without the new columns: written as nulls
    got = spark.read.format("delta").load(path).orderBy("id").select("id", "extra", "more")
    assert [tuple(r) for r in got.collect()] == [
        (0, None, None),
        (1, None, None),
        (2, "x", None),
        (3, "y", None),
        (4, None, None),
        (5, None, None),
    ]


def test_a_table_with_a_check_constraint_is_left_to_delta_rs(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = _spark_table(spark, tmp_path / "t")
    spark.sql(f"ALTER TABLE delta.`{path}` ADD CONSTRAINT positive CHECK (id >= 0)")
    appender = LogAppender(path)
    assert not appender.append(_rows(0, 2))
    assert appender.refused == "CHECK constraints"
    table = ArrowDelta(path)
    table.append(_rows(0, 2))  # through delta-rs, which checks the constraint
    with pytest.raises(Exception, match="failed validation"):
        table.append(_rows(-5, 1))
    assert spark.read.format("delta").load(path).count() == 2


def test_a_stale_appender_reloads_after_a_checkpoint_cleaned_the_log(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = _spark_table(spark, tmp_path / "t")
    stale = LogAppender(path)
    assert stale.append(_rows(0, 1))  # knows version 1
    table = ArrowDelta(path)
    for i in range(1, 21):
        table.append(_rows(i, 1))  # versions 2-21; a checkpoint asked at 10 and at 20
    assert CHECKPOINTS.wait(timeout=60)
    log_dir = tmp_path / "t" / "_delta_log"
    assert (log_dir / "_last_checkpoint").exists()
    for version in range(2, 20):  # as log cleanup would, past its retention
        os.remove(log_dir / f"{version:020d}.json")
    assert stale.append(_rows(21, 1))
    assert stale.version == 22
    assert sorted(r.id for r in spark.read.format("delta").load(path).collect()) == list(range(22))


def test_a_txn_committed_before_a_schema_change_is_not_written_again(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = _spark_table(spark, tmp_path / "t")
    stale = LogAppender(path)
    assert stale.append(_rows(0, 1))
    LogAppender(path).append(_rows(10, 3), txn=Txn("batch", 4))  # a replacement wrote it
    spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS (extra STRING)")  # then a new schema
    assert stale.append(_rows(10, 3), txn=Txn("batch", 4))  # the zombie's replay
    assert spark.read.format("delta").load(path).where("id >= 10").count() == 3


def test_tables_the_appender_or_the_reader_cannot_serve_are_refused_by_name(
    spark: SparkSession, tmp_path: Path
) -> None:
    where = str(tmp_path / "by_name")
    spark.sql(
        f"CREATE TABLE delta.`{where}` (id BIGINT, name STRING) USING delta PARTITIONED BY (name)"
    )
    appender = LogAppender(where)
    assert not appender.append(pa.table({"id": [1], "name": ["a b"]}))
    assert appender.refused == "partition column name of type string"
    mapped = str(tmp_path / "mapped")
    spark.sql(
        f"CREATE TABLE delta.`{mapped}` (id BIGINT) USING delta TBLPROPERTIES ("
        "'delta.columnMapping.mode' = 'name', 'delta.minReaderVersion' = '2', "
        "'delta.minWriterVersion' = '5')"
    )
    assert not LogAppender(mapped).append(pa.table({"id": [1]}))
    with pytest.raises(ValueError, match="column mapping name"):
        LiveFiles(mapped).dataset(0)


def test_a_table_made_again_at_the_same_path_is_read_again(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = _spark_table(spark, tmp_path / "t")
    appender = LogAppender(path)
    for start in range(3):
        assert appender.append(_rows(start, 1))  # knows version 3
    shutil.rmtree(path)
    spark.sql(f"CREATE TABLE delta.`{path}` (id BIGINT, other STRING) USING delta")
    assert appender.append(pa.table({"id": [7], "other": ["x"]}))
    assert appender.version == 1
    got = spark.read.format("delta").load(path).collect()
    assert [(r.id, r.other) for r in got] == [(7, "x")]


def test_a_staged_append_is_unseen_until_committed(spark: SparkSession, tmp_path: Path) -> None:
    """The data files of a staged append exist, but neither Spark nor delta-rs sees a row of
    them until the commit; the commit shows all of them at once, with its txn."""
    path = _spark_table(spark, tmp_path / "t")
    table = ArrowDelta(path)
    table.append(_rows(0, 5))
    commit = table.stage(_rows(5, 7), txn=Txn("app", 3), metadata="round 3")
    assert len(list(Path(path).glob("*.parquet"))) == 2, "the staged file is written"
    assert spark.read.format("delta").load(path).count() == 5
    assert table.dataset(table.latest()).count_rows() == 5
    commit()
    assert spark.read.format("delta").load(path).count() == 12
    assert table.txn_version("app") == 3


def test_an_append_between_stage_and_commit_and_a_second_commit_lose_and_repeat_nothing(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Another writer commits while a staged append waits: the staged commit takes the next
    version, and committing it a second time is refused rather than adding its rows again."""
    path = _spark_table(spark, tmp_path / "t")
    table = ArrowDelta(path)
    commit = table.stage(_rows(0, 4), txn=Txn("rounds", 1))
    LogAppender(path).append(_rows(4, 3), txn=Txn("other", 1))  # another process
    table.append(_rows(7, 2))  # this process, between the two steps
    commit()
    with pytest.raises(RuntimeError, match="committed once"):
        commit()
    ids = sorted(r.id for r in spark.read.format("delta").load(path).select("id").collect())
    assert ids == list(range(9))
    assert table.latest() == 3 and table.txn_version("rounds") == 1


def test_a_partition_column_whose_name_needs_escaping_is_read_alike_by_spark_delta_rs_and_here(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The log's ``add.path`` is a URI (the protocol's rule): with a partition column named
    ``my col:1`` every reader decodes the path to the folder the file is in, and the folder is
    named as Spark names its own (``ExternalCatalogUtils.escapePathName``)."""
    where = str(tmp_path / "escaped")
    schema = pa.schema([("id", pa.int64()), ("my col:1", pa.int32())])
    write_deltalake(where, schema.empty_table(), partition_by=["my col:1"])  # Spark refuses it
    values = [1, -2, None]
    rows = pa.table(
        {"id": pa.array([0, 1, 2], pa.int64()), "my col:1": pa.array(values, pa.int32())}
    )
    assert LogAppender(where).append(rows)
    expected = list(zip([0, 1, 2], values, strict=True))

    by_spark = spark.read.format("delta").load(where).orderBy("id").collect()
    assert [(r["id"], r["my col:1"]) for r in by_spark] == expected
    by_delta_rs = DeltaTable(where).to_pyarrow_table().sort_by("id")
    assert [tuple(r.values()) for r in by_delta_rs.to_pylist()] == expected
    live = LiveFiles(where)
    by_engine = live.dataset(live.latest()).to_table().sort_by("id")
    assert [tuple(r.values()) for r in by_engine.select(["id", "my col:1"]).to_pylist()] == expected

    folders = {p.name for p in Path(where).iterdir() if not p.name.startswith("_")}
    assert folders == {"my col%3A1=1", "my col%3A1=-2", f"my col%3A1={HIVE_NULL}"}, folders


def test_the_txn_rules_of_the_two_writers_as_documented(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Spark's append looks its ``txn`` up at every write and skips a recorded one; the
    engine's Arrow append records it and skips only when it meets it reading the table (a
    replay asks ``txn_version`` first). Both rules are in the writers' docstrings."""
    from engine.lakehouse.delta.delta_log import append

    where = _spark_table(spark, tmp_path / "t")
    first = ArrowDelta(where)
    first.append(_rows(0, 2), txn=Txn("app", 1))  # this handle has read the table now
    append(spark.createDataFrame(_rows(2, 2).to_pandas()), where, txn=Txn("app", 1))
    assert spark.read.format("delta").load(where).count() == 2, "Spark skipped the recorded txn"
    assert ArrowDelta(where).txn_version("app") == 1
    ArrowDelta(where).append(_rows(4, 2), txn=Txn("app", 1))
    assert spark.read.format("delta").load(where).count() == 2, "a new handle reads it: skipped"
    append(spark.createDataFrame(_rows(6, 2).to_pandas()), where, txn=Txn("app", 2))
    first.append(_rows(8, 1))  # loses version 2 to Spark's commit, reads it, commits 3
    first.append(_rows(9, 2), txn=Txn("app", 2))  # recorded at a version it has passed
    assert spark.read.format("delta").load(where).count() == 7, "not looked up: written"
    first.append(_rows(11, 2), txn=Txn("app", 3))
    append(spark.createDataFrame(_rows(13, 2).to_pandas()), where, txn=Txn("app", 3))
    assert spark.read.format("delta").load(where).count() == 9, "Spark looked it up: skipped"
