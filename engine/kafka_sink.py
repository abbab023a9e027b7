"""Kafka out: deliver a topic's due messages to a Kafka topic of the same name.

Chosen per topic with ``kafka.sinks.<topic> = "kafka"`` (Kafka only) or ``"both"`` (Kafka and
the Delta topic table). The delivery round writes with Spark's Kafka sink: an idempotent
producer with ``acks=all``, so a write retried inside the producer is not duplicated. Across
a crash the guarantee is **at-least-once**: a round replayed after a crash skips the Kafka
topics it had finished (a marker file per round and topic, written after the broker
acknowledged), but a crash between the acknowledgement and the marker writes that round's
rows to Kafka again. Each record carries ``DELAYQ_MSG_ID`` so consumers can drop repeats;
the Delta topic table stays exactly-once.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.config import SINKS, EngineConfig
from engine.errors import ConfigError, InvalidMessageError
from engine.fs import hadoop_path, jvm
from engine.kafka_client import HEADER_DELIVER_TS, HEADER_MSG_ID, HEADER_TAGS
from engine.tables import check_topic, layout


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


#: Bounds on how long one write may block on an unreachable broker (Kafka's defaults are
#: 60 s and 120 s); the round then fails and is retried with back-off.
PRODUCER_TIMEOUTS = {"kafka.max.block.ms": "20000", "kafka.delivery.timeout.ms": "30000"}


def check_sinks(cfg: EngineConfig) -> None:
    """Fail at start when ``kafka.sinks`` names a topic that cannot be one.

    Raises:
        ConfigError: naming the key and the topic.
    """
    for topic, sink in cfg.kafka_sinks.items():
        key = f"kafka.sinks.{topic}"
        try:
            check_topic(topic)
        except InvalidMessageError as err:
            raise ConfigError(key, sink, f"not a topic that can be delivered to: {err}") from None
        if sink not in SINKS:
            raise ConfigError(key, sink, f"expected one of {', '.join(SINKS)}")
        if sink != "delta" and topic in cfg.kafka_ingest_topics:
            raise ConfigError(key, sink, "is also an ingest topic: deliveries would loop back")


def _markers(cfg: EngineConfig, checkpoint_id: str) -> str:
    # Per delivery checkpoint: a new checkpoint starts its rounds again from 0.
    return f"{layout(cfg).checkpoint('kafka_sink')}/{checkpoint_id}"


def written(
    spark: SparkSession, cfg: EngineConfig, checkpoint_id: str, round_: int, topic: str
) -> bool:
    """Whether round ``round_`` finished its write to Kafka topic ``topic``."""
    path, fs = hadoop_path(spark, f"{_markers(cfg, checkpoint_id)}/{round_:020d}-{topic}")
    return bool(fs.exists(path))


def write(
    spark: SparkSession,
    cfg: EngineConfig,
    rows: DataFrame,
    checkpoint_id: str,
    round_: int,
    topic: str,
) -> None:
    """Write a round's rows of one topic to Kafka, then mark the write done.

    Only the round in progress can be replayed, so the topic's older markers are removed.
    """
    writer = kafka_records(rows, topic).write.format("kafka")
    settings = {
        "kafka.bootstrap.servers": cfg.kafka_bootstrap,
        "kafka.acks": "all",
        "kafka.enable.idempotence": "true",
        **PRODUCER_TIMEOUTS,
    }
    for key, value in settings.items():
        writer = writer.option(key, value)
    writer.save()
    folder, fs = hadoop_path(spark, _markers(cfg, checkpoint_id))
    name = f"{round_:020d}-{topic}"
    fs.create(jvm(spark).org.apache.hadoop.fs.Path(folder, name), True).close()
    for status in fs.listStatus(folder):
        old = status.getPath().getName()
        if old.endswith(f"-{topic}") and old < name:
            fs.delete(status.getPath(), False)
