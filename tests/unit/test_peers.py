"""The RocketMQ side-by-side report: which broker runs match a benchmark, and the table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jobs.tools import peers

RESULTS: dict[str, Any] = {
    "workloads": {
        "steady": [
            {
                "rate_target": 1000, "seconds": 20, "rate_achieved": 990, "late_p50_ms": 3000,
                "late_p99_ms": 4500, "late_max_ms": 5000, "early": 0, "duplicates": 0,
                "missing": 0, "memory_peak": {"jvm_rss_mb": 3000.0},
            },
            {
                "rate_target": 10000, "seconds": 20, "rate_achieved": 9800, "late_p50_ms": 4000,
                "late_p99_ms": 6000, "late_max_ms": 7000, "early": 0, "duplicates": 0,
                "missing": 0, "memory_peak": {},
            },
        ],
        "spike": {
            "size": 1_000_000, "last_visible_after_instant_s": 2.1,
            "spike": {"late_p50_ms": 2100, "late_p99_ms": 2100, "early": 0, "duplicates": 0,
                      "missing": 0},
        },
    }
}  # fmt: skip


def broker_line(mode: str, p99: int) -> dict[str, Any]:
    return {
        "mode": mode, "lateness_ms": {"p50": p99 // 2, "p99": p99, "max": p99 + 10},
        "early": 0, "duplicates": 0, "missing": 0, "send_rate_achieved": 999.0,
        "spike_last_after_T_ms": 700, "spike_valid": True,
    }  # fmt: skip


def test_each_steady_rate_gets_timers_and_the_first_also_the_1s_level() -> None:
    runs = peers.peer_runs(RESULTS)

    assert [(r.label, r.kind) for r in runs] == [
        ("steady 1,000/s", "level 1 s"),
        ("steady 1,000/s", "timers"),
        ("steady 10,000/s", "timers"),
        ("spike 1,000,000", "spike"),
    ]
    assert runs[1].args == (
        "timer", "--rate", "1000", "--duration", "20", "--delay-min-ms", "1000",
        "--delay-max-ms", "3000",
    )  # fmt: skip
    # the broker sends ~7k msg/s: the instant comes after the last of 1M sends
    assert runs[3].args == ("spike", "--count", "1000000", "--lead-ms", "240000")


def test_quick_compares_the_first_rate_only() -> None:
    assert [r.kind for r in peers.peer_runs(RESULTS, quick=True)] == ["level 1 s", "timers"]


def test_the_table_pairs_each_broker_run_with_the_engine_row_and_the_ratio() -> None:
    runs = peers.peer_runs(RESULTS)
    lines = {"level": 150, "timer": 1100, "spike": 700}

    rows = peers.compare(
        RESULTS, runs, lambda r: broker_line(r.args[0], lines[r.args[0]]), say=lambda _: None
    )
    text = peers.table(rows)

    assert rows[0]["p99_ratio"] == 30.0  # 4500 ms against 150 ms
    assert rows[3]["delayq"]["last_ms"] == 2100
    assert (
        "| steady 10,000/s | timers | 4000 / 6000 | 550 / 1100 | 5.5x | 9,800 / 999 "
        "| 0/0/0 | 0/0/0 |"
    ) in text


def test_a_failed_broker_run_is_a_row_without_figures() -> None:
    runs = peers.peer_runs(RESULTS, quick=True)

    rows = peers.compare(RESULTS, runs, lambda r: None, say=lambda _: None)

    assert [r["rocketmq"] for r in rows] == [None, None]
    assert "| - |" in peers.table(rows)


def test_a_missing_harness_is_named(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "x.json").write_text(json.dumps(RESULTS))

    code = peers.main(["--harness", str(tmp_path / "nowhere"), "--out", str(tmp_path)])

    assert code == 2
    assert "no RocketMQ peer harness at" in capsys.readouterr().err


def test_workloads_pick_what_is_compared() -> None:
    runs = peers.peer_runs(RESULTS, workloads=["spike"])

    assert [r.kind for r in runs] == ["spike"]
