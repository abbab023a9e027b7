"""Consumer groups: long polling, ack/nack, retries with backoff, dead letters, lag."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.consume.consumer import WAKE_CHECK_SECONDS, Consumer, Received
from engine.consume.deadletter import resend
from engine.consume.group_log import GroupLog
from engine.consume.lag import lag
from engine.consume.retry import consumer_columns, sendback_record, sendback_rows
from engine.consume.stream import consume_stream
from engine.core.clock import FakeClock, to_millis
from engine.core.config import EngineConfig, GroupConfig
from engine.core.errors import ConsumerError
from engine.core.message import PROP_DLQ_REASON, PROP_FAILURES
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send, send_many
from engine.run.engine import Engine
from jobs.tools.benchmark import commit_times
from tests.support.lakehouse import quiet_engine

pytestmark = pytest.mark.integration

FAST = GroupConfig(max_reconsume_times=3, retry_delays=(1000, 2000, 3000), poll_timeout_ms=0)
#: A waiting poll returns within this long of the commit that showed its rows: the next
#: probe of the log (every WAKE_CHECK_SECONDS) and one read, with room for a loaded machine.
WOKEN_WITHIN_S = 2.0


def table_rows(spark: SparkSession, cfg: EngineConfig, topic: str) -> list[dict[str, Any]]:
    path = layout(cfg).topic(topic)
    df = spark.read.format("delta").load(path)
    df = df.select("*", F.unix_millis("deliver_ts").alias("due_ms"))
    df = df.select("*", F.unix_millis("store_ts").alias("store_ms"))
    return [r.asDict() for r in df.orderBy("delivery_round", "deliver_ts").collect()]


def bodies(batch: list[Received]) -> list[str]:
    return [m.body.decode() for m in batch]


def test_two_groups_read_independently_and_progress_survives_restart(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    send_many(spark, cfg, [Message("orders", "a"), Message("orders", "b")], clock)
    engine.step()
    clock.advance(seconds=1)
    send(spark, cfg, "orders", "c", clock=clock)
    engine.step()

    first = Consumer(spark, cfg, "billing", ["orders"], clock=clock)
    stale = Consumer(spark, cfg, "billing", ["orders"], clock=clock)
    got = first.poll(max_messages=2, timeout=0)
    assert sorted(bodies(got)) == ["a", "b"]
    first.ack()
    first.commit()

    other = Consumer(spark, cfg, "audit", ["orders"], clock=clock)
    everything = other.poll(max_messages=10, timeout=0)
    assert sorted(bodies(everything)) == ["a", "b", "c"]
    assert bodies(everything)[-1] == "c", "delivery order: c came a round later"
    other.ack()
    other.commit()

    restarted = Consumer(spark, cfg, "Billing", ["orders"], clock=clock)  # names ignore case
    rest = restarted.poll(max_messages=10, timeout=0)
    assert bodies(rest) == ["c"]
    assert rest[0].topic == "orders" and rest[0].reconsume_times == 0
    restarted.ack(rest[0])
    restarted.commit()
    assert restarted.poll(timeout=0) == []
    assert stale.poll(timeout=0) == [], "a consumer takes the positions its group committed"
    by_group = {(r["group_name"], r["topic"]): r["lag"] for r in lag(spark, cfg).collect()}
    assert by_group == {("audit", "orders"): 0, ("billing", "orders"): 0}


def fail_until_dead(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, consumer: Consumer, engine: Engine
) -> list[Received]:
    """Nack every message until nothing comes back; the attempts seen, in order."""
    seen: list[Received] = []
    for _ in range(10):
        batch = consumer.poll(timeout=0)
        if not batch:
            # not yet due: one second before the next retry, nothing may be delivered
            clock.advance(seconds=1)
            engine.step()
            batch = consumer.poll(timeout=0)
            if not batch:
                clock.advance(seconds=5)
                engine.step()
                batch = consumer.poll(timeout=0)
        if not batch:
            break
        for m in batch:
            consumer.nack(m, f"boom {m.reconsume_times}")
        seen.extend(batch)
        consumer.commit()
        engine.step()  # stamps the send-back
    return seen


def test_exact_backoff_sequence_then_dead_letter(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    msg = send(spark, cfg, "orders", "pay", keys=["order-1"], properties={"k": "v"}, clock=clock)
    engine.step()
    consumer = Consumer(spark, cfg, "billing", ["orders"], settings=FAST, clock=clock)
    attempts = fail_until_dead(spark, cfg, clock, consumer, engine)

    assert [m.reconsume_times for m in attempts] == [0, 1, 2, 3]
    assert {m.origin_msg_id for m in attempts} == {msg}
    assert {m.topic for m in attempts} == {"orders"}, "retries show the original topic"
    assert [m.table for m in attempts] == ["orders"] + ["retry_billing"] * 3
    retries = table_rows(spark, cfg, "retry_billing")
    # each retry is due exactly its delay after the nack that sent it: 1 s, 2 s, 3 s
    assert [r["due_ms"] - r["store_ms"] for r in retries] == [1000, 2000, 3000]
    assert [r["properties"]["RECONSUME_TIME"] for r in retries] == ["1", "2", "3"]
    # never early: each was delivered at or after its due time
    assert all(to_millis_naive(r["delivered_ts"]) >= r["due_ms"] for r in retries)
    dead = table_rows(spark, cfg, "dlq_billing")
    assert len(dead) == 1
    letter = dead[0]
    assert letter["keys"] == ["order-1"] and letter["body"] == b"pay"
    assert letter["properties"]["k"] == "v"
    assert letter["properties"][PROP_DLQ_REASON] == "boom 3"
    assert letter["properties"]["ORIGIN_MESSAGE_ID"] == msg
    assert letter["properties"]["RETRY_TOPIC"] == "orders"
    history = json.loads(letter["properties"][PROP_FAILURES])
    assert [(h["attempt"], h["reason"]) for h in history] == [
        (0, "boom 0"), (1, "boom 1"), (2, "boom 2"), (3, "boom 3"),
    ]  # fmt: skip
    assert consumer.poll(timeout=0) == [], "a dead letter is not consumed by the group"


def test_default_backoff_is_level_three_plus_reconsume_times(
    spark: SparkSession, make_cfg: Any, clock: FakeClock
) -> None:
    cfg = make_cfg(levels="1s 2s 3s 4s 5s")
    engine = quiet_engine(spark, cfg, clock)
    send(spark, cfg, "orders", "x", clock=clock)
    engine.step()
    settings = GroupConfig(max_reconsume_times=2, poll_timeout_ms=0)
    consumer = Consumer(spark, cfg, "g1", ["orders"], settings=settings, clock=clock)
    attempts = fail_until_dead(spark, cfg, clock, consumer, engine)
    assert [m.reconsume_times for m in attempts] == [0, 1, 2]
    retries = table_rows(spark, cfg, "retry_g1")
    assert [r["delay_level"] for r in retries] == [3, 4]
    assert [r["due_ms"] - r["store_ms"] for r in retries] == [3000, 4000]
    assert len(table_rows(spark, cfg, "dlq_g1")) == 1


def to_millis_naive(value: Any) -> int:
    """Milliseconds of a timestamp PySpark returned (naive, in the session's zone, UTC)."""
    from datetime import UTC

    return to_millis(value.replace(tzinfo=UTC))


def retry_sendbacks(spark: SparkSession, cfg: EngineConfig) -> list[dict[str, Any]]:
    log = spark.read.format("delta").load(layout(cfg).commitlog)
    return [r.asDict() for r in log.where(F.col("topic").startswith("retry_")).collect()]


def test_crash_between_nack_and_commit_retries_once(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    send(spark, cfg, "orders", "x", clock=clock)
    engine.step()

    # 1. nacked, then the process dies before commit: nothing was sent back
    dying = Consumer(spark, cfg, "billing", ["orders"], settings=FAST, clock=clock)
    (m,) = dying.poll(timeout=0)
    dying.nack(m, "crash before commit")
    del dying
    assert retry_sendbacks(spark, cfg) == []

    # 2. polled again after the restart; this time it dies after the commit was recorded
    #    but before the failed message reached commitlog
    second = Consumer(spark, cfg, "billing", ["orders"], settings=FAST, clock=clock)
    (again,) = second.poll(timeout=0)
    assert again.msg_id == m.msg_id and again.reconsume_times == 0
    second.nack(again, "crash after commit")

    def crash(*_args: Any, **_kw: Any) -> int:
        raise RuntimeError("killed")

    monkeypatch.setattr(GroupLog, "forward", crash)
    with pytest.raises(RuntimeError):
        second.commit()
    monkeypatch.undo()
    assert retry_sendbacks(spark, cfg) == []

    # 3. the restart forwards the recorded send-back, once, and does not poll it again
    third = Consumer(spark, cfg, "billing", ["orders"], settings=FAST, clock=clock).open()
    fourth = Consumer(spark, cfg, "billing", ["orders"], settings=FAST, clock=clock).open()
    sent = retry_sendbacks(spark, cfg)
    assert len(sent) == 1 and sent[0]["properties"]["RECONSUME_TIME"] == "1"
    assert third.poll(timeout=0) == [] and fourth.poll(timeout=0) == []
    clock.advance(seconds=1)
    engine.step()
    (retried,) = third.poll(timeout=0)
    assert retried.reconsume_times == 1 and retried.origin_msg_id == m.msg_id
    assert len(table_rows(spark, cfg, "retry_billing")) == 1


def test_poll_waits_returns_early_on_a_commit_and_empty_on_timeout(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    send(spark, cfg, "orders", "first", clock=clock)
    engine.step()
    consumer = Consumer(spark, cfg, "billing", ["orders"], clock=clock)
    assert bodies(consumer.poll(timeout=0)) == ["first"]
    consumer.ack()
    consumer.commit()

    started = time.monotonic()
    assert consumer.poll(timeout=1.5) == []
    assert time.monotonic() - started >= 1.5, "an empty poll waits out its timeout"

    waiting = threading.Event()  # the poll found nothing new and waits for a commit
    wait_for_commit = consumer._wait_for_commit

    def waits(deadline: float) -> bool:
        waiting.set()
        return wait_for_commit(deadline)

    monkeypatch.setattr(consumer, "_wait_for_commit", waits)

    def deliver_once_it_waits() -> None:
        if waiting.wait(60):
            send(spark, cfg, "orders", "second", clock=clock)
            engine.step()

    worker = threading.Thread(target=deliver_once_it_waits)
    worker.start()
    try:
        got = consumer.poll(timeout=120)
        returned = time.time()
    finally:
        worker.join()
    assert waiting.is_set() and bodies(got) == ["second"]
    # the commit that showed the row: its commitInfo time, taken just before it appeared
    committed = commit_times(layout(cfg).topic("orders"))[got[0].delivery_round] / 1000
    assert committed <= returned < committed + WOKEN_WITHIN_S, (
        f"returned {returned - committed:.2f}s after the rows were committed: "
        f"expected at once (probes every {WAKE_CHECK_SECONDS}s), not before, not at the timeout"
    )


def test_bad_calls_fail_clearly(spark: SparkSession, cfg: EngineConfig, clock: FakeClock) -> None:
    engine = quiet_engine(spark, cfg, clock)
    send_many(spark, cfg, [Message("orders", "a"), Message("orders", "b")], clock)
    engine.step()
    with pytest.raises(ConsumerError, match=r"unknown topic 'nosuch'.*orders"):
        Consumer(spark, cfg, "billing", ["nosuch"]).open()
    with pytest.raises(ConsumerError, match="consumer group 'bad-name'"):
        Consumer(spark, cfg, "bad-name", ["orders"])
    consumer = Consumer(spark, cfg, "billing", ["orders"], clock=clock)
    with pytest.raises(ConsumerError, match="timeout=-1"):
        consumer.poll(timeout=-1)
    with pytest.raises(ConsumerError, match="not in the current batch"):
        consumer.ack("ABC")
    batch = consumer.poll(max_messages=1, timeout=0)
    with pytest.raises(ConsumerError, match="not in the current batch"):
        consumer.nack("ABC", "x")
    with pytest.raises(ConsumerError, match="not committed"):
        consumer.poll(timeout=0)
    with pytest.raises(ConsumerError, match="neither acked nor nacked"):
        consumer.commit()
    consumer.ack(batch[0])
    consumer.commit()
    with pytest.raises(ConsumerError, match=r"unknown consumer group 'nobody'.*billing"):
        lag(spark, cfg, "nobody")


def test_a_member_that_dies_before_forwarding_has_its_sendbacks_forwarded_by_another(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Member A commits a nack while member C is between its own append and the check that
    reads it back, then dies before forwarding. C sees A's commit in that check: it takes
    A's position and forwards A's send-back (before, C carried on from its own commit, and
    a later forward of C's would have made A's look done)."""
    engine = quiet_engine(spark, cfg, clock)
    send_many(spark, cfg, [Message("orders", b) for b in ("x", "y", "z")], clock)
    engine.step()
    member_c = Consumer(spark, cfg, "billing", ["orders"], settings=FAST, clock=clock)
    member_a = Consumer(spark, cfg, "billing", ["orders"], settings=FAST, clock=clock)
    member_a.open()
    (first,) = bodies(member_c.poll(max_messages=1, timeout=0))
    member_c.ack()
    failed: list[str] = []
    original = GroupLog.append

    def append_then_a_commits(log: GroupLog, *args: Any, **kwargs: Any) -> bool:
        written = original(log, *args, **kwargs)
        if log is member_c._log:  # C's append landed; A commits before C reads it back
            with monkeypatch.context() as dying:
                dying.setattr(GroupLog, "append", original)
                (m,) = member_a.poll(max_messages=1, timeout=0)
                assert m.body.decode() != first, "A reads from C's commit"
                failed.append(m.body.decode())
                member_a.nack(m, "A fails it")
                dying.setattr(GroupLog, "forward", lambda *_a, **_k: 1 / 0)
                with pytest.raises(ZeroDivisionError):
                    member_a.commit()  # recorded, then A dies before forwarding
        return written

    monkeypatch.setattr(GroupLog, "append", append_then_a_commits)
    member_c.commit()
    monkeypatch.undo()
    sent = retry_sendbacks(spark, cfg)
    assert [r["body"].decode() for r in sent] == failed, "C forwarded A's send-back"
    rest = {"x", "y", "z"} - {first, *failed}
    assert set(bodies(member_c.poll(timeout=0))) == rest, "C read on from A's position"
    member_c.ack()
    member_c.commit()
    assert len(retry_sendbacks(spark, cfg)) == 1


@pytest.mark.parametrize(
    ("settings", "delay_ms"),
    [(FAST, None), (GroupConfig(max_reconsume_times=3), None), (FAST, 4500)],
    ids=["retry-delays", "levels", "own-delay"],
)
def test_a_polling_consumers_sendbacks_are_the_stream_consumers(
    spark: SparkSession, settings: GroupConfig, delay_ms: int | None
) -> None:
    """The polling consumer computes its send-backs on the driver, the stream consumer
    with Spark: the same failed rows give the same commitlog rows (retry, dead letter,
    an earlier failure history, a forged engine property)."""
    from datetime import UTC, datetime

    now = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    earlier = json.dumps([{"group": "billing", "attempt": 0, "reason": "r0", "at": "x"}])
    rows = [
        ("orders", "M1", {"region": "eu", "RECONSUME_TIME": "9"}, 0),
        ("retry_billing", "M2", {"RETRY_TOPIC": "orders", "RECONSUME_TIME": "1",
                                 "ORIGIN_MESSAGE_ID": "M0", PROP_FAILURES: earlier}, 1),
        ("retry_billing", "M3", {"RETRY_TOPIC": "orders", "RECONSUME_TIME": "3",
                                 "ORIGIN_MESSAGE_ID": "M9", PROP_FAILURES: "not json"}, 3),
    ]  # fmt: skip
    born = datetime(2026, 11, 25, 11, 0, tzinfo=UTC)
    frame = spark.createDataFrame(
        [(t, m, "orders", ["k"], "TagA", p, b"body", born, "failed: " + m, delay_ms)
         for t, m, p, _ in rows],
        "table string, msg_id string, topic string, keys array<string>, tags string, "
        "properties map<string,string>, body binary, born_ts timestamp, reason string, "
        "delay_ms long",
    )  # fmt: skip
    frame = frame.withColumn("delivery_round", F.lit(1).cast("long")).withColumn(
        "deliver_ts", F.lit(now).cast("timestamp")
    )
    by_spark = {
        r["msg_id"]: (r["kind"], r["sendback"].asDict())
        for r in sendback_rows(consumer_columns(frame), "billing", settings, now).collect()
    }
    for _, msg_id, props, times in rows:
        real = "orders"
        origin = props.get("ORIGIN_MESSAGE_ID", msg_id)
        failed = {
            "msg_id": msg_id, "keys": ["k"], "tags": "TagA", "properties": props,
            "body": b"body", "born_ts": born, "real_topic": real, "reconsume_times": times,
            "origin_msg_id": origin, "reason": "failed: " + msg_id, "delay_ms": delay_ms,
        }  # fmt: skip
        kind, back = sendback_record(failed, "billing", settings, now)
        spark_kind, spark_back = by_spark[msg_id]
        assert kind == spark_kind, msg_id
        for name in ("born_ts", "store_ts", "deliver_at"):
            value = spark_back[name]
            spark_back[name] = None if value is None else value.astimezone(UTC)
        spark_props = spark_back.pop("properties")
        props_here = back.pop("properties")
        assert json.loads(props_here.pop(PROP_FAILURES)) == json.loads(
            spark_props.pop(PROP_FAILURES)
        ), msg_id
        assert props_here == spark_props, msg_id
        assert back == spark_back, msg_id


def test_spark_helper_sends_failures_down_the_same_path(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    send_many(spark, cfg, [Message("orders", "ok"), Message("orders", "bad")], clock)
    engine.step()
    seen: list[str] = []

    def handler(batch: DataFrame) -> DataFrame:
        seen.extend(r["body"].decode() for r in batch.collect())
        return batch.select(
            "msg_id", F.when(F.col("body") == F.lit(b"bad"), F.lit("rejected")).alias("error")
        )

    def run(h: Any) -> None:
        query = consume_stream(
            spark, cfg, "audit", ["orders"], h, settings=FAST, clock=clock, available_now=True
        )
        try:
            query.awaitTermination()
        finally:
            query.stop()

    run(handler)
    assert sorted(seen) == ["bad", "ok"]
    engine.step()
    clock.advance(seconds=1)
    engine.step()

    def raising(batch: DataFrame) -> DataFrame:
        seen.append(f"raised on {batch.count()}")
        # fails only when Spark runs the result, after the handler returned
        return batch.select("msg_id", F.raise_error(F.lit("handler bug")).alias("error"))

    run(raising)  # the retried "bad": the handler raises, the stream does not
    assert seen[-1] == "raised on 1"
    retries = table_rows(spark, cfg, "retry_audit")
    assert len(retries) == 1 and retries[0]["properties"]["RECONSUME_TIME"] == "1"
    sent = [r for r in retry_sendbacks(spark, cfg) if r["topic"] == "retry_audit"]
    assert sorted(r["properties"]["RECONSUME_TIME"] for r in sent) == ["1", "2"]
    reasons = json.loads(max(sent, key=lambda r: r["properties"]["RECONSUME_TIME"])[
        "properties"][PROP_FAILURES])  # fmt: skip
    assert reasons[0]["reason"] == "rejected" and "handler bug" in reasons[1]["reason"]
    run(handler)  # nothing new: the stream's checkpoint kept its place
    assert seen[-1] == "raised on 1"
    by_table = {r["topic"]: r["lag"] for r in lag(spark, cfg, "audit").collect()}
    assert by_table == {"orders": 0, "retry_audit": 0}


def dlq_cli(
    capsys: pytest.CaptureFixture[str], cfg: EngineConfig, *args: str
) -> tuple[int, str, str]:
    from engine.cli import main

    settings = {"lakehouse.path": cfg.lakehouse, "lakehouse.database": cfg.database}
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    command, *rest = args
    words = [command, rest[0], *overrides, *rest[1:]] if command == "dlq" else [
        command, *overrides, *rest]  # fmt: skip
    code = main(words)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dead_letters_list_show_resend_purge_and_lag_in_sql(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    one, two = send_many(
        spark, cfg, [Message("orders", "p1", keys="k1"), Message("orders", "p2", keys="k2")], clock
    )
    engine.step()
    strict = GroupConfig(max_reconsume_times=0, poll_timeout_ms=0)
    consumer = Consumer(spark, cfg, "billing", ["orders"], settings=strict, clock=clock)
    for m in consumer.poll(timeout=0):
        consumer.nack(m, f"bad {m.body.decode()}")
    assert consumer.commit() == 2
    engine.step()

    code, out, _ = dlq_cli(capsys, cfg, "dlq", "list", "--group", "billing")
    assert code == 0 and "bad p1" in out and "bad p2" in out and "false" in out
    code, out, _ = dlq_cli(capsys, cfg, "dlq", "show", "--group", "billing", one)
    assert code == 0 and "reason        bad p1" in out and "attempt 0" in out and one in out

    # the CLI's clock is the system clock; the engine here runs on a fake one
    assert len(resend(spark, cfg, "billing", key="k1", clock=clock)) == 1
    code, _, err = dlq_cli(capsys, cfg, "dlq", "resend", "--group", "billing", "--key", "k1")
    assert code == 2 and "already resent" in err
    engine.step()
    (back,) = consumer.poll(timeout=0)
    assert back.body == b"p1" and back.topic == "orders" and back.reconsume_times == 0
    assert back.origin_msg_id == one and back.msg_id != one
    consumer.ack()
    clock.advance(seconds=1)  # the group's last commit, a second after its first
    last_commit = clock.now()
    consumer.commit()

    code, _, err = dlq_cli(capsys, cfg, "dlq", "purge", "--group", "billing", "--all")
    assert code == 2 and "--yes" in err, "no confirmation, nothing deleted"
    code, out, _ = dlq_cli(capsys, cfg, "dlq", "purge", "--group", "billing", "--id", two, "--yes")
    assert code == 0 and "purged 1" in out
    code, out, _ = dlq_cli(capsys, cfg, "dlq", "list", "--group", "billing")
    assert "bad p1" in out and "bad p2" not in out and "true" in out
    code, _, err = dlq_cli(capsys, cfg, "dlq", "list", "--group", "nobody")
    assert code == 2 and "no dead letters" in err and "billing" in err

    from engine.lakehouse.catalog.names import register_lag_view

    register_lag_view(spark, cfg)
    rows = spark.sql(f"SELECT group_name, topic, lag FROM {cfg.database}.consumer_lag").collect()
    assert {(r[0], r[1], r[2]) for r in rows} == {("billing", "orders", 0)}
    send(spark, cfg, "orders", "p3", clock=clock)
    engine.step()
    code, out, _ = dlq_cli(capsys, cfg, "status")
    assert code == 0 and "billing" in out
    committed = str(last_commit.replace(tzinfo=None))  # as the CLI shows a UTC time
    assert [line.split() for line in out.splitlines() if line.startswith("billing")] == [
        ["billing", "orders", "1", *committed.split()]
    ]


def test_polls_across_many_rounds_and_a_compaction_return_each_message_once_in_order(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    for i in range(6):  # six rounds of five messages, one topic table file each
        send_many(spark, cfg, [Message("orders", f"r{i}-{j}") for j in range(5)], clock)
        engine.step()
        clock.advance(seconds=1)
    consumer = Consumer(spark, cfg, "billing", ["orders"], clock=clock)
    seen: list[Received] = []
    for _ in range(3):
        batch = consumer.poll(max_messages=4, timeout=0)
        seen += batch
        consumer.ack()
        consumer.commit()
    path = layout(cfg).topic("orders")
    spark.sql(f"OPTIMIZE delta.`{path}`")  # every row rewritten into one file
    send_many(spark, cfg, [Message("orders", f"late-{j}") for j in range(3)], clock)
    engine.step()
    while batch := consumer.poll(max_messages=4, timeout=0):
        seen += batch
        consumer.ack()
        consumer.commit()
    assert sorted(bodies(seen)) == sorted(
        [f"r{i}-{j}" for i in range(6) for j in range(5)] + [f"late-{j}" for j in range(3)]
    )
    rows = table_rows(spark, cfg, "orders")  # delivery order, as the table has it
    assert len(rows) == 33
    assert [m.position for m in seen] == sorted({m.position for m in seen})  # ascending, once


def test_a_consumer_stream_whose_batch_fails_says_so_in_one_line(
    spark: SparkSession,
    cfg: EngineConfig,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Spark's own line about a query's end goes to spark.log only (conf/log4j2.properties):
    the stream says why it stopped itself, naming the group and the batch."""
    import engine.consume.stream as stream

    engine = quiet_engine(spark, cfg, clock)
    send_many(spark, cfg, [Message("orders", "a")], clock)
    engine.step()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(stream, "_stream_batch", broken)
    query = consume_stream(
        spark, cfg, "audit", ["orders"], lambda b: None, settings=FAST, clock=clock,
        available_now=True,
    )  # fmt: skip
    try:
        with pytest.raises(Exception, match="disk full"):
            query.awaitTermination()
    finally:
        query.stop()
    said = [r.getMessage() for r in caplog.records if r.name == "engine.consume.stream"]
    assert said == ["consumer group audit: batch 0 failed, its stream stops: OSError: disk full"]
