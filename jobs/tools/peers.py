"""Side by side with Apache RocketMQ: the same workloads on a RocketMQ 5.5 broker, one table.

``make bench-peers`` (or ``make bench WITH_PEERS=1``) runs, after the engine's benchmark,
the RocketMQ peer harness (``PEERS``, by default ``../shared/peers/rocketmq``: it starts a
broker from Maven Central jars on this machine and measures lateness as a consumer sees it)
on the workloads the newest ``bench/out/*.json`` holds, then prints both with the ratio
``delayq / RocketMQ`` (above 1: the engine is later) and writes ``<stem>-peers.json`` and
``<stem>-peers.png`` next to it.

What runs on the broker for each engine workload:

* ``steady`` at R msg/s (the engine: half levels 1-3 s, half timers due 0-3 s): timer
  messages due 1-3 s after the send at R msg/s for the same seconds, and at the first rate
  also the fixed 1 s level;
* ``spike`` of N due at one instant: N timer messages due at one instant.

The two measure lateness from slightly different points: the engine from the Delta commit
that makes a row visible, RocketMQ from the moment its consumer receives the message.

Example:
    $ make bench-peers
    $ .venv/bin/python -m jobs.tools.peers --harness ../shared/peers/rocketmq --quick
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The harness's default, relative to the repository root.
DEFAULT_HARNESS = "../shared/peers/rocketmq"


@dataclass(frozen=True)
class PeerRun:
    """One broker run: what it is compared with and the harness arguments.

    Attributes:
        label: the row of the table (e.g. ``steady 1,000/s``).
        kind: ``timers`` or ``level 1 s`` (steady) or ``spike``.
        args: ``run.sh`` arguments.
    """

    label: str
    kind: str
    args: tuple[str, ...]


def peer_runs(
    results: dict[str, Any], quick: bool = False, workloads: Sequence[str] = ("steady", "spike")
) -> list[PeerRun]:
    """The broker runs matching an engine benchmark's workloads.

    Args:
        results: the engine's benchmark JSON.
        quick: only the first steady rate (timers and level), no spike.
        workloads: which of the engine's workloads to compare.

    Example:
        >>> runs = peer_runs({"workloads": {"steady": [{"rate_target": 1000, "seconds": 20}]}})
        >>> [(r.label, r.kind) for r in runs]
        [('steady 1,000/s', 'level 1 s'), ('steady 1,000/s', 'timers')]
    """
    work = results.get("workloads", {})
    runs: list[PeerRun] = []
    steady = work.get("steady", []) if "steady" in workloads else []
    for i, step in enumerate(steady[:1] if quick else steady):
        rate, seconds = int(step["rate_target"]), int(step["seconds"])
        label = f"steady {rate:,}/s"
        common = ("--rate", str(rate), "--duration", str(seconds))
        if i == 0:
            runs.append(PeerRun(label, "level 1 s", ("level", *common, "--level", "1")))
        timers = ("--delay-min-ms", "1000", "--delay-max-ms", "3000")
        runs.append(PeerRun(label, "timers", ("timer", *common, *timers)))
    spike = work.get("spike") if "spike" in workloads else None
    if spike and not quick:
        size = int(spike["size"])
        # The broker takes ~7k msg/s: the instant must come after the last send.
        lead_ms = max(15_000, size * 240 // 1000)
        args = ("spike", "--count", str(size), "--lead-ms", str(lead_ms))
        runs.append(PeerRun(f"spike {size:,}", "spike", args))
    return runs


def engine_figures(results: dict[str, Any], run: PeerRun) -> dict[str, Any] | None:
    """The engine's figures for the row a broker run is compared with."""
    work = results.get("workloads", {})
    if run.kind == "spike":
        spike = work.get("spike")
        if not spike:
            return None
        return {
            "p50_ms": spike["spike"]["late_p50_ms"],
            "p99_ms": spike["spike"]["late_p99_ms"],
            "last_ms": round(spike["last_visible_after_instant_s"] * 1000),
            "early": spike["spike"]["early"],
            "duplicates": spike["spike"]["duplicates"],
            "missing": spike["spike"]["missing"],
            "size": spike["size"],
        }
    rate = int(run.args[run.args.index("--rate") + 1])
    for step in work.get("steady", []):
        if int(step["rate_target"]) == rate:
            return {
                "p50_ms": step["late_p50_ms"],
                "p99_ms": step["late_p99_ms"],
                "last_ms": step["late_max_ms"],
                "early": step["early"],
                "duplicates": step["duplicates"],
                "missing": step["missing"],
                "rate": step["rate_achieved"],
                "rss_mb": step.get("memory_peak", {}).get("jvm_rss_mb"),
            }
    return None


def peer_figures(line: dict[str, Any]) -> dict[str, Any]:
    """The broker's figures from one harness JSON line."""
    lateness = line.get("lateness_ms") or {}
    last = line.get("spike_last_after_T_ms") if line.get("mode") == "spike" else None
    return {
        "p50_ms": lateness.get("p50"),
        "p99_ms": lateness.get("p99"),
        "last_ms": last if last is not None else lateness.get("max"),
        "early": line.get("early"),
        "duplicates": line.get("duplicates"),
        "missing": line.get("missing"),
        "rate": line.get("send_rate_achieved"),
        "rss_mb": line.get("broker_rss_peak_mb"),
        "valid": line.get("spike_valid", True),
    }


def ratio(ours: object, theirs: object) -> float | None:
    """``ours / theirs`` rounded, or ``None`` when either is missing or zero.

    Example:
        >>> ratio(1500, 150)
        10.0
    """
    if not isinstance(ours, int | float) or not isinstance(theirs, int | float) or not theirs:
        return None
    return round(ours / theirs, 1)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The side-by-side table (Markdown), one line per broker run."""
    head = (
        "| workload | RocketMQ mode | delayq p50 / p99 ms | RocketMQ p50 / p99 ms "
        "| p99 ratio | msg/s delayq / RocketMQ | delayq early/dup/miss | RocketMQ early/dup/miss |"
    )
    lines = [head, "|" + "---|" * 8]
    for row in rows:
        ours, theirs = row["delayq"] or {}, row["rocketmq"] or {}
        lines.append(
            f"| {row['label']} | {row['kind']} | {ours.get('p50_ms', '-')} / "
            f"{ours.get('p99_ms', '-')} | {theirs.get('p50_ms', '-')} / "
            f"{theirs.get('p99_ms', '-')} | {_x(row['p99_ratio'])} | {_rate(ours)} / "
            f"{_rate(theirs)} | {_flags(ours)} | "
            f"{_flags(theirs)} |"
        )
    return "\n".join(lines)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:g}x"


def _rate(fig: dict[str, Any]) -> str:
    rate = fig.get("rate")
    return "-" if rate is None else f"{round(rate):,}"


def _flags(fig: dict[str, Any]) -> str:
    if not fig:
        return "-"
    return f"{fig.get('early')}/{fig.get('duplicates')}/{fig.get('missing')}"


def compare(
    results: dict[str, Any],
    runs: Sequence[PeerRun],
    run_peer: Callable[[PeerRun], dict[str, Any] | None],
    say: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run each broker workload and pair it with the engine's figures."""
    rows = []
    for i, run in enumerate(runs, 1):
        say(f"[{i}/{len(runs)}] RocketMQ {run.kind}: run.sh {' '.join(run.args)}")
        started = time.monotonic()
        line = run_peer(run)
        theirs = peer_figures(line) if line else None
        ours = engine_figures(results, run)
        rows.append(
            {
                "label": run.label,
                "kind": run.kind,
                "args": list(run.args),
                "delayq": ours,
                "rocketmq": theirs,
                "rocketmq_raw": line,
                "p99_ratio": ratio((ours or {}).get("p99_ms"), (theirs or {}).get("p99_ms")),
            }
        )
        took = time.monotonic() - started
        say(f"  {'failed' if line is None else 'done'} in {took:.0f} s: {theirs}")
    return rows


def harness_runner(harness: Path) -> Callable[[PeerRun], dict[str, Any] | None]:
    """Runs ``run.sh`` of the harness; ``None`` when a run fails (its stderr is shown)."""
    script = harness / "run.sh"

    def run(peer: PeerRun) -> dict[str, Any] | None:
        done = subprocess.run(
            ["bash", str(script), *peer.args], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return None
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else None

    return run


def chart(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Bars of p50 and p99 lateness, engine next to broker, per row (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['label']}\n({r['kind']})" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(rows)), 4.5))
    width = 0.2
    series = [
        ("delayq p50", "delayq", "p50_ms", "#9ecae1"),
        ("delayq p99", "delayq", "p99_ms", "#3182bd"),
        ("RocketMQ p50", "rocketmq", "p50_ms", "#fdae6b"),
        ("RocketMQ p99", "rocketmq", "p99_ms", "#e6550d"),
    ]
    for k, (name, who, key, color) in enumerate(series):
        values = [((r[who] or {}).get(key) or 0) / 1000 for r in rows]
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))], values, width, label=name,
               color=color)  # fmt: skip
    ax.set_xticks(range(len(rows)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("lateness (s, log scale)")
    ax.set_title("delayq vs Apache RocketMQ 5.5, same machine, one run")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def newest_results(out_dir: Path) -> Path:
    """The newest engine benchmark JSON in ``out_dir`` (not a ``-peers`` file)."""
    found = sorted(
        p for p in out_dir.glob("*.json") if not p.stem.endswith("-peers")
    )  # names start with the UTC time
    if not found:
        raise SystemExit(f"error: no benchmark results in {out_dir}: run `make bench` first")
    return found[-1]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the broker on the newest benchmark's workloads and print the table."""
    parser = argparse.ArgumentParser(prog="python -m jobs.tools.peers", description=__doc__)
    parser.add_argument("--harness", default=DEFAULT_HARNESS, help="RocketMQ peer harness folder")
    parser.add_argument("--results", help="engine benchmark JSON (default: newest in --out)")
    parser.add_argument("--out", default="bench/out", help="output folder (default bench/out)")
    parser.add_argument("--quick", action="store_true", help="first steady rate only, no spike")
    parser.add_argument(
        "--workloads", default="steady,spike", help="of the engine's: steady,spike (default)"
    )
    args = parser.parse_args(argv)
    harness = Path(args.harness)
    if not (harness / "run.sh").is_file():
        print(
            f"error: no RocketMQ peer harness at {harness} (run.sh not found); "
            "pass PEERS=<folder> (make) or --harness",
            file=sys.stderr,
        )
        return 2
    source = Path(args.results) if args.results else newest_results(Path(args.out))
    results = json.loads(source.read_text())
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    runs = peer_runs(results, quick=args.quick, workloads=chosen)
    if not runs:
        print(f"error: {source} has no steady or spike workload to compare", file=sys.stderr)
        return 2
    print(f"RocketMQ side by side with {source} ({len(runs)} broker runs, ~1-5 min each)")
    rows = compare(results, runs, harness_runner(harness))
    stem = source.with_suffix("")
    Path(f"{stem}-peers.json").write_text(
        json.dumps({"engine_results": str(source), "rows": rows}, indent=2, default=str)
    )
    chart(rows, Path(f"{stem}-peers.png"))
    print()
    print(table(rows))
    print(f"\nresults: {stem}-peers.json\nchart:   {stem}-peers.png")
    return 0 if all(r["rocketmq"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
