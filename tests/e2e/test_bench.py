"""The benchmark runs from the spark-submit line `make bench` uses (tiny smoke plan: two
workloads; `make bench` runs them all, and its quick run is what the README reports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.lakehouse.session import REPO_ROOT

pytestmark = pytest.mark.integration
PROPS = REPO_ROOT / ".jars" / "spark-defaults.conf"


def test_bench_smoke_writes_json_chart_and_table(tmp_path: Path) -> None:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    done = subprocess.run(
        [str(Path(sys.executable).with_name("spark-submit")), "--properties-file", str(PROPS),
         "jobs/bench.py", "--mode", "smoke", "--workloads", "steady,spike",
         "--out", str(tmp_path), "--set", "spark.log_level=ERROR",
         "--set", "spark.conf.spark.ui.enabled=false"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "workload" in done.stdout and "spike 10,000" in done.stdout
    (result,) = tmp_path.glob("*-smoke.json")
    assert result.with_suffix(".png").stat().st_size > 10_000
    work = json.loads(result.read_text())["workloads"]
    (step,) = work["steady"]
    for run in (step, work["spike"]["spike"], work["spike"]["after_1s"]):
        assert (run["early"], run["duplicates"], run["missing"]) == (0, 0, 0), run
    assert step["delivered"] == step["sent"] > 0
    assert step["delivery"]["rounds"] > 0 and step["memory_peak"]["jvm_heap_used_mb"] > 0
    assert not list(tmp_path.glob("lakehouse-*")), "the bench lakehouses are removed"
