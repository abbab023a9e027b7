"""The benchmark as a Spark application (``make bench``; ``make bench MODE=full``). A
one-minute check of two workloads on tiny numbers, from the repository root::

    source .venv/bin/activate
    spark-submit --properties-file .jars/spark-defaults.conf --driver-memory 8g \\
        jobs/bench.py --mode smoke --workloads steady,spike

Options: ``--mode smoke|quick|full`` (default quick), ``--workloads steady,spike,...``,
``--backlogs 0,10000000`` (the pending sizes of ``backlog`` and ``restart`` instead of the
mode's), ``--rates 100000`` (the steps of ``steady``, the first two also ``ahead``'s),
``--out bench/out``, ``--set key=value``.
Writes ``<out>/<UTC time>-<mode>.json`` and ``.png`` and prints a short table. Quick mode
takes 15-20 minutes on 2 cores; full mode over an hour (see ``jobs.tools.benchmark``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from engine.cli import config_from_args
from engine.core.errors import DelayQError
from engine.lakehouse.catalog.session import build_spark
from jobs.tools.benchmark import PLANS, WORKLOADS, Bench, table


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the chosen workloads, print the table."""
    parser = argparse.ArgumentParser(
        prog="bench.py", description="Benchmark the engine: throughput, lateness, backlog, ..."
    )
    parser.add_argument("--mode", choices=sorted(PLANS), default="quick", help="default quick")
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--backlogs",
        metavar="N,N",
        help="pending sizes for backlog and restart, e.g. 0,10000000 (default: the mode's)",
    )
    parser.add_argument(
        "--rates",
        metavar="N,N",
        help="msg/s steps of steady (and ahead), e.g. 100000 (default: the mode's)",
    )
    parser.add_argument("--out", default="bench/out", help="output folder (default bench/out)")
    parser.add_argument("--conf", metavar="FILE", help="TOML config (default conf/engine.toml)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[])
    parser.add_argument(
        "--keep", action="store_true", help="keep the bench lakehouses (under --out) after the run"
    )
    args = parser.parse_args(argv)
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    plan = PLANS[args.mode]
    if args.backlogs:
        try:
            sizes = tuple(int(n) for n in args.backlogs.split(","))
        except ValueError:
            parser.error(f"--backlogs: {args.backlogs!r} is not a comma-separated list of counts")
        if any(n < 0 for n in sizes):
            parser.error(f"--backlogs: {args.backlogs!r} has a negative count")
        plan = dataclasses.replace(plan, backlogs=sizes)
    if args.rates:
        try:
            rates = tuple(int(n) for n in args.rates.split(","))
        except ValueError:
            parser.error(f"--rates: {args.rates!r} is not a comma-separated list of msg/s")
        if any(n <= 0 for n in rates):
            parser.error(f"--rates: {args.rates!r} has a rate that is not positive")
        plan = dataclasses.replace(plan, rates=rates)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        spark = build_spark(cfg)
        passed = ["--conf", args.conf] if args.conf else []
        passed += [item for value in args.set for item in ("--set", value)]
        bench = Bench(spark, cfg, plan, Path(args.out), engine_args=passed, keep=args.keep)
        print(f"delayq bench ({args.mode}): {', '.join(chosen)}")
        results = bench.run(chosen)
    except DelayQError as err:
        print(f"bench: error: {err}", file=sys.stderr)
        return 2
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
