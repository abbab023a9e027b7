"""Receive with invisibility (RocketMQ 5's SimpleConsumer): receive, ack, change_invisible,
the invisible time running out, reconsume count and dead letters."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from pyspark.sql import SparkSession

from engine.consume.consumer import Received
from engine.consume.lag import members
from engine.control.simple_consumer import SimpleConsumer
from engine.core.clock import FakeClock
from engine.core.config import EngineConfig, GroupConfig
from engine.core.errors import ConsumerError
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from engine.run.engine import Engine
from tests.support.lakehouse import quiet_engine
from tests.support.process import cli

pytestmark = pytest.mark.integration

FAST = GroupConfig(max_reconsume_times=2, poll_timeout_ms=0)


def _by_body(batch: list[Received]) -> dict[str, Received]:
    return {m.body.decode(): m for m in batch}


def _run(engine: Engine, clock: FakeClock, seconds: float) -> None:
    """Let ``seconds`` pass, a round each second (the copies are stamped, then due)."""
    for _ in range(round(seconds)):
        clock.advance(seconds=1)
        engine.step()


def test_receive_hides_messages_until_acked_or_their_time_is_over(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    send_many(spark, cfg, [Message("orders", b) for b in ("done", "slow", "lost")], clock)
    engine.step()

    def member(name: str) -> SimpleConsumer:
        return SimpleConsumer(
            spark, cfg, "workers", ["orders"], invisible=5, settings=FAST, clock=clock, name=name
        )

    first, second = member("member-1"), member("member-2")
    got = _by_body(first.receive(max_messages=10))
    assert sorted(got) == ["done", "lost", "slow"] and all(m.receipt for m in got.values())
    assert second.receive(max_messages=10) == [], "received messages are hidden from members"
    assert first.ack(got["done"], wait=0) == ["pending"]  # decided by the engine's next round
    assert first.change_invisible(got["slow"], 20, wait=0) == "pending"
    _run(engine, clock, 6)  # t=6: "lost" is back, to the other member
    back = second.receive(max_messages=10)
    assert [(m.body, m.reconsume_times) for m in back] == [(b"lost", 1)], "only the unacked one"
    assert back[0].topic == "orders"
    # a copy (README): an id of its own, the first message's id as its origin
    assert back[0].msg_id != got["lost"].msg_id
    assert back[0].origin_msg_id == got["lost"].msg_id == got["lost"].origin_msg_id
    _run(engine, clock, 6)  # t=12: back again, the last time before the dead letters
    (again,) = first.receive(max_messages=10)
    assert (again.body, again.reconsume_times) == (b"lost", 2)
    assert again.msg_id not in (back[0].msg_id, got["lost"].msg_id)
    assert again.origin_msg_id == got["lost"].msg_id
    _run(engine, clock, 6)  # t=18: not acknowledged: dead
    assert first.receive(max_messages=10) == []
    dead = spark.read.format("delta").load(layout(cfg).topic("dlq_workers")).collect()
    assert [(r["body"], r["properties"]["DLQ_REASON"]) for r in dead] == [
        (b"lost", "not acknowledged within 5 s")
    ]
    _run(engine, clock, 3)  # t=21: "slow", hidden 20 s from t=0
    slow = second.receive(max_messages=10)
    assert [(m.body, m.reconsume_times) for m in slow] == [(b"slow", 1)]
    assert second.ack(*slow, wait=0) == ["pending"]
    _run(engine, clock, 8)
    assert first.receive(max_messages=10) == [], "acknowledged messages never come back"
    # each member's share: first received done, slow, lost and lost again; second lost, slow
    shares = {r["consumer"]: r for r in members(spark, cfg, clock.now(), "workers").collect()}
    assert {m: (r["handled"], r["share"]) for m, r in shares.items()} == {
        "member-1": (4, 0.667),
        "member-2": (2, 0.333),
    }
    code, out, _ = cli(capsys, cfg, "lag", "--members", "--group", "workers")
    assert code == 0 and "member-1" in out and "member-2" in out, out


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"invisible": 0.5}, "at least 1 s"), ({"invisible": "5s"}, "expected seconds")],
)
def test_bad_invisible_times_fail_clearly(
    spark: SparkSession, cfg: EngineConfig, kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ConsumerError, match=needle):
        SimpleConsumer(spark, cfg, "workers", ["orders"], **kwargs)


def test_three_members_share_three_topics_and_a_dead_members_messages_come_to_the_others(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    """Real clock, the engine in the background. A third member receives a batch and dies
    without acknowledging it; two members in threads share the rest, and the dead member's
    messages come to them when their invisible time is over. The second member joins while
    the first is consuming (after the first's first batch), and the first leaves after its
    second batch. The invisible time counts from the receiving commit; 20 s leaves the live
    members room for a busy machine's pauses (the dead one's 3 s: nobody waits on it)."""
    ids = send_many(spark, cfg, [Message(f"t{i % 3}", f"m{i}") for i in range(60)])
    engine = Engine(spark, cfg, out=lambda _: None)
    engine.start()
    acked: list[tuple[str, str]] = []  # (member, origin id)
    handed: list[tuple[str, str, int]] = []  # (member, msg id, reconsume times)
    lock = threading.Lock()
    done = threading.Event()

    def simple(name: str) -> SimpleConsumer:
        return SimpleConsumer(
            spark, cfg, "workers", ["t0", "t1", "t2"], invisible=20, settings=FAST, name=name
        )

    first_batch, left = threading.Event(), threading.Event()

    def member(name: str, leave_after: int | None = None) -> None:
        consumer = simple(name)
        batches = 0
        while not done.is_set():
            batch = consumer.receive(max_messages=8, timeout=1)
            with lock:
                handed.extend((name, m.msg_id, m.reconsume_times) for m in batch)
            if batch:
                statuses = consumer.ack(*batch, wait=30)
                assert set(statuses) == {"cancelled"}, statuses
                batches += 1
                first_batch.set()
                with lock:
                    acked.extend((name, m.origin_msg_id) for m in batch)
                    if {origin for _, origin in acked} >= set(ids):
                        done.set()
                if batches == leave_after:
                    consumer.close()
                    left.set()
                    return

    threads = [
        threading.Thread(target=member, args=("member-1", 2)),
        threading.Thread(target=member, args=("member-2",)),
    ]
    try:
        dying: list[Received] = []
        for _ in range(60):  # the engine delivers, then the third member takes a batch
            dying = simple("member-3").receive(max_messages=8, timeout=1, invisible=3)
            if dying:
                break
        assert dying, "the third member received a batch"
        handed.extend(("member-3", m.msg_id, m.reconsume_times) for m in dying)
        threads[0].start()
        assert first_batch.wait(120), "the first member acknowledged a batch"
        threads[1].start()  # joins while the first is consuming
        assert done.wait(240), f"{len({o for _, o in acked})} of {len(ids)} acknowledged"
    finally:
        done.set()
        for thread in threads:
            thread.join(60)
        engine.stop()
    origins = [origin for _, origin in acked]
    assert sorted(origins) == sorted(ids), "each message acknowledged once, by a live member"
    by_member = {name: sum(1 for n, _ in acked if n == name) for name in ("member-1", "member-2")}
    assert all(by_member.values()), by_member
    assert left.is_set(), "the first member left after two batches, the second finished"
    first_time = [msg_id for _, msg_id, times in handed if times == 0]
    assert len(first_time) == len(set(first_time)) == len(ids), "never to two members at once"
    came_back = [name for name, _, times in handed if times == 1]
    assert len(came_back) == len(dying) and "member-3" not in came_back
