"""A topic with a delivery rate cap, its engine process killed with SIGKILL while rows wait
for the cap: each message once, never early, never faster than the cap. (On driver threads,
as the suite's engine processes run; the docs test runs a cap on the default queries.)"""

from __future__ import annotations

import json
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from tests.support.crash_points import said
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows
from tests.support.process import VENV_BIN, engine_args, run_to_end

pytestmark = pytest.mark.integration

RATE = 40  # a second
BURST_ROWS = 2 * RATE + 1  # (engine.deliver.rates.BURST_S of unused allowance, and the first)


def test_rows_waiting_for_a_cap_survive_a_kill_and_go_once_at_the_cap(
    spark: SparkSession, make_cfg: Any, tmp_path: Path
) -> None:
    """300 messages due at one instant into a topic capped at 40 a second, and 10 into
    another. The first engine dies right after its fourth committed round, rows still
    waiting (its committed progress names the cap's cursor); the next one goes on from that
    cursor. No round shows more than the cap allows (2 s of allowance kept, plus one)."""
    cfg = make_cfg()
    ids = send_many(spark, cfg, [Message("capped", f"c{i}", delay_level=1) for i in range(300)])
    ids += send_many(spark, cfg, [Message("free", f"f{i}", delay_level=1) for i in range(10)])
    settings = [
        *engine_args(cfg, "--show", "0"),
        "--set", f"topics.capped.max_rate={RATE}/s",
    ]  # fmt: skip
    killing = [sys.executable, "-m", "tests.support.killing_engine", "round-committed", "4"]
    log = tmp_path / "killed.log"
    assert run_to_end([*killing, *settings], log, 240) == -signal.SIGKILL, log.read_text()[-3000:]
    point, where = said(log.read_text())
    assert point == "round-committed"
    committed = Path(layout(cfg).delay_offset) / f"{int(where['round']):020d}.json"
    rates = json.loads(json.loads(committed.read_text().splitlines()[0])["rates"])
    assert rates["capped"]["cursor_us"] is not None and rates["capped"]["waiting"] > 0

    final = tmp_path / "final.log"
    until = ["--until-idle", "--max-seconds", "120"]
    code = run_to_end([str(VENV_BIN / "delayq"), "run", *settings, *until], final, 240)
    assert code == 0, final.read_text()[-3000:]
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, ids, cfg)
    per_round = Counter(r["delivery_round"] for r in rows if r["topic"] == "capped")
    assert len(per_round) >= 4 and max(per_round.values()) <= BURST_ROWS, per_round
    capped = sorted((r for r in rows if r["topic"] == "capped"), key=lambda r: r["msg_id"])
    assert len({r["deliver_ts"] for r in capped}) == 1, "one instant"
