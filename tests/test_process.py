"""The engine as users run it: a separate process, killed and restarted, stopped with Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from engine.config import EngineConfig
from engine.producer import Message, send_many
from engine.session import REPO_ROOT
from engine.tables import register_topic_tables
from tests.conftest import assert_exactly_once_never_early, delivered_rows

pytestmark = pytest.mark.integration
VENV_BIN = Path(sys.executable).parent
PROPS = REPO_ROOT / ".jars" / "spark-defaults.conf"


def engine_args(cfg: EngineConfig, *extra: str) -> list[str]:
    settings = {
        "lakehouse.path": cfg.lakehouse,
        "lakehouse.database": cfg.database,
        "levels.delays": " ".join(f"{ms // 1000}s" for ms in cfg.levels.delays_ms),
        "delivery.progress_interval": "1s",
        "spark.log_level": "ERROR",
        "spark.conf.spark.ui.enabled": "false",
    }
    return [arg for k, v in settings.items() for arg in ("--set", f"{k}={v}")] + list(extra)


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    return subprocess.Popen(
        args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
        start_new_session=True,  # its own process group: kill the JVM with it
    )  # fmt: skip


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def test_kill_mid_run_then_restart_with_spark_submit(
    spark: SparkSession, make_cfg: Any, tmp_path: Path
) -> None:
    cfg = make_cfg(levels="1s 3s 20s", register_tables=True)
    early = send_many(
        spark, cfg, [Message(f"t{i % 3}", f"a{i}", delay_level=i % 2) for i in range(12)]
    )

    cli = [str(VENV_BIN / "delayq"), "run", *engine_args(cfg, "--show", "0")]
    first = start(cli, tmp_path / "first.log")
    try:
        wait_for(lambda: len(delivered_rows(spark, cfg)) > 0, 120, "the first deliveries")
        # sent while the engine runs; a third wait 20 s, so the kill lands mid-run
        late = send_many(
            spark, cfg, [Message(f"t{i % 3}", f"b{i}", delay_level=1 + i % 3) for i in range(48)]
        )
        wait_for(
            lambda: len(delivered_rows(spark, cfg)) > len(early),
            60,
            "deliveries of the second batch",
        )
        # while the engine runs, topics are queryable by name from this (other) session
        assert register_topic_tables(spark, cfg) == ["t0", "t1", "t2"]
        assert spark.sql(f"SELECT count(*) FROM {cfg.database}.t0").first()[0] > 0  # type: ignore[index]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    ids = early + late
    partial = len(delivered_rows(spark, cfg))
    print(f"\nkilled with {partial} of {len(ids)} delivered")
    assert partial < len(ids), "the kill should land while messages are still pending"

    job = ["jobs/delay_engine.py", *engine_args(cfg, "--until-idle", "--max-seconds", "120")]
    submit = [str(VENV_BIN / "spark-submit"), "--properties-file", str(PROPS), *job]
    second = start(submit, tmp_path / "second.log")
    code = second.wait(240)
    output = (tmp_path / "second.log").read_text()
    assert code == 0, output[-3000:]
    assert "pending none" in output
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)


def test_ctrl_c_stops_cleanly(spark: SparkSession, make_cfg: Any, tmp_path: Path) -> None:
    cfg = make_cfg()
    log = tmp_path / "run.log"
    proc = start([str(VENV_BIN / "delayq"), "run", *engine_args(cfg, "--show", "0")], log)
    try:
        wait_for(lambda: "delivered" in log.read_text(), 120, "a progress line")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert "stopping cleanly" in output
    assert "Traceback" not in output
