"""Sending from Python and the CLI, and querying topics by table name in SQL."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from chispa import assert_df_equality
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.control.inspect import history
from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.core.errors import InvalidMessageError
from engine.lakehouse.catalog.names import register_all
from engine.lakehouse.delta.tables import ensure_tables
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send, send_arrow, send_df, send_many
from engine.run.engine import Engine
from tests.support.process import cli

pytestmark = pytest.mark.integration
MSG_ID = re.compile(r"^[0-9A-F]{32}$")


def commitlog(spark: SparkSession, cfg: EngineConfig) -> Any:
    return spark.read.format("delta").load(layout(cfg).commitlog)


def test_send_one_and_many_return_ids_and_store_every_field(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    one = send(
        spark, cfg, "orders", "paid", keys="o-1 c-9", tags="pay",
        properties={"region": "eu"}, delay_level=2, clock=clock,
    )  # fmt: skip
    many = send_many(
        spark, cfg, [Message("orders", b"\x00\x01"), {"topic": "audit", "body": "a"}], clock
    )
    assert all(MSG_ID.match(i) for i in [one, *many])
    row = commitlog(spark, cfg).where(F.col("msg_id") == one).first()
    assert row is not None
    assert (row["topic"], row["keys"], row["tags"], row["properties"], row["delay_level"]) == (
        "orders", ["o-1", "c-9"], "pay", {"region": "eu"}, 2,
    )  # fmt: skip
    assert bytes(row["body"]) == b"paid"
    assert row["store_ts"].replace(tzinfo=clock.now().tzinfo) == clock.now()


def test_a_bad_message_in_a_batch_writes_nothing(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    ensure_tables(spark, cfg)
    with pytest.raises(InvalidMessageError, match="topic"):
        send_many(spark, cfg, [Message("orders", "ok"), Message("no-dashes", "bad")], clock)
    assert commitlog(spark, cfg).count() == 0


def test_send_dataframe(spark: SparkSession, cfg: EngineConfig, clock: FakeClock) -> None:
    df = spark.createDataFrame(
        [("orders", "a", 1), ("audit", "b", None)], "topic string, body string, delay_level int"
    )
    assert send_df(spark, cfg, df, clock) == 2
    stored = commitlog(spark, cfg).select("topic", F.col("body").cast("string").alias("body"))
    expected = spark.createDataFrame([("orders", "a"), ("audit", "b")], "topic string, body string")
    assert_df_equality(stored, expected, ignore_row_order=True, ignore_nullable=True)
    bad = spark.createDataFrame([("orders", None)], "topic string, body string")
    with pytest.raises(InvalidMessageError, match="body is missing"):
        send_df(spark, cfg, bad, clock)
    assert commitlog(spark, cfg).count() == 2


def test_send_arrow_checks_every_row_and_commits_once(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    rows = pa.table(
        {
            "topic": ["orders", "audit"],
            "body": [b"a", b"b"],
            "delay_level": pa.array([2, None], pa.int32()),
            "msg_id": ["order-1:paid", None],
        }
    )
    assert send_arrow(spark, cfg, rows, clock) == 2
    stored = {r["topic"]: r for r in commitlog(spark, cfg).collect()}
    assert stored["orders"]["msg_id"] == "order-1:paid" and stored["orders"]["delay_level"] == 2
    assert len(stored["audit"]["msg_id"]) == 32  # made here
    now = clock.now().replace(tzinfo=None)  # Spark shows UTC times without a zone
    assert stored["audit"]["store_ts"] == now == stored["audit"]["born_ts"]
    bad = pa.table({"topic": ["orders", "orders"], "body": [b"ok", None]})
    with pytest.raises(InvalidMessageError, match="body is missing"):
        send_arrow(spark, cfg, bad, clock)
    in_ms = pa.table({"topic": ["orders"], "body": [b"x"], "deliver_at": [1767268800000]})
    with pytest.raises(InvalidMessageError, match=r"deliver_at.*must be a timestamp column"):
        send_arrow(spark, cfg, in_ms, clock)
    with pytest.raises(InvalidMessageError, match="not commitlog columns"):
        send_arrow(spark, cfg, pa.table({"topic": ["x"], "body": [b"y"], "color": ["z"]}), clock)
    assert commitlog(spark, cfg).count() == 2


def test_the_same_msg_id_from_every_path_is_delivered_once(
    spark: SparkSession, cfg: EngineConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    key = "order-1:paid"
    assert send(spark, cfg, "orders", "first", msg_id=key) == key
    assert send(spark, cfg, "orders", "retry", msg_id=key) == key  # a retry after a timeout
    code, out, _ = cli(capsys, cfg, "send", "--topic", "orders", "--body", "cli", "--id", key)
    assert code == 0 and out.strip() == key
    df = spark.createDataFrame(
        [(key, "orders", "df"), (None, "orders", "fresh")],
        "msg_id string, topic string, body string",
    )
    assert send_df(spark, cfg, df) == 2
    spark.sql(
        f"INSERT INTO delta.`{layout(cfg).commitlog}` (msg_id, topic, body, store_ts) "
        f"VALUES ('{key}', 'orders', CAST('raw' AS BINARY), current_timestamp())"
    )
    code, _, err = cli(capsys, cfg, "send", "--topic", "orders", "--body", "x", "--id", "a b")
    assert code == 2 and "invalid message msg_id='a b'" in err

    Engine(spark, cfg, out=lambda _: None).step()
    delivered = spark.read.format("delta").load(layout(cfg).topic("orders")).collect()
    assert sorted(bytes(r["body"]).decode() for r in delivered) == ["first", "fresh"]
    assert [r["msg_id"] for r in delivered].count(key) == 1
    events = [r["event"] for r in history(spark, cfg, msg_id=key).collect()]
    assert sorted(events) == ["delivered", *["duplicate"] * 4, *["sent"] * 5, "stamped"]
    code, out, _ = cli(capsys, cfg, "history", "--id", key)
    assert code == 0 and len(re.findall(r"\|duplicate *\|", out)) == 4, out


def test_cli_send_status_and_sql(
    spark: SparkSession, cfg: EngineConfig, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = cli(
        capsys, cfg, "send", "--topic", "orders", "--body", "hi", "--key", "k1",
        "--property", "a=b", "--level", "0",
    )  # fmt: skip
    assert code == 0 and MSG_ID.match(out.strip())
    batch = tmp_path / "batch.jsonl"
    batch.write_text(
        json.dumps({"topic": "orders", "body": "x", "delay_level": 1})
        + "\n"
        + json.dumps({"topic": "audit", "body": "y", "keys": ["k2"]})
        + "\n"
    )
    code, out, _ = cli(capsys, cfg, "send", "--file", str(batch))
    assert code == 0 and len(out.split()) == 2

    code, _, err = cli(capsys, cfg, "send", "--topic", "bad topic", "--body", "x")
    assert code == 2 and "invalid message topic='bad topic'" in err

    # A bad line in --file is named by its number, and nothing of the file is sent.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"topic": "orders", "body": "fine"})
        + "\n\n"
        + json.dumps({"topic": "orders", "body": "x", "properties": {"RECONSUME_TIME": "9"}})
        + "\n"
    )
    stored = spark.read.format("delta").load(layout(cfg).commitlog).count()
    code, out, err = cli(capsys, cfg, "send", "--file", str(bad))
    assert code == 2 and out == "" and f"{bad}:3: invalid message properties=" in err
    assert spark.read.format("delta").load(layout(cfg).commitlog).count() == stored
    bad.write_text('["not", "an", "object"]\n')
    code, _, err = cli(capsys, cfg, "send", "--file", str(bad))
    assert code == 2 and f"{bad}:1: not a JSON object" in err
    bad.write_text(json.dumps({"topic": "orders", "body": "x", "keys": 5}) + "\n")
    code, _, err = cli(capsys, cfg, "send", "--file", str(bad))
    assert code == 2 and f"{bad}:1: invalid message" in err
    bad.write_bytes(b'{"topic": "orders", "body": "\xff"}\n')
    code, _, err = cli(capsys, cfg, "send", "--file", str(bad))
    assert code == 2 and f"{bad}:1: not UTF-8 text" in err
    bad.write_text("\n")
    code, _, err = cli(capsys, cfg, "send", "--file", str(bad))
    assert code == 2 and "holds no message" in err

    Engine(spark, cfg, out=lambda _: None).step()
    delivered = spark.read.format("delta").load(layout(cfg).topic("orders")).count()
    code, out, _ = cli(capsys, cfg, "status")
    assert code == 0 and "sent        3" in out

    code, out, _ = cli(capsys, cfg, "sql", f"SELECT count(*) AS n FROM {cfg.database}.orders")
    assert code == 0 and f"|{delivered:<3}|" in out

    code, out, _ = cli(capsys, cfg, "history", "--key", "k1")
    assert code == 0 and "sent" in out and "delivered" in out
    code, out, _ = cli(capsys, cfg, "pending", "--topic", "orders")
    assert code == 0 and "deliver_ts" in out
    code, out, _ = cli(capsys, cfg, "forecast", "--minutes", "5")
    assert code == 0 and "minute" in out

    code, _, err = cli(capsys, cfg, "status", "--set", "levels.delays=1s 2x")
    assert code == 2 and "levels.delays" in err and "'2x'" in err


def test_cli_help_is_available_without_spark() -> None:
    exe = Path(sys.executable).with_name("delayq")
    for args in ([], ["send"], ["run"]):
        done = subprocess.run(
            [str(exe), *args, "--help"], capture_output=True, text=True, check=True
        )
        assert "usage: delayq" in done.stdout
    done = subprocess.run([str(exe), "send", "--help"], capture_output=True, text=True, check=True)
    assert "--level" in done.stdout and "--file" in done.stdout


def test_cli_send_to_an_existing_commitlog_starts_no_jvm(
    spark: SparkSession, cfg: EngineConfig, tmp_path: Path
) -> None:
    first = send(spark, cfg, "orders", "made the tables")
    exe = Path(sys.executable).with_name("delayq")
    # No Java at all: a Spark would fail to start, the commit from the command itself does not.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "JAVA_HOME": str(tmp_path / "none")}
    done = subprocess.run(
        [str(exe), "send", "--set", f"lakehouse.path={cfg.lakehouse}", "--set",
         "levels.delays=1s 2s 3s", "--topic", "orders", "--body", "no spark", "--id", "k-1"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "k-1\n" and "starting a Spark" not in done.stderr, done.stderr
    rows = commitlog(spark, cfg).select("msg_id", F.col("body").cast("string")).collect()
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        [(first, "made the tables"), ("k-1", "no spark")]
    )
    # A new lakehouse still needs a Spark to create its tables: the command says so.
    done = subprocess.run(
        [str(exe), "send", "--set", f"lakehouse.path={tmp_path / 'new'}", "--topic", "orders",
         "--body", "x"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "starting a Spark for this command" in done.stderr
    assert f"JAVA_HOME={tmp_path / 'none'} holds no bin/java" in done.stderr, done.stderr
    assert "internal error" not in done.stderr


def test_topics_are_queryable_by_name_from_another_session(
    spark: SparkSession, make_cfg: Any, clock: FakeClock
) -> None:
    cfg = make_cfg(register_tables=True)
    ids = send_many(spark, cfg, [Message("Orders", "a"), Message("audit", "b")], clock)
    Engine(spark, cfg, clock, out=lambda _: None).step()
    other = spark.newSession()
    assert sorted(register_all(other, cfg)) == ["audit", "orders"]
    rows = other.sql(f"SELECT msg_id FROM {cfg.database}.orders").collect()
    assert [r["msg_id"] for r in rows] == ids[:1]
    progress = other.sql(
        f"SELECT max(round) AS r FROM {cfg.database}.delay_offset WHERE status = 'committed'"
    ).first()
    assert progress is not None and progress["r"] == 0
    assert other.sql(f"SELECT count(*) FROM {cfg.database}.commitlog").first()[0] == 2  # type: ignore[index]
