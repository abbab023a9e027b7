"""The delayed-delivery engine as a Spark application.

Runs the stamping and delivery stages against the lakehouse in ``conf/``
until Ctrl-C (or, with ``--until-idle``, until nothing is pending), from the repository root::

    source .venv/bin/activate
    spark-submit --properties-file .jars/spark-defaults.conf \\
        jobs/delay_engine.py --until-idle --max-seconds 30

Options: ``--conf FILE``, ``--set key=value`` (repeatable), ``--until-idle``,
``--max-seconds S``, ``--demo``. ``--properties-file`` (written by ``make jars``) puts Delta
on ``spark.jars``. Ctrl-C or SIGTERM stops the engine cleanly (exit 0). Exit 2 is a mistake
in configuration or set-up (one line saying what), 70 a bug (one line naming the log file).
"""

from __future__ import annotations

import argparse
import sys

from engine.cli import add_run_arguments, cmd_run, config_from_args
from engine.run.report import run_main, setup_logging


def main(argv: list[str] | None = None) -> int:
    """Parse the job's arguments and run the engine."""
    parser = argparse.ArgumentParser(
        prog="delay_engine.py",
        description="Run the delayed-delivery engine (stamping + delivery) until stopped.",
    )
    parser.add_argument("--conf", metavar="FILE", help="TOML config (default conf/engine.toml)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[])
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    log_file = setup_logging("delay_engine")
    # A mistake: one line, exit 2; Ctrl-C before the engine runs: exit 130 (it stops cleanly
    # itself once running); a bug: one line naming the log file with the traceback, exit 70.
    return run_main("delay_engine", lambda: cmd_run(args, config_from_args(args)), log_file)


if __name__ == "__main__":
    sys.exit(main())
