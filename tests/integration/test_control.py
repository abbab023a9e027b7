"""``delayq`` commands carried out by a running engine, against the same commands run here.

One engine (``delayq run`` in its own process) runs for the module; each command is run
through it (the fast path) and with ``--local`` (a run in this process, as without an engine),
and both must print the same and exit the same.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import engine.control.remote as remote
from engine.control.endpoint import endpoint_file
from engine.core.config import EngineConfig
from engine.core.levels import parse_levels
from engine.lakehouse.delta.delta_log import list_topics
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from tests.support.lakehouse import TEST_SPARK_CONF
from tests.support.process import VENV_BIN, cli, engine_args, start, wait_for
from tests.support.scrape import scrape

pytestmark = pytest.mark.integration

#: A command's id differs between two runs of it.
COMMAND_ID = re.compile(r"command [0-9A-F]{32}")


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineConfig]:
    """An engine answering commands on a lakehouse of its own, for the whole module."""
    root = tmp_path_factory.mktemp("control")
    cfg = EngineConfig(
        lakehouse=str(root / "lakehouse"),
        database=f"t_{uuid.uuid4().hex[:8]}",
        levels=parse_levels("1s 2s 3s"),
        register_tables=False,
        log_level="ERROR",
        spark_conf=TEST_SPARK_CONF,
    )
    # No idle checkpoint flush during the module: `status` shows the same watermark twice.
    # The warm-up on, as a user's engine has it: the module's first commands meet it running.
    settings = engine_args(
        cfg, "--set", "delivery.checkpoint_flush_interval=1h", "--set", "control.warm_up=true"
    )
    log = root / "engine.log"
    proc = start([str(VENV_BIN / "delayq"), "run", *settings], log)
    try:
        wait_for(
            lambda: os.path.exists(endpoint_file(cfg)) or proc.poll() is not None, 240, "engine"
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        yield cfg
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not os.path.exists(endpoint_file(cfg)), "a stopped engine removes its control.json"


@pytest.fixture
def via_engine(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the commands the engine answered."""
    answered: list[int] = []
    real = remote.call

    def counting(*args: Any, **kwargs: Any) -> Any:
        reply = real(*args, **kwargs)
        if reply is not None:
            answered.append(reply.code)
        return reply

    monkeypatch.setattr(remote, "call", counting)
    return answered


def _rows(spark: SparkSession, path: str) -> int:
    """Rows in the Delta table at ``path``; -1 before its first commit (a round stages a new
    topic's files in its folder before the commit that makes the table)."""
    if not Path(path).exists():
        return -1
    try:
        return int(spark.read.format("delta").load(path).count())
    except AnalysisException:
        return -1


def both(capsys: pytest.CaptureFixture[str], cfg: EngineConfig, *args: str) -> tuple[Any, Any]:
    """(exit code, output) through the engine, and run here with ``--local``."""
    fast = cli(capsys, cfg, *args)
    local = cli(capsys, cfg, *args, "--local")
    return (fast[0], COMMAND_ID.sub("command <id>", fast[1])), (
        local[0], COMMAND_ID.sub("command <id>", local[1])
    )  # fmt: skip


def test_commands_print_the_same_through_the_engine_as_run_here(
    spark: SparkSession,
    running: EngineConfig,
    capsys: pytest.CaptureFixture[str],
    via_engine: list[int],
) -> None:
    cfg = running
    late = Message("orders", "later", keys=["k-late"], delay=timedelta(hours=1))
    ids = send_many(spark, cfg, [Message("orders", f"now {i}", keys=[f"k{i}"]) for i in range(3)])
    ids += send_many(spark, cfg, [late, Message("audit", "much later", delay=timedelta(hours=2))])
    topic = layout(cfg).topic("orders")
    wait_for(lambda: _rows(spark, topic) == 3,
             120, "the due messages delivered")  # fmt: skip

    code, out, err = cli(capsys, cfg, "send", "--topic", "audit", "--body", "x", "--id", "fixed")
    assert (code, out, err) == (0, "fixed\n", ""), "sent through the engine, no note"
    assert len(via_engine) == 1
    audit = layout(cfg).topic("audit")
    wait_for(lambda: _rows(spark, audit) == 1,
             120, "the message sent through the engine delivered")  # fmt: skip
    commands = [
        ["status"],
        ["topics"],
        ["pending"],
        ["pending", "--topic", "orders", "--key", "k-late"],
        ["forecast", "--minutes", "150"],
        ["history", "--id", ids[0]],
        ["history", "--key", "k-late"],
        ["lag"],
        ["sql", f"SELECT topic, count(*) AS n FROM {cfg.database}.commitlog GROUP BY topic "
                "ORDER BY topic"],
        ["dlq", "list", "--group", "billing"],
        ["cancel", "--id", "NO-SUCH-ID", "--wait", "20"],
        ["status", "--set", "levels.delays=1s 2x"],  # a mistake: exit 2, the same message
    ]  # fmt: skip
    for command in commands:
        fast, local = both(capsys, cfg, *command)
        assert fast == local, f"delayq {' '.join(command)}"
    assert "k-late" in both(capsys, cfg, "pending", "--key", "k-late")[0][1]
    assert len(via_engine) == 1 + len(commands) - 1 + 1, "all but the mistake went to the engine"

    # A command gets a session of its own: a SET does not stay in the engine's session.
    setting = "spark.sql.shuffle.partitions"
    assert cli(capsys, cfg, "sql", f"SET {setting}=77")[0] == 0
    assert "|77 " not in cli(capsys, cfg, "sql", f"SET {setting}")[1]
    # A file the caller cannot read is reported by the caller, as a local run would.
    code, _, err = cli(capsys, cfg, "cancel", "--file", "no-such-ids.txt")
    assert (code, err) == (2, "delayq: error: cannot read --file no-such-ids.txt: No such file "
                              "or directory\n")  # fmt: skip


def test_cancel_and_reschedule_many_ids_in_one_call(
    spark: SparkSession,
    running: EngineConfig,
    capsys: pytest.CaptureFixture[str],
    via_engine: list[int],
    tmp_path: Path,
) -> None:
    cfg = running
    later = [Message("batch", f"m{i}", delay=timedelta(hours=1)) for i in range(103)]
    ids = send_many(spark, cfg, later)
    cancelled, moved = ids[:100], ids[100:]
    listing = tmp_path / "ids.txt"
    listing.write_text("\n".join(cancelled) + "\n\n")

    code, out, _ = cli(capsys, cfg, "cancel", "--file", str(listing))
    assert code == 0, out
    lines = [line for line in out.splitlines() if not line.startswith("  ")]
    assert [line.split(":")[0] for line in lines] == cancelled
    assert all(": cancelled 1 message(s) (command " in line for line in lines)
    command_ids = re.findall(r"command ([0-9A-F]{32})", out)
    results = (
        spark.read.format("delta").load(layout(cfg).command_results)
        .where(F.col("command_id").isin(command_ids))
        .groupBy("command_id").count().collect()
    )  # fmt: skip
    assert len(results) == 100 and {r["count"] for r in results} == {1}, "each decided once"

    code, out, _ = cli(capsys, cfg, "cancel", "--id", cancelled[0], "--id", cancelled[1])
    assert code == 1 and out.count(": already_cancelled: ") == 2, out

    moves = tmp_path / "moves.txt"
    moves.write_text(f"{moved[0]} 2h\n{moved[1]}\n{moved[2]} 2099-01-01T00:00:00Z\n")
    code, out, err = cli(capsys, cfg, "reschedule", "--file", str(moves), "--delay", "3h")
    assert code == 2 and out == "", "2099 is beyond messages.max_delay: nothing is issued"
    assert "max_delay" in err and f"(message {moved[2]})" in err, err
    moves.write_text(f"{moved[0]} 2h\n{moved[1]}\n")
    code, out, _ = cli(capsys, cfg, "reschedule", "--file", str(moves), "--delay", "3h")
    assert code == 0 and out.count(": rescheduled 1 message(s)") == 2, out
    assert via_engine == [0, 1, 2, 0], "all four went to the engine"


def test_a_running_engine_serves_metrics_that_match_its_tables(
    spark: SparkSession, running: EngineConfig
) -> None:
    cfg = running
    log = (Path(cfg.lakehouse).parent / "engine.log").read_text()
    found = re.search(r"Prometheus metrics at (http://127\.0\.0\.1:\d+/metrics)", log)
    assert found, log[-3000:]
    send_many(spark, cfg, [Message("metered", f"m{i}") for i in range(4)])
    topic = layout(cfg).topic("metered")
    wait_for(lambda: _rows(spark, topic) == 4,
             120, "the messages delivered")  # fmt: skip

    # The round counts its rows once it has committed its progress, just after the topic's
    # commit: a scrape in between still shows the last round's figures.
    key = ("delayq_delivered_total", (("topic", "metered"),))
    wait_for(lambda: scrape(found.group(1)).get(key) == 4, 30, "the round counted")
    got = scrape(found.group(1))
    # Every topic row of this lakehouse was delivered by this engine, and counted.
    in_tables = sum(
        spark.read.format("delta").load(layout(cfg).topic(name)).count()
        for name in list_topics(cfg)
    )
    counted = sum(v for (name, _), v in got.items() if name == "delayq_delivered_total")
    assert counted == in_tables == got[("delayq_delivery_lateness_seconds_count", ())]
    assert got[("delayq_rounds_total", ())] >= got[("delayq_rounds_committed_total", ())] > 0


def test_without_an_engine_a_command_says_it_starts_a_spark(tmp_path: Path) -> None:
    lakehouse = tmp_path / "lakehouse"
    stale = Path(endpoint_file(EngineConfig(lakehouse=str(lakehouse))))
    stale.parent.mkdir(parents=True)
    stale.write_text(
        '{"url": "http://127.0.0.1:9", "token": "t", "host": "elsewhere", "pid": 1, '
        '"since": "2026-01-01T00:00:00+00:00", "lakehouse": "x"}'
    )  # an engine that left its file behind, on no port that answers
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(
        [str(VENV_BIN / "delayq"), "status", "--set", f"lakehouse.path={lakehouse}",
         "--set", "spark.log_level=ERROR"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"no engine is running on {lakehouse}: starting a Spark" in done.stderr
    assert done.stderr.count("no engine is running") == 1
    assert "sent        0" in done.stdout
