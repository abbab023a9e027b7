"""The exactly-once Kafka sink's bookkeeping: when it trusts the markers it read.

The broker side (transactions, fencing, a crash between the transaction and the round
commit) is proven against a real broker in ``tests/integration/test_kafka.py``; this is the
order of calls around a failed write, which a broker cannot be made to produce on demand
(a commit that times out and lands all the same).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pytest

from engine.core.config import EngineConfig
from engine.deliver import kafka_sink
from engine.deliver.kafka_sink import TransactionalKafkaSink
from engine.lakehouse.storage.layout import layout


class StandIn:
    """Stands in for the driver JVM's sender: records opens, fails the sends it is told to."""

    def __init__(self, calls: list[str], fail: set[str], table: str) -> None:
        self.calls, self.fail, self.table = calls, fail, table

    def open(self) -> None:
        self.calls.append(f"open {self.table}")

    def send(self, topic: str, rows: pa.Table, marker: Any) -> None:
        self.calls.append(f"send {topic}")
        if topic in self.fail:
            raise RuntimeError("commitTransaction timed out")

    def close(self) -> None:
        self.calls.append(f"close {self.table}")


@pytest.fixture
def sink(monkeypatch: pytest.MonkeyPatch) -> tuple[TransactionalKafkaSink, list[str], set[str]]:
    calls: list[str] = []
    fail: set[str] = set()
    markers = [{"cp/a": 4, "cp/b": 4}, {"cp/a": 5, "cp/b": 4}]  # the second read: a landed

    def reads(bootstrap: str, timeout_s: float) -> dict[str, int]:
        calls.append("read markers")
        return dict(markers.pop(0))

    def made(spark: Any, settings: dict[str, str]) -> StandIn:
        return StandIn(calls, fail, settings["transactional.id"].rsplit("-", 1)[1])

    monkeypatch.setattr(kafka_sink, "read_markers", reads)
    monkeypatch.setattr(kafka_sink, "ensure_markers_topic", lambda bootstrap: None)
    monkeypatch.setattr(kafka_sink, "_JvmSender", made)
    cfg = EngineConfig(
        lakehouse="/nowhere", kafka_sinks=MappingProxyType({"a": "kafka", "b": "kafka"})
    )
    return TransactionalKafkaSink(None, cfg, layout(cfg), "cp"), calls, fail  # type: ignore[arg-type]


def test_after_a_failed_write_the_markers_are_read_again_with_every_producer_opened(
    sink: tuple[TransactionalKafkaSink, list[str], set[str]],
) -> None:
    sink_, calls, fail = sink
    rows = pa.table({"msg_id": ["m1"]})
    assert not sink_.written(5, "a") and not sink_.written(5, "b")  # a replay of round 5
    fail.add("a")
    with pytest.raises(RuntimeError):
        sink_.write(5, "a", rows, True)  # its commit timed out, and landed all the same
    calls.clear()
    # The round is replayed: the markers read before the failure no longer count.
    assert sink_.written(5, "a"), "the transaction that landed is not sent again"
    assert calls == ["open a", "open b", "read markers"]
    assert not sink_.written(5, "b")


def test_a_write_that_succeeds_counts_without_another_read(
    sink: tuple[TransactionalKafkaSink, list[str], set[str]],
) -> None:
    sink_, calls, _ = sink
    assert not sink_.written(5, "b")
    sink_.write(5, "b", pa.table({"msg_id": ["m1"]}), True)
    assert sink_.written(5, "b") and calls.count("read markers") == 1
    sink_.close()
    assert calls[-2:] == ["close a", "close b"]
