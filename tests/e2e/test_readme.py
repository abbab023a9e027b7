"""Every command in the README runs as written, and so does each job's docstring line
(in the test that ``JOB_LINES_RUN_BY`` names); tests/e2e/test_doc_pages.py runs the docs
pages' blocks.

From a clean environment, as a new user's plain shell at the repository root: only ``HOME``
and ``PATH`` (without the venv), plus ``DELAYQ_CONF`` naming a configuration file that points
``conf/engine.toml``'s defaults at a temporary lakehouse with the short levels ``1s 2s 3s``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from engine.lakehouse.catalog.session import REPO_ROOT
from tests.support.readme import blocks, commands, docstring_block, page_env, plain_env, run_page

pytestmark = pytest.mark.integration

#: Where each job's docstring line runs as written.
JOB_LINES_RUN_BY = {
    "delay_engine.py": "docs/pages/operations/running.md (tests/e2e/test_doc_pages.py)",
    "bench.py": "tests/e2e/test_bench.py",
    "kafka_ingest.py": "tests/integration/test_kafka.py (the restart after a kill -9)",
}


def test_readme_blocks_run_as_written(tmp_path: Path) -> None:
    ran = run_page(REPO_ROOT / "README.md", page_env(tmp_path), REPO_ROOT, tmp_path)
    assert ran >= 5, "the README's blocks were not found"


@pytest.mark.parametrize("job", sorted(JOB_LINES_RUN_BY))
def test_each_job_shows_the_spark_submit_line_a_user_copies(job: str) -> None:
    block = docstring_block(REPO_ROOT / "jobs" / job)
    assert block is not None and "spark-submit" in block.code, f"jobs/{job} shows no command"
    assert commands(block.code)[0] == "source .venv/bin/activate", block.code


def test_every_job_line_is_run_by_a_test() -> None:
    shown = {p.name for p in (REPO_ROOT / "jobs").glob("*.py") if docstring_block(p)}
    assert shown == set(JOB_LINES_RUN_BY), "a job's docstring line that no test runs"


def test_the_engine_jobs_line_is_one_the_page_check_runs() -> None:
    """jobs/delay_engine.py's line runs where the docs page on running the engine shows it
    (tests/e2e/test_doc_pages.py): it must stay one of that page's runnable lines, or it
    would run nowhere."""
    block = docstring_block(REPO_ROOT / "jobs" / "delay_engine.py")
    assert block is not None
    page = REPO_ROOT / "docs" / "pages" / "operations" / "running.md"
    found = blocks(page.read_text(encoding="utf-8"))
    run_there = {c for b in found if b.illustrative is None for c in commands(b.code)}
    missing = [c for c in commands(block.code) if c not in run_there]
    assert not missing, f"jobs/delay_engine.py's lines run by no block of {page.name}: {missing}"


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
