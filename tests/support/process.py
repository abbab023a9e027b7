"""Running the project's commands as a user would: the CLI in-process, jobs as processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.cli import main
from engine.core.config import EngineConfig
from engine.lakehouse.catalog.session import REPO_ROOT

VENV_BIN = Path(sys.executable).parent
PROPS = REPO_ROOT / ".jars" / "spark-defaults.conf"


def cli(capsys: pytest.CaptureFixture[str], cfg: EngineConfig, *args: str) -> tuple[int, str, str]:
    """Run ``delayq COMMAND ...`` on ``cfg``'s lakehouse; (exit code, stdout, stderr)."""
    command, *rest = args
    settings = {
        "lakehouse.path": cfg.lakehouse,
        "lakehouse.database": cfg.database,
        "levels.delays": "1s 2s 3s",
    }
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    # a dlq or schedule action takes the overrides after its name (delayq dlq list --set ...)
    words = [command, rest[0], *overrides, *rest[1:]] if command in ("dlq", "schedule") else [
        command, *overrides, *rest
    ]  # fmt: skip
    code = main(words)
    out = capsys.readouterr()
    return code, out.out, out.err


def engine_args(
    cfg: EngineConfig, *extra: str, catalog: str = "memory", queries: bool = False
) -> list[str]:
    """``--set`` arguments that point a job at ``cfg``'s lakehouse and levels, without the
    control endpoint's warm-up.

    Names live in ``catalog``: per session by default, which spares each process the 4 s of
    opening the embedded metastore; tests about names pass ``catalog="embedded"``.

    The stages run on driver threads (``stamp.mode`` and ``delivery.mode = driver``), as the
    in-process tests' engines do (tests/conftest.py): on 2 cores, engine processes on the
    default queries took the suite from 17 to 24 minutes (each micro-batch's planning and
    checkpoint entries, five a second, beside the other worker's tests). Tests about the
    queries, their stop, kills and fencing, pass ``queries=True`` for the default; the README
    check and the notebook run the default as users do.
    """
    settings = {
        "lakehouse.path": cfg.lakehouse,
        "lakehouse.database": cfg.database,
        "levels.delays": " ".join(f"{ms // 1000}s" for ms in cfg.levels.delays_ms),
        "delivery.progress_interval": "1s",
        "spark.log_level": "ERROR",
        "spark.conf.spark.ui.enabled": "false",
        "sql.catalog": catalog,
        # The reading commands run once at start make a user's first command quick: 12 of
        # an engine start's 23 CPU-s here, paid by each of the suite's engine processes on 2
        # cores. Commands work the same without (a first one pays its Spark reads); the README
        # check's engines keep the default.
        "control.warm_up": "false",
    }
    if not queries:
        settings.update({"stamp.mode": "driver", "delivery.mode": "driver"})
    if cfg.on_object_store:  # credentials come from the environment (start(..., env=...))
        settings["storage.s3.endpoint"] = cfg.s3_endpoint
    return [arg for k, v in settings.items() for arg in ("--set", f"{k}={v}")] + list(extra)


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a process in its own process group (so the JVM dies with it), output to ``log``;
    ``env`` adds to the environment (an S3 server's credentials)."""
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        **(env or {}),
    }
    return subprocess.Popen(
        args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
        start_new_session=True,
    )  # fmt: skip


def run_to_end(args: list[str], log: Path, timeout: float = 240) -> int:
    """Run a process as :func:`start` does and return its exit code; its group (the JVM too)
    is killed if it outlives ``timeout``."""
    proc = start(args, log)
    try:
        return int(proc.wait(timeout))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.5 s until it is true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
