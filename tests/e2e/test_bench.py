"""The benchmark's docstring line (jobs/bench.py: the smoke plan's steady and spike
workloads) runs as written from a plain shell, and writes its JSON, chart and table; `make
bench` runs every workload, and its quick run is what the README reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.lakehouse.catalog.session import REPO_ROOT
from tests.support.readme import docstring_block, plain_env, run_shell

pytestmark = pytest.mark.integration
OUT = REPO_ROOT / "bench" / "out"


def test_bench_smoke_writes_json_chart_and_table(tmp_path: Path) -> None:
    block = docstring_block(REPO_ROOT / "jobs" / "bench.py")
    assert block is not None and "--mode smoke" in block.code
    before = set(OUT.glob("*")) if OUT.is_dir() else set()
    try:
        printed = run_shell(block, plain_env(tmp_path), REPO_ROOT, "jobs/bench.py")
        made = set(OUT.glob("*")) - before
        assert "workload" in printed and "spike 10,000" in printed, printed[-3000:]
        (result,) = [p for p in made if p.name.endswith("-smoke.json")]
        assert result.with_suffix(".png").stat().st_size > 10_000
        work = json.loads(result.read_text())["workloads"]
        (step,) = work["steady"]
        for run in (step, work["spike"]["spike"], work["spike"]["after_1s"]):
            assert (run["early"], run["duplicates"], run["missing"]) == (0, 0, 0), run
        assert step["delivered"] == step["sent"] > 0
        assert step["delivery"]["rounds"] > 0 and step["memory_peak"]["jvm_heap_used_mb"] > 0
        assert not [p for p in made if p.name.startswith("lakehouse-")], "bench lakehouses left"
    finally:
        for path in set(OUT.glob("*-smoke.*")) - before:
            path.unlink()
