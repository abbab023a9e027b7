"""Kafka out: deliver a topic's due messages to a Kafka topic of the same name.

A :class:`~engine.deliver.sinks.TopicSink`, chosen per topic with
``kafka.sinks.<topic> = "kafka"`` (Kafka only) or ``"both"`` (Kafka and the Delta topic
table). The delivery round writes with Spark's Kafka sink: an idempotent
producer with ``acks=all``, so a write retried inside the producer is not duplicated. Across
a crash the guarantee is **at-least-once**: a round replayed after a crash skips the Kafka
topics it had finished (a marker file per round and topic, written after the broker
acknowledged), but a crash between the acknowledgement and the marker writes that round's
rows to Kafka again. Each record carries ``DELAYQ_MSG_ID`` so consumers can drop repeats;
the Delta topic table stays exactly-once.

Example:
    >>> KafkaTopicSink(spark, cfg, lay, "9f2c").write(7, "orders", rows, False)  # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession

from engine.core.arrow_lists import entry_rows, grouped, take_or_null
from engine.core.config import EngineConfig
from engine.core.kafka_headers import HEADER_DELIVER_TS, HEADER_MSG_ID, HEADER_TAGS
from engine.lakehouse.fs import hadoop_path, jvm
from engine.lakehouse.layout import Layout

#: Bounds on how long one write may block on an unreachable broker (Kafka's defaults are
#: 60 s and 120 s); the round then fails and is retried with back-off.
PRODUCER_TIMEOUTS = {
    "kafka.max.block.ms": "20000",
    "kafka.request.timeout.ms": "20000",  # + linger.ms must stay within delivery.timeout.ms
    "kafka.delivery.timeout.ms": "30000",
}
#: A round sends its records at once: batches of 1 MiB (Kafka's default is 16 KiB) more than
#: halved the time a round of 100,000 records took to reach the broker. 256 KiB keeps most
#: of that while 256 partitions' batches fit the 64 MiB buffer (a full buffer blocks sends).
PRODUCER_BATCHING = {
    "kafka.batch.size": "262144",
    "kafka.linger.ms": "5",
    "kafka.buffer.memory": "67108864",
}

_HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def kafka_records(rows: pa.Table, kafka_topic: str) -> pa.Table:
    """Topic-table rows as Kafka records: ``topic, key, value, headers``.

    The key is the message's first key; the headers are ``DELAYQ_MSG_ID``,
    ``DELAYQ_DELIVER_TS`` (ms since the epoch), ``TAGS`` when the message has tags, then
    its properties (a property without a value is ``""``).

    Example:
        >>> from datetime import UTC, datetime
        >>> rows = pa.table({"msg_id": ["A1"], "keys": [["order-7"]], "tags": [None],
        ...     "properties": pa.array([[("p", "v")]], pa.map_(pa.string(), pa.string())),
        ...     "body": [b"hi"], "deliver_ts": [datetime(2026, 1, 1, tzinfo=UTC)]})
        >>> record = kafka_records(rows, "orders").to_pylist()[0]
        >>> record["key"], [h["key"] for h in record["headers"]]
        (b'order-7', ['DELAYQ_MSG_ID', 'DELAYQ_DELIVER_TS', 'p'])
        >>> record["headers"][1]["value"]
        b'1767225600000'
    """
    rows = rows.combine_chunks()
    n = rows.num_rows

    def column(name: str) -> pa.Array:
        found = rows[name]
        return found.chunk(0) if found.num_chunks else pa.array([], found.type)

    everyone = np.arange(n, dtype=np.int64)
    millis = pc.divide(pc.cast(column("deliver_ts"), pa.int64()), 1000)
    tagged = np.flatnonzero(np.asarray(pc.is_valid(column("tags")).to_numpy(zero_copy_only=False)))
    maps = column("properties")
    properties = pa.ListArray.from_arrays(maps.offsets, maps.values, mask=maps.is_null())
    entries = pc.list_flatten(properties)
    names, values = (entries.flatten() if len(entries) else
                     (pa.array([], pa.string()), pa.array([], pa.string())))  # fmt: skip
    fixed = [
        (everyone, pa.array([HEADER_MSG_ID] * n, pa.string()), column("msg_id")),
        (everyone, pa.array([HEADER_DELIVER_TS] * n, pa.string()), pc.cast(millis, pa.string())),
        (tagged, pa.array([HEADER_TAGS] * len(tagged), pa.string()),
         column("tags").take(pa.array(tagged, pa.int64()))),
        (entry_rows(properties), names, pc.fill_null(values, "")),
    ]  # fmt: skip
    offsets, order = grouped(n, np.concatenate([part[0] for part in fixed]))
    header_keys = pa.concat_arrays([part[1] for part in fixed]).take(order)
    header_values = pa.concat_arrays([pc.cast(part[2], pa.string()) for part in fixed]).take(order)
    headers = pa.ListArray.from_arrays(
        offsets,
        pa.StructArray.from_arrays(
            [header_keys, pc.cast(header_values, pa.binary())], names=["key", "value"]
        ),
        type=_HEADERS,
    )
    keys = column("keys")
    key_rows = entry_rows(keys)
    first_rows, first = np.unique(key_rows, return_index=True)
    key = np.full(n, -1, dtype=np.int64)
    key[first_rows] = first
    first_key = take_or_null(pc.list_flatten(keys), key)
    return pa.table(
        {
            "topic": pa.array([kafka_topic] * n, pa.string()),
            "key": pc.cast(first_key, pa.binary()),
            "value": column("body"),
            "headers": headers,
        }
    )


class KafkaTopicSink:
    """A Kafka topic named like the topic table, at least once across crashes.

    A marker file per round and topic, written after the broker acknowledged the round's
    records, tells a replay that the write finished.
    """

    def __init__(
        self, spark: SparkSession, cfg: EngineConfig, layout: Layout, checkpoint_id: str
    ) -> None:
        self.spark = spark
        self.cfg = cfg
        # Per delivery checkpoint: a new checkpoint starts its rounds again from 0.
        self.markers = f"{layout.checkpoint('kafka_sink')}/{checkpoint_id}"

    def written(self, round_: int, table: str) -> bool:
        """Whether round ``round_`` finished its write to Kafka topic ``table``."""
        path, fs = hadoop_path(self.spark, f"{self.markers}/{round_:020d}-{table}")
        return bool(fs.exists(path))

    def write(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> None:
        """Write a round's rows of one topic to Kafka, then mark the write done.

        Only the round in progress can be replayed, so the topic's older markers are removed.
        """
        writer = self.spark.createDataFrame(kafka_records(rows, table)).write.format("kafka")
        settings = {
            "kafka.bootstrap.servers": self.cfg.kafka_bootstrap,
            "kafka.acks": "all",
            "kafka.enable.idempotence": "true",
            **PRODUCER_TIMEOUTS,
            **PRODUCER_BATCHING,
        }
        for key, value in settings.items():
            writer = writer.option(key, value)
        writer.save()
        folder, fs = hadoop_path(self.spark, self.markers)
        name = f"{round_:020d}-{table}"
        fs.create(jvm(self.spark).org.apache.hadoop.fs.Path(folder, name), True).close()
        for status in fs.listStatus(folder):
            old = status.getPath().getName()
            if old.endswith(f"-{table}") and old < name:
                fs.delete(status.getPath(), False)
