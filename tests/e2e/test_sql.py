"""SQL from other tools, as users run them: beeline (JDBC) and Spark Connect clients while the
engine serves SQL, then `spark-sql` and a new Python session on the names the engine kept.

One engine (spark-submit, `sql.server.enabled`) serves the whole module.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from engine.core.config import EngineConfig
from engine.core.levels import parse_levels
from engine.lakehouse.catalog.metastore import hive_conf, metastore_path
from engine.lakehouse.catalog.session import REPO_ROOT
from engine.produce.send import Message, send_many
from engine.run.sql_server import address_file
from tests.support.lakehouse import TEST_SPARK_CONF, delivered_rows
from tests.support.process import PROPS, VENV_BIN, engine_args, start, wait_for

pytestmark = pytest.mark.integration

DB = "sqltest"


@dataclass
class Served:
    cfg: EngineConfig
    engine: subprocess.Popen[bytes]
    log: Path
    jdbc: str
    connect: str
    sent: list[str]
    #: the ids in the topic table ``orders``: the five sent before the start, and the one
    #: ``test_beeline_...`` sends through JDBC once it has (tests may run alone)
    orders: list[str]


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}


def _run(args: list[str], timeout: float = 180) -> str:
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO_ROOT
    )
    output = done.stdout + done.stderr
    # The error's own line first: a Spark Connect client's output ends in a JVM stack trace.
    said = [line for line in output.splitlines() if "Exception:" in line or "Error:" in line]
    assert done.returncode == 0, "\n".join(said[:5]) + "\n...\n" + output[-2000:]
    return done.stdout


def _python(code: str) -> str:
    return _run([sys.executable, "-c", textwrap.dedent(code)])


@pytest.fixture(scope="module")
def served(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("sql")
    cfg = EngineConfig(
        lakehouse=str(folder / "lakehouse"),
        database=DB,
        levels=parse_levels("1s 2s 3s"),
        register_tables=False,
        log_level="ERROR",
        spark_conf=TEST_SPARK_CONF,
    )
    sent = send_many(
        spark,
        cfg,
        [Message("orders", f"o{i}", keys=[f"order-{i}"], delay_level=1) for i in range(5)]
        + [Message("audit", "a0", delay_level=0)],
    )
    log = folder / "engine.log"
    settings = engine_args(
        cfg,
        "--set", "sql.server.enabled=true",
        "--set", "sql.server.jdbc_port=0",
        "--set", "sql.server.connect_port=0",
        catalog="embedded",
    )  # fmt: skip
    job = [str(VENV_BIN / "spark-submit"), "--properties-file", str(PROPS)]
    engine = start([*job, "jobs/delay_engine.py", *settings], log)
    try:
        wait_for(lambda: os.path.exists(address_file(cfg)), 180, "the SQL server's address file")
        wait_for(lambda: len(delivered_rows(spark, cfg)) == 6, 120, "the first deliveries")
        addresses = json.loads(Path(address_file(cfg)).read_text())
        orders = sent[:5]
        yield Served(cfg, engine, log, addresses["jdbc"], addresses["connect"], sent, orders)
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
            engine.wait(30)


def test_the_engine_says_where_sql_is_served_on_loopback(served: Served) -> None:
    output = served.log.read_text()
    assert f"delayq: SQL at {served.jdbc} (JDBC) and {served.connect} (Spark Connect)" in output
    for url in (served.jdbc, served.connect):
        port = int(url.rsplit(":", 1)[1])
        assert _listening(port) == {"127.0.0.1"}, f"{url}: listening on {_listening(port)}"


def _listening(port: int) -> set[str]:
    """The local addresses with a socket listening on ``port`` (from the kernel's tables)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            if address.endswith("0100007F"):  # 127.0.0.1 (also as ::ffff:127.0.0.1)
                found.add("127.0.0.1")
            else:
                found.add(address)
    return found


def test_status_shows_the_sql_addresses(served: Served) -> None:
    output = _run(
        [str(VENV_BIN / "delayq"), "status", "--set", f"lakehouse.path={served.cfg.lakehouse}"]
    )
    assert f"sql         {served.jdbc} (JDBC), {served.connect} (Spark Connect)" in output


def _answers(served: Served, sql: str) -> bool:
    """Whether beeline runs ``sql`` without an error."""
    args = ["beeline", "-u", served.jdbc, "--silent=true", "--outputformat=csv2", "-e", sql]
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=180, env=_env(), cwd=REPO_ROOT
    )
    return done.returncode == 0


def test_beeline_reads_topics_and_views_and_sends_with_insert(served: Served) -> None:
    def beeline(sql: str) -> list[str]:
        args = ["beeline", "-u", served.jdbc, "--silent=true", "--outputformat=csv2", "-e", sql]
        return _run(args).split()[-2:]  # the header and the one value, after the prompt

    assert beeline(f"SELECT count(*) AS n FROM {DB}.orders") == ["n", "5"]
    # The checkpoint views are named after the round that first committed progress, some
    # seconds after its rows became visible (each name is a metastore write).
    wait_for(lambda: _answers(served, f"SELECT count(*) AS p FROM {DB}.pending"), 60, "views")
    assert beeline(f"SELECT count(*) AS p FROM {DB}.pending") == ["p", "0"]
    # a send through JDBC: an INSERT into commitlog, delivered by the engine like any other
    beeline(
        f"INSERT INTO {DB}.commitlog (msg_id, topic, body, delay_level, store_ts) VALUES "
        "('jdbc-1', 'orders', CAST('via jdbc' AS BINARY), 1, current_timestamp())"
    )
    served.orders.append("jdbc-1")  # sent: the later tests count it (delivered below)
    wait_for(
        lambda: (
            beeline(f"SELECT count(*) AS d FROM {DB}.orders WHERE msg_id = 'jdbc-1'") == ["d", "1"]
        ),
        60,
        "the message sent through JDBC to be delivered",
    )


def test_a_spark_connect_client_queries_the_views_by_name(served: Served) -> None:
    # a plain Python with pyspark[connect]: no JVM of its own
    output = _python(
        f"""
        from pyspark.sql import SparkSession
        spark = SparkSession.builder.remote("{served.connect}").getOrCreate()
        print("orders", spark.table("{DB}.orders").count())
        history = spark.sql(
            "SELECT event FROM {DB}.history WHERE array_contains(keys, 'order-1') ORDER BY at"
        )
        print("history", ",".join(r.event for r in history.collect()))
        print("forecast", spark.table("{DB}.due_forecast").count())
        """
    )
    assert "history sent,stamped,delivered" in output
    assert "forecast 0" in output
    assert int(output.split("orders ", 1)[1].split()[0]) == len(served.orders)


def test_pyspark_remote_shell(served: Served) -> None:
    script = f'print("audit rows", spark.table("{DB}.audit").count())\n'
    env = {**_env(), "PYSPARK_DRIVER_PYTHON_OPTS": "-i"}  # the shell, reading this script
    done = subprocess.run(
        ["pyspark", "--remote", served.connect],
        input=script, capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    assert "audit rows 1" in done.stdout, (done.stdout + done.stderr)[-3000:]


def test_a_python_session_while_the_engine_holds_the_metastore_names_tables_itself(
    served: Served,
) -> None:
    output = _run(
        [
            sys.executable, "-c", textwrap.dedent(f"""
            from engine.core.config import load_config
            from engine.lakehouse.catalog.session import build_spark
            cfg = load_config(overrides={{
                "lakehouse.path": {served.cfg.lakehouse!r}, "lakehouse.database": "{DB}",
                "spark.conf.spark.ui.enabled": "false",
            }})
            spark = build_spark(cfg)
            print("catalog", spark.conf.get("spark.sql.catalogImplementation"))
            print("orders", spark.table("{DB}.orders").count())
            """),
        ]
    )  # fmt: skip
    assert "catalog in-memory" in output
    assert int(output.split("orders ", 1)[1].split()[0]) == len(served.orders)


def test_spark_sql_on_the_metastore_the_engine_holds_says_so_in_one_line(served: Served) -> None:
    """A plain ``spark-sql`` on the engine's metastore fails at once, in one line naming the
    engine's SQL endpoint (before: about 30 s, then thousands of lines of Derby's trace)."""
    conf = hive_conf(metastore_path(served.cfg), f"{served.cfg.lakehouse_path}/_warehouse")
    settings = [arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}")]
    env = {k: v for k, v in _env().items() if k != "SPARK_HOME"}  # the venv's launcher
    query = f"SELECT * FROM {DB}.orders"
    done = subprocess.run(
        ["spark-sql", "--properties-file", str(PROPS), *settings, "-e", query],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 3, lines[-20:]
    assert len(lines) == 1, lines[:20]  # (no JVM started: no Spark or Derby line)
    assert served.jdbc in lines[0] and served.cfg.lakehouse_path in lines[0], lines[0]


def test_after_the_engine_stops_spark_sql_and_a_new_session_see_the_kept_names(
    served: Served,
) -> None:
    os.killpg(served.engine.pid, signal.SIGINT)
    assert served.engine.wait(60) == 0, served.log.read_text()[-3000:]
    assert not os.path.exists(address_file(served.cfg))

    conf = hive_conf(metastore_path(served.cfg), f"{served.cfg.lakehouse_path}/_warehouse")
    settings = [arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}")]
    started = time.monotonic()
    output = _run(
        ["spark-sql", "--properties-file", str(PROPS), *settings, "--conf",
         "spark.ui.enabled=false", "-e", f"SELECT count(*) FROM {DB}.orders; SHOW TABLES IN {DB}"]
    )  # fmt: skip
    print(f"\nspark-sql answered in {time.monotonic() - started:.1f}s")
    lines = output.split()
    # five sent before the start, and (the whole module run) one through JDBC: 6
    assert int(lines[0]) == len(served.orders), served.orders
    assert {"audit", "orders", "commitlog", "pending", "history", "delay_offset"} <= set(lines)

    # a new session that registers nothing sees the same names
    output = _python(
        f"""
        from engine.core.config import load_config
        from engine.lakehouse.catalog.session import build_spark
        cfg = load_config(overrides={{
            "lakehouse.path": {served.cfg.lakehouse!r}, "lakehouse.database": "{DB}",
            "sql.register_tables": "false", "spark.conf.spark.ui.enabled": "false",
        }})
        spark = build_spark(cfg)
        print("audit", spark.sql("SELECT count(*) FROM {DB}.audit").first()[0])
        """
    )
    assert "audit 1" in output
