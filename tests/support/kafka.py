"""A real single-node Kafka broker per test module, and plain kafka-python helpers."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.lakehouse.catalog.session import REPO_ROOT
from engine.produce.kafka_ingest import start_ingest
from jobs.tools.broker import Broker, start, stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A real single-node broker on free ports; use as a module-scoped fixture's body."""
    home = tmp_path_factory.mktemp("kafka")
    broker = start(home, free_port(), free_port(), lib=REPO_ROOT / ".kafka" / "lib")
    try:
        yield broker
    finally:
        stop(home)


def kafka_cfg(make_cfg: Any, broker: Broker, **changes: Any) -> EngineConfig:
    return make_cfg(kafka_bootstrap=broker.bootstrap_servers, **changes)  # type: ignore[no-any-return]


def produce(
    broker: Broker, topic: str, records: list[tuple[bytes | None, bytes, list[Any]]]
) -> None:
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap_servers, acks="all")
    for key, value, headers in records:
        producer.send(topic, key=key, value=value, headers=headers)
    producer.flush()
    producer.close()


def consume(
    broker: Broker, topic: str, expected: int, isolation_level: str = "read_uncommitted"
) -> list[Any]:
    """Every record of ``topic`` there is to read at ``isolation_level``, once at least
    ``expected`` are (waits up to 30 s for them): read up to each partition's end offset,
    the last stable one for ``read_committed``, rather than until the broker goes quiet."""
    consumer = KafkaConsumer(
        bootstrap_servers=broker.bootstrap_servers,
        group_id=None,
        enable_auto_commit=False,
        isolation_level=isolation_level,
    )
    records: list[Any] = []
    deadline = time.monotonic() + 30
    try:
        parts: list[TopicPartition] = []
        while not parts and time.monotonic() < deadline:
            found = consumer.partitions_for_topic(topic) or set()
            parts = [TopicPartition(topic, p) for p in sorted(found)]
            if not parts:
                time.sleep(0.1)
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        while time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(batch)
            ends = consumer.end_offsets(parts)
            if len(records) >= expected and all(consumer.position(p) >= ends[p] for p in parts):
                break
    finally:
        consumer.close()
    return records


def ingest(spark: SparkSession, cfg: EngineConfig, clock: FakeClock) -> None:
    query = start_ingest(spark, cfg, clock, available_now=True)
    try:
        query.awaitTermination()
    finally:
        query.stop()


def rows(spark: SparkSession, path: str) -> list[dict[str, Any]]:
    df = spark.read.format("delta").load(path)
    df = df.select("*", F.unix_millis("store_ts").alias("store_ms"))
    if "deliver_at" in df.columns:
        df = df.select("*", F.unix_millis("deliver_at").alias("at_ms"))
    return [r.asDict() for r in df.collect()]
