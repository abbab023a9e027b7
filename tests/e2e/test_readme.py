"""Every command in the README, and in the jobs' docstrings, runs as written.

From a clean environment, as a new user's plain shell at the repository root: only ``HOME``
and ``PATH`` (without the venv), plus ``DELAYQ_CONF`` naming a configuration file that points
``conf/engine.toml``'s defaults at a temporary lakehouse with the short levels ``1s 2s 3s``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.lakehouse.session import REPO_ROOT
from tests.support.readme import Block, PythonSession, blocks, shell_script

pytestmark = pytest.mark.integration

#: Job docstrings whose lines are not run here, and why.
JOBS_ELSEWHERE = {
    "bench.py": "tests/e2e/test_bench.py runs it (smoke plan) through spark-submit",
    "kafka_ingest.py": "needs a broker; tests/integration/test_kafka.py runs it with spark-submit",
}
BLOCK_TIMEOUT_S = 600


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
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    return {"HOME": os.environ.get("HOME", str(tmp_path)), "PATH": path, "DELAYQ_CONF": str(conf)}


def run_shell(block: Block, env: dict[str, str], where: str) -> None:
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", shell_script(block)],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=BLOCK_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, (
        f"{where}: the shell block failed\n{block.code}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-3000:]}"
    )
    assert "Traceback" not in done.stdout + done.stderr, f"{where}: a stack trace\n{done.stderr}"


def test_readme_blocks_run_as_written(user_env: dict[str, str], tmp_path: Path) -> None:
    found = blocks((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    runnable = [b for b in found if b.illustrative is None]
    assert len(runnable) >= 10, "the README's blocks were not found"
    python = PythonSession(
        str(REPO_ROOT / ".venv" / "bin" / "python"), user_env, REPO_ROOT, tmp_path / "python.log"
    )
    try:
        for block in runnable:
            where = f"README.md:{block.line}"
            started = time.monotonic()
            if block.language == "bash":
                run_shell(block, user_env, where)
            else:
                ok, printed = python.run(block.code, BLOCK_TIMEOUT_S)
                assert ok, f"{where}: the Python block failed\n{block.code}\n---\n{printed[-4000:]}"
            print(f"{where} ({block.language}): {time.monotonic() - started:.1f} s", flush=True)
    finally:
        python.close()


def docstring_block(path: Path) -> Block | None:
    """The literal ``::`` block of a job's docstring (the line a user copies)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith("::"):
            body = []
            for text in lines[i + 1 :]:
                if text.strip() and not text.startswith("    "):
                    break
                body.append(text[4:])
            return Block("bash", "\n".join(body).strip() + "\n", i + 1)
    return None


def _commands(code: str) -> list[str]:
    joined = code.replace("\\\n", " ")
    return [" ".join(line.split()) for line in joined.splitlines() if line.strip()]


@pytest.mark.parametrize("job", ["delay_engine.py", "bench.py", "kafka_ingest.py"])
def test_job_docstring_lines_run_as_written(job: str, user_env: dict[str, str]) -> None:
    block = docstring_block(REPO_ROOT / "jobs" / job)
    assert block is not None and "spark-submit" in block.code, f"jobs/{job} shows no command"
    if job in JOBS_ELSEWHERE:
        pytest.skip(JOBS_ELSEWHERE[job])
    readme = blocks((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    run_there = {c for b in readme if b.illustrative is None for c in _commands(b.code)}
    if set(_commands(block.code)) <= run_there:
        return  # the same lines run in a README block (test_readme_blocks_run_as_written)
    run_shell(block, user_env, f"jobs/{job}")
