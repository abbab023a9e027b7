"""A recurring schedule fired by engine processes, one killed with SIGKILL between a firing
batch's send and its commit: each occurrence arrives once, never before its time."""

from __future__ import annotations

import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from engine.core.clock import SystemClock
from engine.lakehouse.storage.layout import layout
from engine.recur.defs import create_schedule
from tests.support.crash_points import said
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows
from tests.support.process import VENV_BIN, engine_args, run_to_end

pytestmark = pytest.mark.integration

#: How long the schedule fires, once a second.
FIRES_FOR = timedelta(seconds=45)


def test_a_schedule_fires_each_occurrence_once_across_a_kill_between_send_and_commit(
    spark: SparkSession, make_cfg: Any, tmp_path: Path
) -> None:
    """Every second for 45 s from its creation. The first engine dies right after its third
    firing batch reached ``commitlog`` (the batch's plan written, its commit not): the next
    engine replays that batch from its plan, finds its ``txn`` and sends nothing twice, then
    goes on (the occurrences while no engine ran fire late)."""
    cfg = make_cfg()
    now = SystemClock().now().replace(microsecond=0)
    # (catch_up = all: under a loaded suite, occurrences before a slow start still all fire)
    tick = create_schedule(cfg, "tick", "ticks", "t", every="1s", start=now,
                           end=now + FIRES_FOR, catch_up="all")  # fmt: skip
    settings = engine_args(cfg, "--show", "0")
    killing = [sys.executable, "-m", "tests.support.killing_engine", "recurring-sent", "3"]
    log = tmp_path / "killed.log"
    assert run_to_end([*killing, *settings], log, 240) == -signal.SIGKILL, log.read_text()[-3000:]
    point, where = said(log.read_text())
    assert point == "recurring-sent"
    checkpoint = Path(layout(cfg).checkpoint("recurring"))
    batch = int(where["batch"])
    assert (checkpoint / f"{batch:020d}.plan.json").exists()
    assert not (checkpoint / f"{batch:020d}.json").exists()  # sent, not committed

    final = tmp_path / "final.log"
    until = ["--until-idle", "--max-seconds", "150"]
    code = run_to_end([str(VENV_BIN / "delayq"), "run", *settings, *until], final, 240)
    assert code == 0, final.read_text()[-3000:]
    expected = [tick.message_id(t) for t in tick.recurrence.between(now, now + FIRES_FOR)]
    assert len(expected) == 45
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, expected, cfg)
