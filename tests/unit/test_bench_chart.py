"""The benchmark's chart has a panel for each workload that ran, and no empty ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from jobs.tools.benchmark import CpuTracker, Sample, _cpu_share, _panels, chart, table

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


def test_the_scale_workload_splits_a_phases_cpu_between_driver_and_executors() -> None:
    samples = [
        Sample(ms=0.0, driver_python_s=0.5, driver_jvm_s=0.5, executors_s=0.0, stamped=0),
        Sample(ms=1000.0, driver_python_s=1.0, driver_jvm_s=1.0, executors_s=3.0, stamped=5),
        Sample(ms=2000.0, driver_python_s=1.0, driver_jvm_s=1.5, executors_s=7.0, stamped=10),
    ]
    assert _cpu_share(samples, 0.0, 2000.0) == {
        "seconds": 2.0,
        "driver_cpu_s": 1.5,
        "driver_python_cpu_s": 0.5,
        "executor_cpu_s": 7.0,
        "executor_cpu_share": 0.824,
    }
    assert _cpu_share(samples, 900.0, 2100.0)["executor_cpu_s"] == 4.0  # the nearest samples
    assert _cpu_share(samples, 0.0, None)["executor_cpu_share"] is None  # the phase never ended
    run = {"size": 10, "executor_cpu_share": {"stamp": 0.8, "deliver": None}}
    assert len(_panels({"scale": [{**run, "driver_rss_peak_mb": 900}]})) == 1


def test_the_cpu_of_a_process_that_exited_is_kept() -> None:
    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", busy + "time.sleep(60)"])
    tracker = CpuTracker()
    try:
        for _ in range(100):  # until the child has spent its 0.3 s
            tracker.look([child.pid])
            if tracker.total() >= 0.25:
                break
            subprocess.run(["sleep", "0.1"], check=True)
    finally:
        child.kill()
        child.wait()
    spent = tracker.total()
    assert spent >= 0.25
    tracker.look([child.pid])  # gone: its figure stays
    assert tracker.total() == spent


def test_the_idle_workload_prints_the_drivers_share_of_a_core_as_configured_and_off() -> None:
    runs = [
        {"idle_interval_ms": 1000, "stamp_idle_wait_ms": 500, "seconds": 60.0,
         "driver_cpu_s": 14.5, "driver_cores": 0.242, "delivery_batches": 56},
        {"idle_interval_ms": 0, "stamp_idle_wait_ms": 0, "seconds": 60.0, "driver_cpu_s": 23.5,
         "driver_cores": 0.392, "delivery_batches": 297},
    ]  # fmt: skip
    lines = table({"settings": SETTINGS, "workloads": {"idle": runs}}).splitlines()
    assert (
        "idle, delivery.idle_interval 1000 ms, stamp.idle_wait 500 ms: driver 0.242 of a core "
        "over 60.0 s, 56 delivery batches" in lines
    )
    assert "idle: driver CPU as configured / both off: 0.62" in lines
    assert _panels({"idle": runs}) == []
