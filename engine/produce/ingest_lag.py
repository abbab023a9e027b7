"""How far the Kafka ingest is behind: records in Kafka not yet stored in ``commitlog``.

The ingest job (:mod:`engine.produce.kafka_ingest`) is a Structured Streaming query whose
checkpoint, ``_checkpoints/kafka_ingest``, records per micro-batch the Kafka offsets it read up
to (``offsets/<batch>``) and which batches are stored (``commits/<batch>``). A partition's lag
is its end offset in Kafka minus the offset of the last stored batch. Reading the checkpoint
needs no Spark, so the engine's metrics can show the lag of an ingest job running elsewhere.

Example:
    >>> ingest_lag(cfg)  # doctest: +SKIP
    {'delayq_in': 1200}
"""

from __future__ import annotations

import json

from engine.core.config import EngineConfig
from engine.lakehouse.fs import list_files, read_text
from engine.lakehouse.layout import layout

#: The ingest stream's checkpoint, under the lakehouse's ``_checkpoints``.
INGEST_CHECKPOINT = "kafka_ingest"


def _batches(folder: str) -> list[int]:
    return sorted(int(name) for name in list_files(folder) if name.isdigit())


def stored_offsets(checkpoint: str) -> dict[tuple[str, int], int] | None:
    """(topic, partition) -> the next offset to read after the last stored batch.

    ``None`` when the stream has not stored a batch yet (or never ran).

    Example:
        >>> stored_offsets("/nonexistent/_checkpoints/kafka_ingest") is None
        True
    """
    folder = checkpoint.rstrip("/")
    committed = _batches(f"{folder}/commits")
    if not committed:
        return None
    offsets: dict[tuple[str, int], int] = {}
    lines = (read_text(f"{folder}/offsets/{committed[-1]}") or "").splitlines()
    for line in lines[2:]:  # "v1", the batch's metadata, then one line per source
        try:
            source = json.loads(line)
        except ValueError:
            continue
        if not isinstance(source, dict):
            continue
        for topic, partitions in source.items():
            if isinstance(partitions, dict):
                for partition, offset in partitions.items():
                    offsets[(topic, int(partition))] = int(offset)
    return offsets


def ingest_lag(cfg: EngineConfig, timeout_s: float = 5.0) -> dict[str, int] | None:
    """Records per Kafka topic not yet stored by the ingest job; ``None`` if it never stored
    a batch in this lakehouse.

    Raises:
        kafka.errors.KafkaError: the brokers (``kafka.bootstrap_servers``) cannot be asked.
    """
    stored = stored_offsets(layout(cfg).checkpoint(INGEST_CHECKPOINT))
    if stored is None:
        return None
    from kafka import KafkaConsumer, TopicPartition

    ms = int(timeout_s * 1000)
    consumer = KafkaConsumer(
        bootstrap_servers=cfg.kafka_bootstrap,
        request_timeout_ms=max(ms, 1000),
        bootstrap_timeout_ms=ms,
        enable_auto_commit=False,
    )
    try:
        topics = sorted({topic for topic, _ in stored})
        wanted = [
            TopicPartition(topic, partition)
            for topic in topics
            for partition in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        ends = consumer.end_offsets(wanted) if wanted else {}
    finally:
        consumer.close()
    lag = dict.fromkeys(topics, 0)
    for part, end in ends.items():
        lag[part.topic] += max(int(end) - stored.get((part.topic, part.partition), 0), 0)
    return lag
