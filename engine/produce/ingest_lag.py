"""How far the Kafka ingest is behind: records in Kafka not yet stored in ``commitlog``.

The ingest (:mod:`engine.produce.kafka_ingest`) records in each ``commitlog`` commit the next
offset of every partition it stored, as Delta's ``txnAppId``/``txnVersion`` =
(:func:`offset_app_id`, offset). A partition's lag is its end offset in Kafka minus that.
Reading the table's log needs no Spark, so the engine's metrics can show the lag of an
ingest job running elsewhere. The Spark stream of earlier versions kept its offsets in
``_checkpoints/kafka_ingest`` instead (:func:`stored_offsets`): they count for partitions the
log has no offset for yet.

Example:
    >>> ingest_lag(cfg)  # doctest: +SKIP
    {'delayq_in': 1200}
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.core.config import EngineConfig
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.storage.fs import read_text, spark_batches, stream_query_id
from engine.lakehouse.storage.layout import layout

#: The checkpoint of the ingest's Spark stream in earlier versions (under ``_checkpoints``).
INGEST_CHECKPOINT = "kafka_ingest"


def offset_app_id(topic: str, partition: int) -> str:
    """The ``txnAppId`` under which a table records the next offset of a partition.

    Example:
        >>> offset_app_id("delayq_in", 3)
        'delayq-kafka-offset-delayq_in-3'
    """
    return f"delayq-kafka-offset-{topic}-{partition}"


def stored_offsets(
    checkpoint: str, stored_batch: int | None = None
) -> dict[tuple[str, int], int] | None:
    """(topic, partition) -> the next offset to read after the last stored batch.

    ``stored_batch``: the last batch the stream's own ``txn`` in ``commitlog`` says was
    stored; it counts when Spark had not recorded it yet (a crash between the append and
    ``commits/<batch>``). ``None`` when the stream has not stored a batch (or never ran).

    Example:
        >>> stored_offsets("/nonexistent/_checkpoints/kafka_ingest") is None
        True
    """
    folder = checkpoint.rstrip("/")
    committed = spark_batches(f"{folder}/commits")
    batch = committed[-1] if committed else None
    if (
        stored_batch is not None
        and (batch is None or stored_batch > batch)
        and read_text(f"{folder}/offsets/{stored_batch}") is not None
    ):
        batch = stored_batch
    if batch is None:
        return None
    offsets: dict[tuple[str, int], int] = {}
    lines = (read_text(f"{folder}/offsets/{batch}") or "").splitlines()
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


@dataclass(frozen=True)
class StreamPositions:
    """Where the Spark stream of earlier versions got to: the offsets to read again from
    (its last recorded batch), and what each table holds beyond them (a batch appended
    before a crash stopped Spark recording it)."""

    start: dict[tuple[str, int], int]
    commitlog: dict[tuple[str, int], int]
    quarantine: dict[tuple[str, int], int]


def stream_positions(
    checkpoint: str, commitlog: ArrowDelta, quarantine: ArrowDelta
) -> StreamPositions | None:
    """The positions of the Spark stream that ingested here before, if one did.

    Its appends recorded ``txn`` (``delayq-kafka-ingest-<query id>`` in ``commitlog``,
    ``delayq-kafka-quarantine-<query id>`` in ``quarantine``, the batch id) before Spark
    recorded the batch in ``commits/``.

    Example:
        >>> found = stream_positions(checkpoint, commitlog, quarantine)  # doctest: +SKIP
        >>> found.start, found.commitlog, found.quarantine  # doctest: +SKIP
        ({('in', 0): 3}, {('in', 0): 5}, {('in', 0): 3})
    """
    try:
        query_id = stream_query_id(checkpoint)
    except FileNotFoundError:
        return None
    start = stored_offsets(checkpoint)
    if start is None:
        return None
    stored = commitlog.txn_version(f"delayq-kafka-ingest-{query_id}")
    bad = quarantine.txn_version(f"delayq-kafka-quarantine-{query_id}")
    return StreamPositions(
        start,
        stored_offsets(checkpoint, stored) or start,
        stored_offsets(checkpoint, bad) or start,
    )


def ingest_lag(cfg: EngineConfig, timeout_s: float = 5.0) -> dict[str, int] | None:
    """Records per Kafka topic not yet stored by the ingest; ``None`` if it never stored a
    record in this lakehouse.

    Raises:
        kafka.errors.KafkaError: the brokers (``kafka.bootstrap_servers``) cannot be asked.
    """
    lay = layout(cfg)
    commitlog = ArrowDelta(lay.commitlog)
    old = stream_positions(lay.checkpoint(INGEST_CHECKPOINT), commitlog, ArrowDelta(lay.quarantine))
    earlier = old.commitlog if old else {}
    from kafka import KafkaConsumer, TopicPartition

    ms = int(timeout_s * 1000)
    consumer = KafkaConsumer(
        bootstrap_servers=cfg.kafka_bootstrap,
        request_timeout_ms=max(ms, 1000),
        bootstrap_timeout_ms=ms,
        enable_auto_commit=False,
    )
    try:
        topics = sorted(set(cfg.kafka_ingest_topics) | {topic for topic, _ in earlier})
        wanted = [
            TopicPartition(topic, partition)
            for topic in topics
            for partition in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        ends = consumer.end_offsets(wanted) if wanted else {}
    finally:
        consumer.close()
    stored = dict(earlier)
    for part in ends:
        recorded = commitlog.txn_version(offset_app_id(part.topic, part.partition))
        if recorded is not None:
            stored[(part.topic, part.partition)] = recorded
    if not stored:
        return None
    lag = {topic: 0 for topic, _ in stored}
    for part, end in ends.items():
        if part.topic in lag:
            lag[part.topic] += max(int(end) - stored.get((part.topic, part.partition), 0), 0)
    return lag
