"""Subscriptions with RocketMQ's filters: a tag expression and a SQL92 property condition."""

from __future__ import annotations

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.consume.consumer import Consumer, Received
from engine.consume.lag import lag
from engine.consume.stream import consume_stream
from engine.core.clock import FakeClock
from engine.core.config import EngineConfig, GroupConfig
from engine.core.errors import ConsumerError
from engine.produce.send import Message, send_many
from tests.support.lakehouse import quiet_engine

pytestmark = pytest.mark.integration

FAST = GroupConfig(max_reconsume_times=3, retry_delays=(1000, 2000, 3000), poll_timeout_ms=0)


def _order(n: int, tag: str, region: str | None, amount: str) -> Message:
    props = {"amount": amount} | ({"region": region} if region else {})
    return Message("orders", f"o{n}", tags=tag, properties=props)


ORDERS = [
    _order(0, "A", "eu", "150"),  # both filters match
    _order(1, "B", "eu", "99"),  # amount too small
    _order(2, "C", "eu", "500"),  # tag C
    _order(3, "B", "us", "700"),  # region
    _order(4, "A", None, "300"),  # no region: unknown, not taken
    _order(5, "B", "eu", "not a number"),  # not a number: not taken
    _order(6, "B", "eu", " 1e3 "),  # a number with spaces: taken
]


def _bodies(batch: list[Received]) -> list[str]:
    return sorted(m.body.decode() for m in batch)


def _lag(spark: SparkSession, cfg: EngineConfig, group: str) -> int:
    rows = lag(spark, cfg, group).where("topic = 'orders'").collect()
    return int(rows[0]["lag"])


def test_tag_and_sql_filters_take_only_matching_messages_and_pass_the_rest(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    send_many(spark, cfg, ORDERS, clock)
    engine.step()

    def consumer(group: str, **filters: str) -> Consumer:
        return Consumer(spark, cfg, group, ["orders"], clock=clock, settings=FAST, **filters)

    both = consumer("eu_big", tags="A || B", where="region = 'eu' AND amount > 100")
    got = both.poll(max_messages=10)
    assert _bodies(got) == ["o0", "o6"]
    both.ack()
    both.commit()
    assert _lag(spark, cfg, "eu_big") == 0, "the messages the filters left out count as consumed"

    tagged = consumer("tagged", tags="C")
    assert _bodies(tagged.poll(max_messages=10)) == ["o2"]
    sql = consumer("sql", where="region IN ('us', 'eu') AND NOT amount BETWEEN 100 AND 600")
    assert _bodies(sql.poll(max_messages=10)) == ["o1", "o3", "o6"]
    not_in = consumer("not_in", where="region NOT IN ('us') AND amount NOT IN (99, 150)")
    assert _bodies(not_in.poll(max_messages=10)) == ["o2", "o6"], "a missing region is unknown"
    every = consumer("every", tags="*")
    assert _bodies(every.poll(max_messages=10)) == [f"o{i}" for i in range(7)]

    # Only messages no filter takes: an empty poll, and a commit passes them.
    send_many(spark, cfg, [_order(7, "A", "us", "5"), _order(8, "C", "eu", "900")], clock)
    clock.advance(seconds=1)
    engine.step()
    assert both.poll(max_messages=10) == []
    both.commit()
    assert _lag(spark, cfg, "eu_big") == 0

    # A failed message comes back through the group's retry topic, which is not filtered.
    send_many(spark, cfg, [_order(9, "A", "eu", "250")], clock)
    clock.advance(seconds=1)
    engine.step()
    (failing,) = both.poll(max_messages=10)
    both.nack(failing, "try later")
    both.commit()
    clock.advance(seconds=1)
    engine.step()
    clock.advance(seconds=1)
    engine.step()
    (again,) = both.poll(max_messages=10)
    assert again.body == b"o9" and again.reconsume_times == 1


@pytest.mark.parametrize(
    ("filters", "message"),
    [
        ({"tags": "A || "}, "bad tag expression 'A || '"),
        ({"tags": "A B"}, "bad tag expression 'A B'"),
        ({"where": "amount >"}, "bad SQL filter 'amount >'"),
        ({"where": "region > 'eu'"}, "strings compare with = or <> only"),
        ({"where": "(region = 'eu'"}, "expected ), found 'the end' at position 15"),
        ({"where": "region = 'eu' OR"}, "expected a property name"),
    ],
)
def test_a_bad_filter_fails_at_subscribe_naming_it(
    spark: SparkSession, cfg: EngineConfig, filters: dict[str, str], message: str
) -> None:
    with pytest.raises(ConsumerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Consumer(spark, cfg, "g", ["orders"], **filters)  # type: ignore[arg-type]


def test_broadcasting_members_each_get_every_message_with_their_own_positions(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    send_many(spark, cfg, ORDERS[:3], clock)
    engine.step()

    def member(name: str, **extra: object) -> Consumer:
        return Consumer(
            spark, cfg, "audit", ["orders"], clock=clock, settings=FAST, name=name,
            broadcast=True, **extra,  # type: ignore[arg-type]
        )  # fmt: skip

    a, b = member("host_a"), member("host_b")
    assert _bodies(a.poll(max_messages=10)) == ["o0", "o1", "o2"]
    a.ack()
    a.commit()
    got = b.poll(max_messages=10)
    assert _bodies(got) == ["o0", "o1", "o2"], "b is not held back by a"
    b.nack(next(m for m in got if m.body == b"o0"), "b's own failure")
    b.ack()
    b.commit()
    assert (a.group, b.group) == ("audit__host_a", "audit__host_b")
    assert _lag(spark, cfg, "audit__host_a") == 0
    by_member = lag(spark, cfg, "AUDIT").where("topic = 'orders'").collect()
    assert [r["group_name"] for r in by_member] == ["audit__host_a", "audit__host_b"], (
        "the group's lag lists its broadcasting members, whatever the case"
    )

    # A member restarted under its name goes on from its own position; a failure of b's
    # comes back to b alone (through its own retry topic).
    send_many(spark, cfg, [_order(9, "A", "eu", "1")], clock)
    clock.advance(seconds=1)
    engine.step()
    clock.advance(seconds=1)
    engine.step()
    assert _bodies(member("host_a").poll(max_messages=10)) == ["o9"]
    again = member("host_b").poll(max_messages=10)
    assert _bodies(again) == ["o0", "o9"]
    assert [m.reconsume_times for m in again if m.body == b"o0"] == [1]

    with pytest.raises(ConsumerError, match="broadcasting in group 'audit' needs name="):
        Consumer(spark, cfg, "audit", ["orders"], broadcast=True)
    with pytest.raises(ConsumerError, match="broadcasting in group 'audit' needs name="):
        Consumer(spark, cfg, "audit", ["orders"], broadcast=True, name="")
    with pytest.raises(ConsumerError, match="broadcasting member 'no way'"):
        member("no way")
    with pytest.raises(ConsumerError, match="broadcasting member 'a__b': expected a name"):
        member("a__b")


def test_a_stream_takes_the_filters_and_passes_the_rest(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    send_many(spark, cfg, ORDERS, clock)
    engine.step()
    seen: list[str] = []

    def handler(batch: DataFrame) -> DataFrame:
        seen.extend(sorted(r["body"].decode() for r in batch.collect()))
        return batch.select(
            "msg_id", F.when(F.col("body") == F.lit(b"o6"), F.lit("not yet")).alias("error")
        )

    def run() -> None:
        query = consume_stream(
            spark, cfg, "eu_stream", ["orders"], handler, settings=FAST, clock=clock,
            available_now=True, tags="A || B", where="region = 'eu' AND amount > 100",
        )  # fmt: skip
        try:
            query.awaitTermination()
        finally:
            query.stop()

    run()
    assert seen == ["o0", "o6"]
    assert _lag(spark, cfg, "eu_stream") == 0, "the messages the filters left out count as consumed"
    engine.step()  # stamps o6's send-back
    clock.advance(seconds=1)
    engine.step()
    run()  # o6 comes back through the retry topic, which the filters do not touch
    assert seen == ["o0", "o6", "o6"]

    with pytest.raises(ConsumerError, match="bad tag expression 'A B'"):
        consume_stream(spark, cfg, "eu_stream", ["orders"], handler, tags="A B")
