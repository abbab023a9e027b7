"""The stages as streaming queries (``stamp.mode`` and ``delivery.mode = streaming``, the
default) killed with SIGKILL in the middle of a micro-batch of each, with Spark's checkpoint
and the stage's own record one step apart both ways, on a lakehouse the driver threads left
mid-round, and in the round a start runs before its queries, then run to the end: every
message once, never early."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from engine.core.clock import SystemClock
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.tables import ensure_tables
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from engine.stamp.query import newest_plan
from engine.stamp.stamper import Stamper
from engine.stamp.writer import highest_batch
from tests.support.crash_points import said
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows
from tests.support.process import VENV_BIN, engine_args, run_to_end

pytestmark = pytest.mark.integration


def _wave(spark: SparkSession, cfg: Any, k: int, earlier: list[str]) -> tuple[list[str], int]:
    """Levels 0-3 and timers up to 6 s, and five earlier ids sent again (a producer's retries);
    returns the new ids and how many retries."""
    wave = [
        Message(f"t{i % 2}", f"{k}-{i}", delay_level=i % 4)
        if i % 2
        else Message(f"t{i % 2}", f"{k}-{i}", delay=f"{i % 7}s")
        for i in range(60)
    ]
    sent = send_many(spark, cfg, wave)
    again = earlier[-5:]
    if again:
        send_many(spark, cfg, [Message("t0", "retry", msg_id=m) for m in again])
    return sent, len(again)


def _actions(table: Path) -> list[dict[str, Any]]:
    """Every action of a Delta table's log."""
    return [
        json.loads(line)
        for entry in sorted((table / "_delta_log").glob("*.json"))
        for line in entry.read_text().splitlines()
        if line.strip()
    ]


def _killed_at(point: str, command: list[str], folder: Path) -> dict[str, str]:
    """Run a killing engine; check it died by SIGKILL at ``point``; where it says it was."""
    log = folder / f"{point}.log"
    code = run_to_end(command, log)
    output = log.read_text()
    assert code == -signal.SIGKILL, output[-3000:]
    said_point, where = said(output)
    assert said_point == point, output[-3000:]
    return where


def test_both_queries_killed_mid_batch_either_way_then_deliver_each_message_once(
    spark: SparkSession, make_cfg: Any, tmp_path: Path
) -> None:
    """A lakehouse stamped by the driver path, then left by an engine on driver threads (the
    only mode before) killed with a round planned and none committed, then taken over by the
    queries, which replay that round once. The stamping query, its
    Spark tasks stamping and writing every batch (``stamp.driver_batch_bytes = 0``), is killed
    with a batch in Spark's offsets log and its files written by the tasks but not committed
    (the replay writes it, the files stay outside the table), then with the batch written
    and Spark's commit log behind (the replay writes nothing twice). The delivery query is
    killed with its round planned in the delayOffset log and its topic files written by
    Spark tasks (``delivery.driver_round_rows = 0``) but none committed, then with the round
    committed there; both times Spark's commit of the batch is missing. Last, a start is
    killed in the round it runs before the queries, one topic table committed and the
    round's progress not written."""
    cfg = make_cfg()
    lay = layout(cfg)
    until = ["--until-idle", "--max-seconds", "90"]
    streaming = [*engine_args(cfg, "--show", "0", queries=True), *until]  # the default
    on_threads = [*engine_args(cfg, "--show", "0"), *until]  # stamp/delivery.mode=driver
    in_tasks = [*streaming, "--set", "stamp.driver_batch_bytes=0"]  # the stamping kills
    round_tasks = [*streaming, "--set", "delivery.driver_round_rows=0"]  # the first round kill
    checkpoint = Path(lay.checkpoint("stamp-query"))
    delayq = str(VENV_BIN / "delayq")
    killing = [sys.executable, "-m", "tests.support.killing_engine"]

    ensure_tables(spark, cfg)
    ids, resent = _wave(spark, cfg, 0, [])
    assert Stamper(spark, cfg, lay, SystemClock()).run_available() == len(ids)  # driver path
    sent, again = _wave(spark, cfg, 9, ids)
    ids, resent = ids + sent, resent + again
    where = _killed_at("plan", [*killing, "plan", "1", *on_threads], tmp_path)
    left = Path(lay.delay_offset) / f"{int(where['round']):020d}"
    assert Path(f"{left}.plan.json").exists() and not Path(f"{left}.json").exists()
    planned = newest_plan(lay)  # the driver's last batch (the kill may have cut it short)
    assert planned is not None
    by_driver = planned.batch

    for k, point in enumerate(("tasks-written", "query-written"), start=1):
        sent, again = _wave(spark, cfg, k, ids)
        ids, resent = ids + sent, resent + again
        held = highest_batch(ArrowDelta(lay.schedule))
        on_disk = len(list(Path(lay.schedule).rglob("*.parquet")))
        where = _killed_at(point, [*killing, point, "1", *in_tasks], tmp_path)
        first = json.loads((checkpoint / "delayq.json").read_text())["first_batch"]
        assert first == by_driver + 1  # the query's batches go on from the driver path's
        # Spark's batch id (a tasks' point names the stamping batch, first + Spark's id)
        batch = int(where["batch"]) if "batch" in where else int(where["stamp_batch"]) - first
        assert (checkpoint / "offsets" / str(batch)).exists()
        assert not (checkpoint / "commits" / str(batch)).exists()
        stamped = highest_batch(ArrowDelta(lay.schedule))
        if point == "tasks-written":
            # planned by Spark, files written, none committed (the driver path's last batch,
            # when the kill above cut it short, is replayed first: it is committed)
            assert stamped == max(held, by_driver)
            assert len(list(Path(lay.schedule).rglob("*.parquet"))) > on_disk
        else:
            assert stamped == first + batch  # written, Spark's commit behind

    deliver_checkpoint = Path(lay.checkpoint("deliver-query"))
    for k, point in enumerate(("round-tasks-written", "round-committed"), start=3):
        sent, again = _wave(spark, cfg, k, ids)
        ids, resent = ids + sent, resent + again
        in_rounds = round_tasks if point == "round-tasks-written" else streaming
        where = _killed_at(point, [*killing, point, "1", *in_rounds], tmp_path)
        offsets = [int(p.name) for p in (deliver_checkpoint / "offsets").iterdir()
                   if p.name.isdigit()]  # fmt: skip
        batch = max(offsets)  # the batch the round ran in: Spark's commit of it is not there
        assert not (deliver_checkpoint / "commits" / str(batch)).exists()
        delay_offset = Path(lay.delay_offset)
        progress = (delay_offset / f"{int(where['round']):020d}.json").exists()
        assert progress == (point == "round-committed")  # the round's own record
        if point == "round-tasks-written":  # planned, its files written, none committed
            assert (delay_offset / f"{int(where['round']):020d}.plan.json").exists()
            table = Path(lay.topic(where["table"]))
            committed = {a["add"]["path"] for a in _actions(table) if "add" in a}
            assert {p.name for p in table.glob("*.parquet")} - committed

    # A start delivers what is already due in a round of its own before Spark's queries run
    # (on the driver, the queries' first batches waiting for it): killed there, mid-round.
    sent, again = _wave(spark, cfg, 5, ids)
    ids, resent = ids + sent, resent + again
    where = _killed_at("topic-after", [*killing, "topic-after", "1", *streaming], tmp_path)
    assert where.get("start") == "yes", where  # in the start's own round, not a query's
    round_file = Path(lay.delay_offset) / f"{int(where['round']):020d}"
    assert Path(f"{round_file}.plan.json").exists() and not Path(f"{round_file}.json").exists()

    final = tmp_path / "final.log"
    assert run_to_end([delayq, "run", *streaming], final) == 0, final.read_text()[-3000:]
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids, cfg)
    quarantine = spark.read.format("delta").load(lay.quarantine)
    reasons = [r["reason"] for r in quarantine.select("reason").collect()]
    assert sum(r.startswith("duplicate: ") for r in reasons) == resent  # each retry, once
