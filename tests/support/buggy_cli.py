"""``delayq`` with a bug planted in ``status``: a real Spark call that fails (for tests).

Run as ``python -m tests.support.buggy_cli status --set ...``.
"""

from __future__ import annotations

import sys
from typing import Any

import engine.control.status as status
from engine.cli import main


def _broken(spark: Any, *_args: Any) -> Any:
    return spark.sparkContext._jvm.java.lang.Integer.parseInt("not a number")


if __name__ == "__main__":
    status.read_status = _broken
    sys.exit(main(sys.argv[1:]))
