"""Cancel and reschedule: outcomes, races with delivery, replays, audit trail."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.control.commands import cancel, issue, reschedule, result_of
from engine.control.inspect import history, pending
from engine.core.clock import FakeClock, to_millis
from engine.core.config import EngineConfig
from engine.core.errors import InvalidMessageError
from engine.deliver.commands import CANCEL, Target, resolve
from engine.deliver.round import RoundResult
from engine.lakehouse.catalog.names import register_all
from engine.lakehouse.delta.tables import ensure_tables
from engine.produce.send import Message, send, send_df, send_many
from engine.run.engine import Engine
from schemas import COMMITLOG
from tests.support.crash import Crash, crash_after_writes
from tests.support.lakehouse import START, delivered_rows, quiet_engine

pytestmark = pytest.mark.integration


def delivered_ids(spark: SparkSession, cfg: EngineConfig) -> list[str]:
    return sorted(str(r["msg_id"]) for r in delivered_rows(spark, cfg))


def test_cancel_before_delivery(spark: SparkSession, cfg: EngineConfig, clock: FakeClock) -> None:
    messages = [Message("orders", "keep", delay_level=3), Message("orders", "drop", delay_level=3)]
    keep, drop = send_many(spark, cfg, messages, clock)
    engine = quiet_engine(spark, cfg, clock)
    engine.step()
    asked = cancel(spark, cfg, drop, wait=0, clock=clock)
    assert asked.status == "pending", "no round has run since"
    engine.step()
    done = result_of(spark, cfg, asked.command_id, CANCEL)
    assert done.status == "cancelled" and done.count == 1
    assert done.outcomes[0].msg_id == drop and done.outcomes[0].topic == "orders"
    assert [r["msg_id"] for r in pending(spark, cfg).collect()] == [keep]
    clock.advance(seconds=4)
    engine.step()
    assert delivered_ids(spark, cfg) == [keep]
    status = engine.status()
    assert status.cancelled == 1 and status.idle, status
    # nothing is deleted: the message is still in commitlog and schedule
    events = [r["event"] for r in history(spark, cfg, msg_id=drop).collect()]
    assert events == ["sent", "stamped", "cancelled"]


def test_cancel_after_delivery_says_so(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    msg = send(spark, cfg, "orders", "gone", delay_level=1, clock=clock)
    engine = quiet_engine(spark, cfg, clock)
    clock.advance(seconds=1)
    engine.step()
    asked = cancel(spark, cfg, msg, wait=0, clock=clock)
    engine.step()
    done = result_of(spark, cfg, asked.command_id, CANCEL)
    assert done.status == "already_delivered"
    assert delivered_ids(spark, cfg) == [msg]
    assert engine.status().cancelled == 0


def test_cancel_racing_delivery_in_one_round_cancels_and_delivers_nothing(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    msg = send(spark, cfg, "orders", "race", delay_level=1, clock=clock)
    engine = quiet_engine(spark, cfg, clock)
    engine.step()
    clock.advance(seconds=1)  # due now: the next round delivers it, unless cancelled
    # The round that delivers it is under way (stamped, its clock read) when the cancel is
    # issued: it is held as it is about to fix the commands it decides, until the cancel is in.
    in_round, cancel_in = threading.Event(), threading.Event()
    tracker = engine.delivery._commands
    latest = tracker.latest

    def held_latest() -> int:
        in_round.set()
        cancel_in.wait(60)
        return latest()

    monkeypatch.setattr(tracker, "latest", held_latest)
    rounds: list[RoundResult | BaseException] = []

    def run_round() -> None:
        try:
            rounds.append(engine.step())
        except BaseException as err:
            rounds.append(err)

    racing = threading.Thread(target=run_round)
    racing.start()
    try:
        assert in_round.wait(60), "the round never reached its commands"
        asked = cancel(spark, cfg, msg, wait=0, clock=clock)
        assert racing.is_alive() and not rounds, "the cancel went in while the round ran"
    finally:
        cancel_in.set()
        racing.join()
    (raced,) = rounds
    assert isinstance(raced, RoundResult), raced
    assert raced.commands == {"cancelled": 1} and raced.delivered == 0, "decided in that round"
    assert result_of(spark, cfg, asked.command_id, CANCEL).status == "cancelled"
    clock.advance(seconds=5)
    engine.step()
    assert delivered_ids(spark, cfg) == [], "cancelled and delivered must never both happen"


def test_crash_in_a_round_with_a_cancel_replays_it_exactly(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    ids = send_many(
        spark, cfg, [Message("orders", f"m{i}", delay_level=1) for i in range(4)], clock
    )
    engine = quiet_engine(spark, cfg, clock)
    engine.step()
    clock.advance(seconds=1)
    asked = cancel(spark, cfg, ids[0], wait=0, clock=clock)

    crashing = quiet_engine(spark, cfg, clock, sinks=crash_after_writes())
    with pytest.raises(Crash):
        crashing.step()
    restarted = quiet_engine(spark, cfg, clock)  # replays the planned round at start
    restarted.step()
    assert delivered_ids(spark, cfg) == sorted(ids[1:])
    done = result_of(spark, cfg, asked.command_id, CANCEL)
    assert done.status == "cancelled" and len(done.outcomes) == 1, "decided once"
    status = restarted.status()
    assert status.cancelled == 1 and status.idle, status


def test_crash_in_a_round_with_a_reschedule_moves_the_message_once(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    moved, other = send_many(
        spark, cfg, [Message("orders", f"m{i}", delay_level=1) for i in range(2)], clock
    )
    quiet_engine(spark, cfg, clock).step()
    clock.advance(seconds=1)
    asked = reschedule(spark, cfg, moved, delay="5s", wait=0, clock=clock)
    crashing = quiet_engine(spark, cfg, clock, sinks=crash_after_writes())
    with pytest.raises(Crash):  # after the outcome, the moved row and the topic write
        crashing.step()
    crashing.step()  # the same engine replays the round (a fresh one would too)
    assert delivered_ids(spark, cfg) == [other]
    copies = (
        spark.read.format("delta")
        .load(f"{cfg.lakehouse_path}/schedule")
        .where((F.col("msg_id") == moved) & (F.col("revision") == 1))
        .count()
    )
    assert copies == 1, "the replayed rounds append the moved row once"
    done = result_of(spark, cfg, asked.command_id, "reschedule")
    assert done.status == "rescheduled" and len(done.outcomes) == 1, "decided once"
    clock.advance(seconds=5)
    restarted = quiet_engine(spark, cfg, clock)
    restarted.step()
    assert delivered_ids(spark, cfg) == sorted([moved, other])
    assert restarted.status().idle


def test_cancel_by_key_in_one_topic(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    ids = send_many(
        spark,
        cfg,
        [
            Message("orders", "a", keys="order-7", delay_level=2),
            Message("orders", "b", keys=["x", "order-7"], delay_level=3),
            Message("audit", "c", keys="order-7", delay_level=3),
            Message("orders", "d", keys="order-8", delay_level=3),
        ],
        clock,
    )
    engine = quiet_engine(spark, cfg, clock)
    engine.step()
    asked = cancel(spark, cfg, key="order-7", topic="orders", wait=0, clock=clock)
    engine.step()
    done = result_of(spark, cfg, asked.command_id, CANCEL)
    assert done.status == "cancelled" and done.count == 2
    assert sorted(o.msg_id for o in done.outcomes) == sorted(ids[:2])
    clock.advance(seconds=4)
    engine.step()
    assert delivered_ids(spark, cfg) == sorted(ids[2:])
    again = cancel(spark, cfg, key="order-7", topic="orders", wait=0, clock=clock)
    engine.step()
    assert result_of(spark, cfg, again.command_id, CANCEL).status == "already_cancelled"


def test_reschedule_later_keeps_the_id_and_is_never_early(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    msg = send(spark, cfg, "orders", "later", delay_level=1, keys="k1", clock=clock)
    engine = quiet_engine(spark, cfg, clock)
    engine.step()
    asked = reschedule(spark, cfg, msg, delay="5s", wait=0, clock=clock)
    new_time = START + timedelta(seconds=5)
    engine.step()
    done = result_of(spark, cfg, asked.command_id, "reschedule")
    assert done.status == "rescheduled" and done.outcomes[0].new_deliver_ts == new_time
    clock.advance(seconds=4)
    engine.step()
    assert delivered_ids(spark, cfg) == [], "not at the old time, not before the new one"
    clock.set(new_time)
    engine.step()
    (row,) = delivered_rows(spark, cfg)
    assert row["msg_id"] == msg and row["body"] == b"later"
    assert to_millis(row["deliver_ts"].astimezone()) == to_millis(new_time)  # type: ignore[union-attr]
    assert row["delivered_ts"] >= row["deliver_ts"]  # type: ignore[operator]
    status = engine.status()
    assert status.idle and status.cancelled == 0 and status.unstamped == 0, status
    events = [r["event"] for r in history(spark, cfg, key="k1").collect()]
    assert events == ["sent", "stamped", "rescheduled", "stamped", "delivered"]
    # the history view (for SQL-only tools) tells the same events
    register_all(spark, cfg)
    view = spark.sql(f"SELECT * FROM {cfg.database}.history WHERE array_contains(keys, 'k1')")
    assert sorted((r["event"], r["at"], r["detail"]) for r in view.collect()) == sorted(
        (r["event"], r["at"], r["detail"]) for r in history(spark, cfg, key="k1").collect()
    )


def test_reschedule_earlier_and_into_the_past(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    soon, past = send_many(
        spark,
        cfg,
        [Message("orders", "soon", delay="1h"), Message("orders", "past", delay="2h")],
        clock,
    )
    engine = quiet_engine(spark, cfg, clock)
    engine.step()
    reschedule(spark, cfg, soon, delay="2s", wait=0, clock=clock)
    reschedule(spark, cfg, past, deliver_at=START - timedelta(days=1), wait=0, clock=clock)
    engine.step()  # decides both; the one in the past is due 1 ms after this round's cutoff
    clock.advance(millis=1)
    engine.step()
    assert delivered_ids(spark, cfg) == [past]
    clock.advance(seconds=2)
    engine.step()
    assert delivered_ids(spark, cfg) == sorted([soon, past])
    assert engine.status().idle


def test_reschedule_then_cancel_in_one_round(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    msg = send(spark, cfg, "orders", "x", delay_level=1, clock=clock)
    engine = quiet_engine(spark, cfg, clock)
    engine.step()
    reschedule(spark, cfg, msg, delay="10s", wait=0, clock=clock)
    clock.advance(millis=1)
    asked = cancel(spark, cfg, msg, wait=0, clock=clock)
    engine.step()
    assert result_of(spark, cfg, asked.command_id, CANCEL).status == "cancelled"
    clock.advance(seconds=20)
    engine.step()
    assert delivered_ids(spark, cfg) == []
    assert engine.status().idle


def test_cancel_waits_for_stamping_however_long_and_unknown_ids_are_not_found(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    msg = send(spark, cfg, "orders", "fresh", delay_level=1, clock=clock)
    bad = spark.createDataFrame(
        [("BAD-1", None, b"no topic")], "msg_id string, topic string, body binary"
    )
    columns = [
        F.col(f.name) if f.name in bad.columns else F.lit(None).cast(f.dataType).alias(f.name)
        for f in COMMITLOG.fields
    ]
    commitlog = f"{cfg.lakehouse_path}/commitlog"
    bad.select(*columns).write.format("delta").mode("append").save(commitlog)
    early = cancel(spark, cfg, msg, wait=0, clock=clock)
    unknown = cancel(spark, cfg, "NO-SUCH-ID", wait=0, clock=clock)
    refused = cancel(spark, cfg, "BAD-1", wait=0, clock=clock)
    for _ in range(2):  # stamping lags (here: does not run) for minutes
        clock.advance(seconds=120)
        engine.delivery.run_round()
    assert result_of(spark, cfg, early.command_id, CANCEL).status == "pending", "still waits"
    gone = result_of(spark, cfg, unknown.command_id, CANCEL)
    assert gone.status == "not_found" and "NO-SUCH-ID" in gone.line()
    engine.step()  # now it is stamped (and BAD-1 quarantined)
    assert result_of(spark, cfg, early.command_id, CANCEL).status == "cancelled"
    why = result_of(spark, cfg, refused.command_id, CANCEL)
    assert why.status == "not_found" and "quarantined: topic is missing" in why.line()
    clock.advance(seconds=5)
    engine.step()
    assert delivered_ids(spark, cfg) == []


def test_two_reschedules_in_one_round_keep_the_message(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    msg = send(spark, cfg, "orders", "moved twice", delay_level=1, clock=clock)
    engine = quiet_engine(spark, cfg, clock)
    engine.step()
    reschedule(spark, cfg, msg, delay="10s", wait=0, clock=clock)
    clock.advance(millis=1)
    second = reschedule(spark, cfg, msg, delay="5s", wait=0, clock=clock)
    engine.step()
    done = result_of(spark, cfg, second.command_id, "reschedule")
    assert done.status == "rescheduled" and done.outcomes[0].new_deliver_ts == START + timedelta(
        seconds=5, milliseconds=1
    )
    clock.advance(seconds=6)
    engine.step()
    assert delivered_ids(spark, cfg) == [msg], "delivered once, at the last time asked"
    assert engine.status().idle


def test_cancel_of_a_time_with_microseconds_holds(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    due = START + timedelta(seconds=1, microseconds=700)
    frame = spark.createDataFrame(
        [("orders", "µs", due)], "topic string, body string, deliver_at timestamp"
    )
    send_df(spark, cfg, frame, clock)
    msg = spark.read.format("delta").load(f"{cfg.lakehouse_path}/commitlog").first()["msg_id"]  # type: ignore[index]
    engine = quiet_engine(spark, cfg, clock)
    engine.step()
    asked = cancel(spark, cfg, msg, wait=0, clock=clock)
    engine.step()
    assert result_of(spark, cfg, asked.command_id, CANCEL).status == "cancelled"
    clock.set(START + timedelta(seconds=1))  # a watermark just below the deliver time
    engine.step()
    clock.set(START + timedelta(seconds=2))
    engine.step()
    assert delivered_ids(spark, cfg) == []


def test_bad_commands_fail_before_anything_is_written(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    with pytest.raises(InvalidMessageError, match="msg_id"):
        cancel(spark, cfg, wait=0)
    with pytest.raises(InvalidMessageError, match="msg_id"):
        cancel(spark, cfg, "A", key="k", wait=0)
    with pytest.raises(InvalidMessageError, match="topic"):
        cancel(spark, cfg, "A", topic="orders", wait=0)
    with pytest.raises(InvalidMessageError, match="max_delay"):
        reschedule(spark, cfg, "A", delay="400d", wait=0, clock=clock)
    with pytest.raises(InvalidMessageError, match="deliver_at"):
        reschedule(spark, cfg, "A", wait=0)
    with pytest.raises(InvalidMessageError, match="wait"):
        cancel(spark, cfg, "A", wait=-1)
    commands = spark.read.format("delta").load(ensure_tables(spark, cfg).commands)
    assert commands.count() == 0, "a refused command is not written"


def test_cancel_with_an_engine_running_returns_the_outcome(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    engine = Engine(spark, cfg.with_overrides(poll_interval_ms=100), out=lambda _: None).open()
    msg = send(spark, cfg, "orders", "soon cancelled", delay="1h")
    engine.start()
    try:
        result = cancel(spark, cfg, msg, wait=60)
    finally:
        engine.stop()
    assert result.status == "cancelled", result
    assert result.line().startswith("cancelled 1 message(s)")


def _target(msg_id: str, deliver_ms: int, batch: int = 0, revision: int = 0) -> Target:
    return Target(msg_id, revision, "orders", ("k",), 1, deliver_ms * 1000, batch)


def _command(action: str, msg_id: str | None = None, key: str | None = None) -> dict[str, Any]:
    return {"command_id": f"c-{action}-{msg_id or key}", "action": action, "msg_id": msg_id,
            "key": key, "topic": None, "deliver_ms": 50_000, "issued_ms": 0}  # fmt: skip


def test_resolve_is_a_pure_decision() -> None:
    rows = [_target("delivered", 1_000), _target("live", 9_000), _target("late", 500, batch=3)]
    out = resolve(
        [_command("cancel", "delivered"), _command("cancel", "live"), _command("cancel", "late"),
         _command("reschedule", key="k")],
        rows, set(), (2_000_000, 2), 7, 10_000_000, START,
    )  # fmt: skip
    by_msg = {(r["command_id"], r["msg_id"]): r["result"] for r in out.results}
    assert by_msg[("c-cancel-delivered", "delivered")] == "already_delivered"
    assert by_msg[("c-cancel-live", "live")] == "cancelled"
    assert by_msg[("c-cancel-late", "late")] == "cancelled", "stamped late: not delivered yet"
    assert by_msg[("c-reschedule-k", None)] == "already_delivered", "nothing left for the key"
    assert out.removed_per_queue == {1: 2} and out.waiting == 0
    moved = resolve(
        [_command("reschedule", "live")], rows, set(), (2_000_000, 2), 7, 60_000_000, START
    )
    ((msg, old, new, when),) = moved.new_rows
    assert (msg, old, new) == ("live", 0, 1)
    assert to_millis(when) == 60_001, "a time already past is due just after the watermark"
    twice = [_command("reschedule", "live"), {**_command("reschedule", "live"), "command_id": "c2"}]
    chain = resolve(twice, rows, set(), (2_000_000, 2), 7, 10_000_000, START)
    assert [(m, src, new) for m, src, new, _ in chain.new_rows] == [("live", 0, 1), ("live", 0, 2)]
    unknown = resolve([_command("cancel", "nope")], [], set(), (0, 0), 7, 0, START, sent=set())
    assert unknown.results[0]["result"] == "not_found" and unknown.waiting == 0
    waits = resolve([_command("cancel", "nope")], [], set(), (0, 0), 7, 0, START, sent={"nope"})
    assert not waits.results and waits.waiting == 1


def test_issue_records_who_and_when(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    command_id = issue(spark, cfg, CANCEL, msg_id="X", clock=clock)
    (row,) = spark.read.format("delta").load(f"{cfg.lakehouse_path}/commands").collect()
    assert row["command_id"] == command_id and "@" in row["issued_by"]


def test_cli_cancel_reschedule_and_the_pending_view(
    spark: SparkSession, cfg: EngineConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.support.process import cli

    code, out, _ = cli(capsys, cfg, "send", "--topic", "orders", "--body", "a", "--delay", "1h")
    first = out.strip()
    code, out, _ = cli(capsys, cfg, "send", "--topic", "orders", "--body", "b", "--delay", "1h")
    second = out.strip()
    code, out, _ = cli(capsys, cfg, "cancel", "--id", first, "--wait", "0")
    assert code == 1 and "pending" in out and "no engine answered yet" in out
    code, out, _ = cli(capsys, cfg, "reschedule", "--id", second, "--delay", "2h", "--wait", "0")
    assert code == 1 and "pending" in out
    code, _, err = cli(capsys, cfg, "reschedule", "--id", second, "--delay", "90d")
    assert code == 2 and "max_delay" in err
    Engine(spark, cfg, out=lambda _: None).step()
    code, out, _ = cli(capsys, cfg, "status")
    assert code == 0 and "cancelled   1" in out
    code, out, _ = cli(capsys, cfg, "history", "--id", first)
    assert code == 0 and "cancelled" in out
    query = f"SELECT msg_id, revision FROM {cfg.database}.pending"
    code, out, _ = cli(capsys, cfg, "sql", query)
    assert code == 0 and second in out and first not in out and "|1       |" in out


def test_a_lakehouse_from_before_commands_upgrades(
    spark: SparkSession, make_cfg: Any, clock: FakeClock
) -> None:
    import json

    from delta.tables import DeltaTable
    from pyspark.sql.types import StructType

    from engine.lakehouse.catalog.names import register_all
    from engine.lakehouse.storage.layout import layout
    from schemas import COMMITLOG, SCHEDULE

    cfg = make_cfg(register_tables=True)
    lay = layout(cfg)
    DeltaTable.create(spark).location(lay.commitlog).addColumns(COMMITLOG).execute()
    old = StructType([f for f in SCHEDULE.fields if f.name not in ("revision", "msg_id_hash")])
    DeltaTable.create(spark).location(lay.schedule).addColumns(old).partitionedBy(
        "queue_id"
    ).execute()
    old_round = {"checkpoint_id": "c1", "status": "committed", "queue_id": 1, "round": 0,
                 "watermark": START.isoformat(), "schedule_version": 0, "stamp_batch": -1,
                 "delivered": 0, "delivered_total": 0, "stamped_total": 0,
                 "last_deliver_ts": None, "updated_ts": START.isoformat()}  # fmt: skip
    Path(lay.delay_offset).mkdir(parents=True)
    (Path(lay.delay_offset) / f"{0:020d}.json").write_text(json.dumps(old_round) + "\n")
    register_all(spark, cfg)  # an old lakehouse: no error, the checkpoint view works
    row = spark.sql(f"SELECT round, cancelled_total FROM {cfg.database}.delay_offset").first()
    assert row is not None and row["round"] == 0 and row["cancelled_total"] is None

    engine = quiet_engine(spark, cfg, clock)  # upgrades: revision column, command tables
    msg = send(spark, cfg, "orders", "x", delay_level=2, clock=clock)
    engine.step()
    cancel(spark, cfg, msg, wait=0, clock=clock)
    engine.step()
    assert spark.sql(f"SELECT * FROM {cfg.database}.pending").count() == 0
    assert engine.status().cancelled == 1
