"""The benchmark's chart has a panel for each workload that ran, and no empty ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobs.tools.benchmark import _panels, chart

STEP = {"late_p50_ms": 60, "late_p95_ms": 200, "late_p99_ms": 230, "rate_achieved": 1000}
SETTINGS = {"mode": "quick", "cpu_count": 2, "started_utc": "20260101T000000Z"}


def test_only_the_workloads_that_ran_get_a_panel() -> None:
    assert len(_panels({"steady": [STEP]})) == 1
    backlog = [{**STEP, "backlog": 0, "delivery": {"round_mean_s": 0.03}}]
    restart = [{"backlog": 0, "first_round_s": 19.0}]
    # backlog and restart share a panel; a workload without a chart (wakeup) gets none
    assert len(_panels({"steady": [STEP], "backlog": backlog, "restart": restart})) == 2
    assert _panels({"wakeup": {"polls": 3}}) == []


def test_a_run_without_charted_workloads_still_writes_a_png(tmp_path: Path) -> None:
    results: dict[str, Any] = {"settings": SETTINGS, "workloads": {"wakeup": {"polls": 3}}}
    chart(results, tmp_path / "run.png")
    assert (tmp_path / "run.png").read_bytes().startswith(b"\x89PNG")
