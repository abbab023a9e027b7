"""``delayq maintain``: compaction and clean-up beside a running engine, then a replay."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from engine.control.commands import cancel, reschedule
from engine.control.maintain import maintain
from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from engine.run.engine import Engine
from tests.support.crash import Crash, crash_after_writes
from tests.support.lakehouse import (
    START,
    assert_exactly_once_never_early,
    delivered_rows,
    quiet_engine,
)
from tests.support.process import cli

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000


def rows_in(spark: SparkSession, path: str) -> int:
    return spark.read.format("delta").load(path).count() if Path(path).exists() else 0


def wait_for_rows(spark: SparkSession, path: str, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while rows_in(spark, path) < n:
        assert time.monotonic() < deadline, f"{path}: {rows_in(spark, path)} rows, not {n}"
        time.sleep(0.5)


def test_maintenance_beside_a_running_engine_loses_and_repeats_nothing(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    cfg = cfg.with_overrides(maintenance_retention_ms=HOUR_MS)
    lay = layout(cfg)
    due = [
        msg_id
        for i in range(8)  # a commit (a commitlog file) per batch
        for msg_id in send_many(
            spark, cfg, [Message("orders", f"a{i}-{j}", delay_level=1 + j % 3) for j in range(5)]
        )
    ]
    later = send_many(spark, cfg, [Message("orders", f"later{j}", delay="1h") for j in range(5)])
    engine = Engine(spark, cfg, out=lambda _: None)
    engine.start()
    try:
        wait_for_rows(spark, lay.topic("orders"), len(due))

        def keep_sending() -> None:  # while maintenance runs
            for i in range(6):
                batch = [Message("orders", f"b{i}-{j}", delay_level=1) for j in range(5)]
                due.extend(send_many(spark, cfg, batch))
                time.sleep(0.3)

        sender = threading.Thread(target=keep_sending)
        sender.start()
        lines: list[str] = []
        chosen = {"commitlog", "schedule", "topics/orders"}
        reports = {r.table: r for r in maintain(spark, cfg, lines.append, only=chosen)}
        sender.join()
        wait_for_rows(spark, lay.topic("orders"), len(due))
        time.sleep(1.5)  # a round more: nothing else may arrive
    finally:
        engine.stop()

    assert_exactly_once_never_early(delivered_rows(spark, cfg), due)
    waiting = {q: n for q, n in engine.status().pending.items() if n}
    assert waiting == {-1: len(later)}, "the backlog waits, untouched"
    assert set(reports) == chosen
    for report in reports.values():
        assert report.files_before > report.files_after >= 1, report
        # retention 1 h: nothing compacted away is old enough to delete, whatever the engine
        # and the sender added meanwhile (counted as a difference, that went negative)
        assert report.deleted_files == 0 and "; 0 files (0.0 MB) deleted" in report.line()
    assert reports["commitlog"].files_after == 1
    assert reports["schedule"].files_after <= 4, "one file per queue"
    assert lines[0].startswith("schedule: pruned 0 rows") and lines[1].startswith("[1/3] "), lines
    skipped = [line.split(":")[0] for line in lines if "not vacuumed" in line]
    assert skipped == ["topics/orders"], "topic tables only with --vacuum-topics"


def test_a_round_planned_before_maintenance_replays_after_it(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = cfg.with_overrides(maintenance_retention_ms=HOUR_MS)
    ids: list[str] = []
    for i in range(4):
        ids += send_many(spark, cfg, [Message("orders", f"m{i}", delay_level=1)], clock)
        quiet_engine(spark, cfg, clock).stamp_available()  # a schedule file each
    clock.advance(seconds=1)
    with pytest.raises(Crash):  # the round wrote the topic, then died before its commit
        quiet_engine(spark, cfg, clock, sinks=crash_after_writes()).step()

    code, out, err = cli(capsys, cfg, "maintain", "--table", "schedule", "--table", "commitlog",
                         "--set", "maintenance.retention=1h")  # fmt: skip
    assert code == 0, err
    (line,) = [
        line for line in out.splitlines() if line.startswith("schedule: ") and " -> " in line
    ]
    assert line.startswith("schedule: 4 files (") and " -> 1 files (" in line, out
    restarted = quiet_engine(spark, cfg, clock)  # replays the round from its pinned version
    restarted.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)
    assert restarted.status().idle

    code, _, err = cli(capsys, cfg, "maintain", "--table", "nosuch")
    assert code == 2 and "no table nosuch" in err and "schedule" in err, err


def test_tables_the_engine_may_read_again_are_not_vacuumed(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    cfg = cfg.with_overrides(maintenance_retention_ms=HOUR_MS)
    send_many(spark, cfg, [Message("orders", "x", delay_level=1)], clock)
    quiet_engine(spark, cfg, clock).stamp_available()
    clock.advance(seconds=1)
    with pytest.raises(Crash):
        quiet_engine(spark, cfg, clock, sinks=crash_after_writes()).step()

    # Two hours on: the round waits to be replayed, stamping's newest batch is older than
    # the retention (its commitlog version was committed by the wall clock, now).
    later = FakeClock(datetime.now(UTC) + timedelta(hours=2))
    lines: list[str] = []
    list(maintain(spark, cfg, lines.append, only={"commitlog", "schedule"}, clock=later))
    skipped = {line.split(":")[0]: line for line in lines if "not vacuumed" in line}
    assert set(skipped) == {"commitlog", "schedule"}, lines
    assert "stamping has not read past version" in skipped["commitlog"]
    assert f"delivery round 0, planned at {START + timedelta(seconds=1)}" in skipped[
        "schedule"
    ].replace("T", " ")


def test_pruned_schedule_rows_stay_delivered_and_commands_still_answer(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    cfg = cfg.with_overrides(
        maintenance_retention_ms=HOUR_MS, prune_after_ms=HOUR_MS, dedup_window_ms=10_000
    )
    lay = layout(cfg)
    delivered = send_many(spark, cfg, [Message("orders", f"d{i}", delay_level=1) for i in range(3)],
                          clock)  # fmt: skip
    dropped, far, tick = send_many(
        spark,
        cfg,
        [
            Message("orders", "dropped", delay_level=3),
            Message("orders", "far", delay="5h"),
            Message("orders", "tick", delay="2h"),
        ],
        clock,
    )
    (moved,) = send_many(spark, cfg, [Message("orders", "moved", delay_level=1)], clock)
    engine = quiet_engine(spark, cfg, clock)
    engine.step()
    assert cancel(spark, cfg, dropped, wait=0, clock=clock).status == "pending"
    assert reschedule(spark, cfg, moved, delay="10s", wait=0, clock=clock).status == "pending"
    clock.advance(seconds=3)
    engine.step()
    clock.advance(seconds=10)
    engine.step()  # the moved message, delivered at its new time
    clock.advance(
        seconds=2 * 3600
    )  # the watermark moves 2 h on: the rows due then are an hour older
    engine.step()  # (delivering the tick commits it)
    # A timer sent now for a time long past: delivered at once, kept (its id is taken from
    # its store time, as deduplication and commands see it).
    (past,) = send_many(spark, cfg, [Message("orders", "past", deliver_at=START)], clock)
    engine.step()
    before = spark.read.format("delta").load(lay.schedule).count()

    lines: list[str] = []
    list(maintain(spark, cfg, lines.append, only={"schedule"}, clock=clock))
    assert "schedule: pruned 6 rows delivered or cancelled before" in "\n".join(lines), lines
    left = sorted(r["msg_id"] for r in spark.read.format("delta").load(lay.schedule).collect())
    assert (before, left) == (9, sorted([far, tick, past])), "pending and recent rows stay"

    # A command for a pruned message answers at once, as it would have before the prune.
    assert cancel(spark, cfg, delivered[0], wait=0, clock=clock).status == "pending"
    assert cancel(spark, cfg, dropped, wait=0, clock=clock).status == "pending"
    assert cancel(spark, cfg, moved, wait=0, clock=clock).status == "pending"
    assert cancel(spark, cfg, past, wait=0, clock=clock).status == "pending"
    engine.step()
    answers = {r["msg_id"]: (r["result"], r["detail"]) for r in spark.read.format("delta")
               .load(lay.command_results).where("round = (SELECT max(round) FROM "
               f"delta.`{lay.command_results}`)").collect()}  # fmt: skip
    assert answers == {
        delivered[0]: ("already_delivered", f"message {delivered[0]} was delivered long ago "
                       "(its schedule rows are pruned)"),
        dropped: ("already_cancelled", f"message {dropped} was cancelled or moved long ago "
                  "(its schedule rows are pruned)"),
        moved: ("already_delivered", f"message {moved} was delivered long ago "
                "(its schedule rows are pruned)"),
        past: ("already_delivered", f"message {past} was delivered"),
    }  # fmt: skip

    restarted = quiet_engine(spark, cfg, clock)  # nothing delivered again after a restart
    clock.advance(seconds=4 * 3600)
    restarted.step()
    assert_exactly_once_never_early(
        delivered_rows(spark, cfg), [*delivered, moved, far, tick, past]
    )
    assert restarted.status().idle
