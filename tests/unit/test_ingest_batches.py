"""The Kafka ingest's batches: each commit carries every partition's next offset, and a
batch read again after a crash stores nothing twice."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from engine.core.config import EngineConfig
from engine.lakehouse.delta.delta_log import Txn
from engine.produce.kafka_ingest import Positions, write_batch
from engine.produce.kafka_records import kafka_records

NOW = datetime(2026, 3, 1, 12, tzinfo=UTC)
CFG = EngineConfig()


class Table:
    """Keeps what was appended (the real appends are tested in tests/integration)."""

    def __init__(self) -> None:
        self.commits: list[tuple[list[bytes], dict[str, int]]] = []

    def append(self, rows: pa.Table, *, txn: Txn, metadata: Any = None) -> None:
        self.commits.append((rows["body"].to_pylist(), {t.app_id: t.version for t in txn.all()}))


def records(*where: tuple[str, int, int, str]) -> pa.Table:
    """Records (topic, partition, offset, body); a body starting with "bad" has a bad delay."""
    return kafka_records([
        {"topic": t, "partition": p, "offset": o, "timestamp": 0, "value": body.encode(),
         "headers": [("REAL_TOPIC", b"orders")] + ([("DELAY", b"x")] if body.startswith("bad")
                                                  else [])}
        for t, p, o, body in where
    ])  # fmt: skip


def test_a_commit_records_the_next_offset_of_every_partition_in_its_batch() -> None:
    commitlog, quarantine, positions = Table(), Table(), Positions()
    batch = records(("in", 0, 4, "a"), ("in", 1, 9, "bad1"), ("in", 0, 5, "b"), ("x", 0, 0, "c"))
    assert write_batch(commitlog, quarantine, CFG, batch, positions, NOW) == (3, 1)  # type: ignore[arg-type]
    offsets = {"delayq-kafka-offset-in-0": 6, "delayq-kafka-offset-in-1": 10,
               "delayq-kafka-offset-x-0": 1}  # fmt: skip
    assert commitlog.commits == [([b"a", b"b", b"c"], offsets)]
    assert quarantine.commits == [([b"bad1"], offsets)]  # written first, its own positions
    assert positions.commitlog == positions.quarantine == {("in", 0): 6, ("in", 1): 10, ("x", 0): 1}


def test_a_batch_of_bad_records_only_still_moves_commitlog_s_position() -> None:
    commitlog, quarantine, positions = Table(), Table(), Positions()
    write_batch(commitlog, quarantine, CFG, records(("in", 0, 0, "bad")), positions, NOW)  # type: ignore[arg-type]
    assert commitlog.commits == [([], {"delayq-kafka-offset-in-0": 1})]


def test_a_batch_read_again_stores_only_what_each_table_has_not() -> None:
    # quarantine committed up to 3, commitlog only up to 1 (a crash between the two)
    positions = Positions(commitlog={("in", 0): 1}, quarantine={("in", 0): 3})
    commitlog, quarantine = Table(), Table()
    batch = records(
        ("in", 0, 0, "a"), ("in", 0, 1, "b"), ("in", 0, 2, "bad2"), ("in", 0, 3, "bad3")
    )
    assert write_batch(commitlog, quarantine, CFG, batch, positions, NOW) == (1, 1)  # type: ignore[arg-type]
    assert commitlog.commits == [([b"b"], {"delayq-kafka-offset-in-0": 4})]
    assert quarantine.commits == [([b"bad3"], {"delayq-kafka-offset-in-0": 4})]
    # and once more: all stored, nothing committed
    assert write_batch(commitlog, quarantine, CFG, batch, positions, NOW) == (0, 0)  # type: ignore[arg-type]
    assert len(commitlog.commits) == len(quarantine.commits) == 1


def test_a_txn_is_recorded_only_when_every_pair_is() -> None:
    txn = Txn("a", 3, also=(Txn("b", 5),))
    assert txn.recorded_in({"a": 3, "b": 5}.get) and txn.recorded_in({"a": 4, "b": 9}.get)
    assert not txn.recorded_in({"a": 3}.get) and not txn.recorded_in({"a": 9, "b": 4}.get)
