"""Every table delayq writes reads the same in Spark, delta-rs and DuckDB's ``delta``
extension: after thousands of commits (checkpoints written by delayq's log appender), after
a ``maintain`` (Spark's OPTIMIZE and VACUUM), and after more commits on top of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import duckdb_extension_delta
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from engine.consume.consumer import Consumer
from engine.control.commands import cancel, reschedule, results_of
from engine.control.maintain import maintain, tables_to_maintain
from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from tests.support.lakehouse import quiet_engine

pytestmark = pytest.mark.integration

#: Single-message sends: each one commit to ``commitlog``.
COMMITS = 2_000


def _duckdb() -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the ``delta`` extension of its version, loaded from the
    ``duckdb-extension-delta`` package (no download)."""
    folder = Path(duckdb_extension_delta.__file__).parent / "extensions"
    (extension,) = folder.glob(f"v{duckdb.__version__}/delta.duckdb_extension")
    con = duckdb.connect()
    con.load_extension(str(extension))
    return con


def _rows(table: pa.Table) -> list[tuple[Any, ...]]:
    """A table's rows, comparable across readers: columns by name, timestamps as UTC
    microseconds, maps as sorted pairs, rows sorted."""
    columns = []
    for name in sorted(table.column_names):
        column = table[name]
        if pa.types.is_timestamp(column.type):
            column = column.cast(pa.timestamp("us", tz=column.type.tz)).cast(pa.int64())
        values = column.to_pylist()
        if pa.types.is_map(column.type):
            values = [None if v is None else tuple(sorted(v)) for v in values]
        columns.append(values)
    return sorted(zip(*columns, strict=True), key=repr)


def _assert_three_readers_agree(spark: SparkSession, cfg: EngineConfig) -> dict[str, int]:
    """Each table read by Spark, delta-rs and DuckDB: the same rows; rows per table."""
    con = _duckdb()
    counts = {}
    for name, path, _ in tables_to_maintain(spark, cfg):  # every table the lakehouse has
        tables = [
            spark.read.format("delta").load(path).toArrow(),
            DeltaTable(path).to_pyarrow_table(),
            con.sql(f"SELECT * FROM delta_scan('{path}')").to_arrow_table(),
        ]
        columns = [sorted(t.column_names) for t in tables]
        assert columns[1] == columns[2] == columns[0], f"{name}: columns differ: {columns}"
        by_spark, by_delta_rs, by_duckdb = map(_rows, tables)
        assert by_delta_rs == by_spark, f"{name}: delta-rs and Spark differ"
        assert by_duckdb == by_spark, f"{name}: DuckDB and Spark differ"
        counts[name] = len(by_spark)
    return counts


def test_every_table_reads_the_same_three_ways_after_thousands_of_commits_and_a_maintain(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    ids = []
    for i in range(COMMITS):
        topic = ("orders", "billing")[i % 2]
        ids += send_many(spark, cfg, [Message(topic, f"m{i}", delay_level=i % 3)], clock)
        if i % 200 == 199:  # stamped and delivered along the way
            clock.advance(seconds=1)
            engine.step()
    send_many(spark, cfg, [Message("orders", "dup", msg_id=ids[0])], clock)  # a quarantined retry
    later = send_many(
        spark, cfg, [Message("orders", f"later{i}", delay="1h") for i in range(2)], clock
    )
    engine.step()
    cancelled = cancel(spark, cfg, later[0], wait=0, clock=clock)
    moved = reschedule(spark, cfg, later[1], delay="2s", wait=0, clock=clock)
    for _ in range(4):
        clock.advance(seconds=1)
        engine.step()
    done = results_of(spark, cfg, [cancelled.command_id], "cancel")
    done += results_of(spark, cfg, [moved.command_id], "reschedule")
    assert [d.status for d in done] == ["cancelled", "rescheduled"], done
    consumer = Consumer(spark, cfg, "readers", ["orders"], clock=clock)
    got = consumer.poll(max_messages=10, timeout=0)
    consumer.ack(*got[:8])
    for failed in got[8:]:  # two failures, sent back through commitlog to a retry topic
        consumer.nack(failed, "readers test")
    consumer.commit()
    consumer.close()
    commitlog = DeltaTable(layout(cfg).commitlog)
    assert commitlog.version() >= COMMITS
    assert (Path(layout(cfg).commitlog) / "_delta_log" / "_last_checkpoint").exists()

    before = _assert_three_readers_agree(spark, cfg)
    assert before["commitlog"] == COMMITS + 3 + 2  # the duplicate, two later, two retries
    assert before["topics/orders"] + before["topics/billing"] == COMMITS + 1  # moved, not cancelled
    assert before["quarantine"] == 1 and before["consumer_log"] > 0

    # the table of thousands of commits, and a topic table (the others: test_maintain.py)
    maintained = {"commitlog", "topics/billing"}
    reports = maintain(spark, cfg, lambda _: None, maintained, clock, vacuum_topics=True)
    assert {r.table: r.files_after for r in reports} == dict.fromkeys(maintained, 1)
    after = _assert_three_readers_agree(spark, cfg)
    assert after == before  # compaction moves rows between files, it changes none

    more = send_many(spark, cfg, [Message("billing", f"after{i}") for i in range(3)], clock)
    clock.advance(seconds=1)
    engine.step()
    again = _assert_three_readers_agree(spark, cfg)
    assert again["commitlog"] == before["commitlog"] + len(more)
    assert again["topics/billing"] == before["topics/billing"] + len(more)
