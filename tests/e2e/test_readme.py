"""Every command in the README runs as written, and so does each job's docstring line
(here, or in the test that ``JOB_LINES_RUN_BY`` names).

From a clean environment, as a new user's plain shell at the repository root: only ``HOME``
and ``PATH`` (without the venv), plus ``DELAYQ_CONF`` naming a configuration file that points
``conf/engine.toml``'s defaults at a temporary lakehouse with the short levels ``1s 2s 3s``.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import pytest

from engine.lakehouse.catalog.session import REPO_ROOT
from tests.support.readme import (
    BLOCK_TIMEOUT_S,
    Background,
    PythonSession,
    blocks,
    commands,
    docstring_block,
    plain_env,
    run_shell,
)

pytestmark = pytest.mark.integration

#: Where each job's docstring line runs as written.
JOB_LINES_RUN_BY = {
    "delay_engine.py": "README.md (this file's README check runs the same line)",
    "bench.py": "tests/e2e/test_bench.py",
    "kafka_ingest.py": "tests/integration/test_kafka.py (the restart after a kill -9)",
}


@pytest.fixture
def user_env(tmp_path: Path) -> dict[str, str]:
    """A plain shell's environment (venv not active) on a temporary lakehouse."""
    conf = tmp_path / "engine.toml"
    conf.write_text(
        f'[lakehouse]\npath = "{tmp_path / "lakehouse"}"\n'
        '[levels]\ndelays = "1s 2s 3s"\n'
        '[delivery]\nprogress_interval = "2s"\n'
        '[spark]\nlog_level = "ERROR"\n'
        # names per session: each of the ~20 processes skips opening the embedded metastore
        # (4 s); tests/e2e/test_sql.py runs the default catalog end to end
        '[sql]\ncatalog = "memory"\n'
        '[spark.conf]\n"spark.ui.enabled" = "false"\n'
        '"spark.sql.shuffle.partitions" = "2"\n'
    )
    return plain_env(tmp_path, conf)


def test_readme_blocks_run_as_written(user_env: dict[str, str], tmp_path: Path) -> None:
    found = blocks((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    runnable = [b for b in found if b.illustrative is None]
    assert len(runnable) >= 10, "the README's blocks were not found"
    python = PythonSession(
        str(REPO_ROOT / ".venv" / "bin" / "python"), user_env, REPO_ROOT, tmp_path / "python.log"
    )
    background: Background | None = None
    try:
        for block in runnable:
            where = f"README.md:{block.line}"
            started = time.monotonic()
            if block.stops_background:
                assert background is not None, f"{where}: no background block to stop"
                background.stop()
                background = None
            if block.background_until is not None:
                assert background is None, f"{where}: a second background block"
                background = Background(block, user_env, REPO_ROOT, where, tmp_path / "bg.log")
            elif block.language == "bash":
                run_shell(block, user_env, REPO_ROOT, where)
            else:
                ok, printed = python.run(block.code, BLOCK_TIMEOUT_S)
                assert ok, f"{where}: the Python block failed\n{block.code}\n---\n{printed[-4000:]}"
            print(f"{where} ({block.language}): {time.monotonic() - started:.1f} s", flush=True)
        if background is not None:
            background.stop()
            background = None
    finally:
        if background is not None:
            with contextlib.suppress(AssertionError):
                background.stop()
        python.close()


@pytest.mark.parametrize("job", sorted(JOB_LINES_RUN_BY))
def test_each_job_shows_the_spark_submit_line_a_user_copies(job: str) -> None:
    block = docstring_block(REPO_ROOT / "jobs" / job)
    assert block is not None and "spark-submit" in block.code, f"jobs/{job} shows no command"
    assert commands(block.code)[0] == "source .venv/bin/activate", block.code


def test_every_job_line_is_run_by_a_test() -> None:
    shown = {p.name for p in (REPO_ROOT / "jobs").glob("*.py") if docstring_block(p)}
    assert shown == set(JOB_LINES_RUN_BY), "a job's docstring line that no test runs"


def test_the_engine_jobs_line_is_one_the_readme_check_runs() -> None:
    """jobs/delay_engine.py's line runs in test_readme_blocks_run_as_written: it must stay
    one of the README's runnable lines, or it would run nowhere."""
    block = docstring_block(REPO_ROOT / "jobs" / "delay_engine.py")
    assert block is not None
    readme = blocks((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    run_there = {c for b in readme if b.illustrative is None for c in commands(b.code)}
    missing = [c for c in commands(block.code) if c not in run_there]
    assert not missing, f"jobs/delay_engine.py's lines run by no README block: {missing}"


def test_the_venvs_spark_commands_run_without_activation(tmp_path: Path) -> None:
    """``.venv/bin/spark-submit`` (and ``spark-sql``, ``beeline``, ``pyspark``: one launcher)
    from a plain shell, the venv not activated: Spark is found, and the job runs on the venv's
    Python (PySpark's own launcher asked the python3 on PATH, and failed)."""
    job = tmp_path / "which_python.py"
    job.write_text("import sys, engine\nprint('python:', sys.executable)\n")
    env = plain_env(tmp_path)
    done = subprocess.run(
        [".venv/bin/spark-submit", str(job)],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"python: {REPO_ROOT / '.venv' / 'bin' / 'python'}" in done.stdout, done.stdout
