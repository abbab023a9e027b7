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

import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.core.config import EngineConfig
from engine.core.kafka_headers import HEADER_DELIVER_TS, HEADER_MSG_ID, HEADER_TAGS
from engine.lakehouse.fs import hadoop_path, jvm
from engine.lakehouse.layout import Layout

#: Bounds on how long one write may block on an unreachable broker (Kafka's defaults are
#: 60 s and 120 s); the round then fails and is retried with back-off.
PRODUCER_TIMEOUTS = {"kafka.max.block.ms": "20000", "kafka.delivery.timeout.ms": "30000"}


def kafka_records(rows: DataFrame, kafka_topic: str) -> DataFrame:
    """Topic-table rows as Kafka records: ``topic, key, value, headers``.

    The key is the message's first key; properties become headers, next to
    ``DELAYQ_MSG_ID``, ``DELAYQ_DELIVER_TS`` (ms since the epoch) and ``TAGS``.
    """

    def pair(name: str, value: Column) -> Column:
        return F.struct(F.lit(name).alias("key"), F.encode(value, "UTF-8").alias("value"))

    fixed = F.array(
        pair(HEADER_MSG_ID, F.col("msg_id")),
        pair(HEADER_DELIVER_TS, F.unix_millis("deliver_ts").cast("string")),
    )
    tags = F.when(F.col("tags").isNotNull(), F.array(pair(HEADER_TAGS, F.col("tags")))).otherwise(
        F.array().cast("array<struct<key:string,value:binary>>")
    )
    props = F.transform(
        F.map_entries(F.coalesce(F.col("properties"), F.create_map().cast("map<string,string>"))),
        lambda e: F.struct(
            e["key"].alias("key"),
            F.encode(F.coalesce(e["value"], F.lit("")), "UTF-8").alias("value"),
        ),
    )
    first_key = F.when(F.size("keys") > 0, F.encode(F.element_at("keys", 1), "UTF-8"))
    return rows.select(
        F.lit(kafka_topic).alias("topic"),
        first_key.alias("key"),
        F.col("body").alias("value"),
        F.concat(fixed, tags, props).alias("headers"),
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
        frame = self.spark.createDataFrame(rows)
        writer = kafka_records(frame, table).write.format("kafka")
        settings = {
            "kafka.bootstrap.servers": self.cfg.kafka_bootstrap,
            "kafka.acks": "all",
            "kafka.enable.idempotence": "true",
            **PRODUCER_TIMEOUTS,
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
