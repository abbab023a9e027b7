"""Kafka in: read Kafka topics into ``commitlog``, exactly once, bad records quarantined.

A streaming query reads ``kafka.ingest_topics`` (Spark's Kafka source, headers included) and,
per micro-batch, appends the records to ``commitlog`` and those with bad headers to
``quarantine`` with the reason. Both appends carry Delta's ``txnAppId``/``txnVersion`` (the
batch id), and a record's ``msg_id`` is its ``UNIQ_KEY`` header or else derived from its Kafka
topic, partition and offset: a batch replayed after a crash or restart is not stored twice,
and a record sent twice with the same ``UNIQ_KEY`` is delivered once (stamping drops the
second copy, see :mod:`engine.stamp.dedup`). Header names are in
:mod:`engine.core.kafka_headers`.

Example:
    >>> query = start_ingest(spark, cfg)  # doctest: +SKIP
    >>> query.awaitTermination()  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from engine.core.clock import Clock, SystemClock
from engine.core.config import EngineConfig
from engine.core.kafka_headers import (
    HEADER_DELAY_MS,
    HEADER_DELAY_SEC,
    HEADER_DELIVER_MS,
    HEADER_DELIVER_TS,
    HEADER_KEYS,
    HEADER_LEVEL,
    HEADER_MSG_ID,
    HEADER_REAL_TOPIC,
    HEADER_TAGS,
    HEADER_UNIQ_KEY,
    SPECIAL_HEADERS,
    TIMING_HEADERS,
)
from engine.core.message import ENGINE_PROPERTIES
from engine.core.topics import DLQ_PREFIX, RESERVED_TOPICS, RETRY_PREFIX
from engine.lakehouse.delta_log import Txn, append
from engine.lakehouse.fs import stream_query_id
from engine.lakehouse.layout import layout
from engine.lakehouse.tables import ensure_tables
from schemas import COMMITLOG, QUARANTINE

#: Properties recording where a record came from.
PROP_KAFKA_TOPIC = "KAFKA_TOPIC"
PROP_KAFKA_PARTITION = "KAFKA_PARTITION"
PROP_KAFKA_OFFSET = "KAFKA_OFFSET"


#: Incoming headers with the names of the engine's own properties are not kept: the
#: engine sets them (a record forwarded from a delivered topic carries old ones).
OWN_PROPERTIES = (
    PROP_KAFKA_TOPIC,
    PROP_KAFKA_PARTITION,
    PROP_KAFKA_OFFSET,
    HEADER_MSG_ID,
    HEADER_DELIVER_TS,
    *ENGINE_PROPERTIES,
)
#: Largest TIMER_DELIVER_MS accepted (year 9999); beyond, the arithmetic would overflow.
MAX_EPOCH_MS = 253_402_300_799_999


def _text(value: Column) -> Column:
    """Bytes as UTF-8 text; bytes that are not UTF-8 as ``base64:...`` (never an error)."""
    as_text = value.cast("string")
    return (
        F.when(value.isNull(), F.lit(""))
        .when(F.is_valid_utf8(as_text), as_text)
        .otherwise(F.concat(F.lit("base64:"), F.base64(value)))
    )


def header(name: str) -> Column:
    """The last value of header ``name`` as text, or null when absent."""
    matching = F.filter(F.coalesce(F.col("headers"), F.array()), lambda h: h["key"] == name)
    return F.when(F.size(matching) > 0, _text(F.element_at(matching, -1)["value"]))


def _other_headers() -> Column:
    """Every header the engine does not interpret, as properties (the last value wins)."""
    empty = F.create_map().cast("map<string,string>")
    kept = F.filter(
        F.coalesce(F.col("headers"), F.array()),
        lambda h: ~h["key"].isin(*SPECIAL_HEADERS, *OWN_PROPERTIES),
    )
    return F.aggregate(
        kept,
        empty,
        lambda acc, h: F.map_concat(
            F.map_filter(acc, lambda k, _v: k != h["key"]),
            F.create_map(h["key"], _text(h["value"])),
        ),
    )


def parse_records(records: DataFrame, cfg: EngineConfig, now: datetime) -> DataFrame:
    """Shape Kafka records (``key, value, topic, partition, offset, timestamp, headers``)
    as ``commitlog`` rows plus ``reason`` (null for a good record).

    Pure: the same records give the same rows (``msg_id`` comes from topic, partition and
    offset; ``store_ts`` is ``now``).
    """
    level_text, at_text = header(HEADER_LEVEL), header(HEADER_DELIVER_MS)
    sec_text, ms_text = header(HEADER_DELAY_SEC), header(HEADER_DELAY_MS)
    level, at_ms = level_text.try_cast("int"), at_text.try_cast("long")
    sec, ms = sec_text.try_cast("long"), ms_text.try_cast("long")
    timing = (level_text, at_text, sec_text, ms_text)  # the TIMING_HEADERS, read once
    given = sum((F.when(t.isNotNull(), 1).otherwise(0) for t in timing), F.lit(0))
    mapping = F.create_map(*[F.lit(x) for pair in cfg.kafka_topic_map.items() for x in pair])
    real_topic = F.coalesce(
        header(HEADER_REAL_TOPIC),
        mapping[F.col("topic")] if cfg.kafka_topic_map else F.lit(None).cast("string"),
    )
    now_lit = F.lit(now).cast("timestamp")
    now_ms = F.unix_millis(now_lit)

    def bad(name: str, text: Column, expected: str) -> Column:
        return F.concat(F.lit(f"header {name}='"), text, F.lit(f"' is not {expected}"))

    longest = cfg.max_delay_ms
    within = f"within messages.max_delay={longest // 1000}s"
    reason = (
        F.when(given > 1, F.lit(f"give only one of the headers {', '.join(TIMING_HEADERS)}"))
        .when(level_text.isNotNull() & level.isNull(), bad(HEADER_LEVEL, level_text, "a level"))
        .when(
            at_text.isNotNull() & (at_ms.isNull() | (at_ms < 0) | (at_ms > MAX_EPOCH_MS)),
            bad(HEADER_DELIVER_MS, at_text, "ms since the epoch"),
        )
        .when(
            sec_text.isNotNull() & (sec.isNull() | (sec < 0) | (sec > longest // 1000)),
            bad(HEADER_DELAY_SEC, sec_text, f"whole seconds >= 0 {within}"),
        )
        .when(
            ms_text.isNotNull() & (ms.isNull() | (ms < 0) | (ms > longest)),
            bad(HEADER_DELAY_MS, ms_text, f"whole milliseconds >= 0 {within}"),
        )
        .when(
            real_topic.isNull(),
            F.concat(
                F.lit(f"no {HEADER_REAL_TOPIC} header and no kafka.topic_map entry for topic '"),
                F.col("topic"),
                F.lit("'"),
            ),
        )
        .when(
            F.lower(real_topic).startswith(RETRY_PREFIX)
            | F.lower(real_topic).startswith(DLQ_PREFIX)
            | F.lower(real_topic).isin(*sorted(RESERVED_TOPICS)),
            F.concat(F.lit("topic '"), real_topic, F.lit("' is reserved for the engine")),
        )
        .when(F.col("value").isNull(), F.lit("the record has no value (body)"))
    )
    # Computed for good records only: the bounds above keep the arithmetic from overflowing.
    delay_ms = F.coalesce(sec * 1000, ms)
    deliver_at = F.when(
        reason.isNull(),
        F.when(at_ms.isNotNull(), F.timestamp_millis(at_ms)).when(
            delay_ms.isNotNull(), F.timestamp_millis(now_ms + delay_ms)
        ),
    )
    kafka_key = F.when(F.col("key").isNotNull(), _text(F.col("key")))
    extra_keys = F.filter(
        F.split(F.coalesce(header(HEADER_KEYS), F.lit("")), " "), lambda k: F.length(k) > 0
    )
    keys = F.concat(
        F.when(kafka_key.isNotNull(), F.array(kafka_key)).otherwise(F.array()), extra_keys
    )
    source = F.create_map(
        F.lit(PROP_KAFKA_TOPIC), F.col("topic"),
        F.lit(PROP_KAFKA_PARTITION), F.col("partition").cast("string"),
        F.lit(PROP_KAFKA_OFFSET), F.col("offset").cast("string"),
    )  # fmt: skip
    # The record's timestamp too: a topic deleted and made again reuses offsets.
    where = [F.col(c).cast("string") for c in ("topic", "partition", "offset")]
    made = F.upper(F.md5(F.concat_ws(":", *where, F.unix_micros("timestamp")).cast("binary")))
    msg_id = F.coalesce(header(HEADER_UNIQ_KEY), made)  # the producer's own id, if it gave one
    message = {
        "msg_id": msg_id,
        "topic": F.coalesce(real_topic, F.col("topic")),
        "keys": keys,
        "tags": header(HEADER_TAGS),
        "properties": F.map_concat(_other_headers(), source),
        "body": F.col("value"),
        "delay_level": level,
        "born_ts": F.col("timestamp"),
        "store_ts": now_lit,
        "deliver_at": deliver_at,
    }
    return records.select(
        *[message[f.name].cast(f.dataType).alias(f.name) for f in COMMITLOG if f.name != "keys"],
        message["keys"].alias("keys"),
        reason.alias("reason"),
    ).select(*[f.name for f in COMMITLOG], "reason")


def write_batch(
    spark: SparkSession,
    cfg: EngineConfig,
    records: DataFrame,
    app_id: str,
    batch_id: int,
    now: datetime,
) -> tuple[int, int]:
    """Store one micro-batch of Kafka records; return (stored, quarantined).

    Each table's append is idempotent per (``app_id``, batch id), so a replayed batch
    stores nothing twice. ``app_id`` must change when batch ids start again (a new
    checkpoint): the stream's query id.
    """
    lay = layout(cfg)
    rows = parse_records(records, cfg, now).persist()
    try:
        counts = rows.agg(
            F.count_if(F.col("reason").isNull()).alias("good"),
            F.count_if(F.col("reason").isNotNull()).alias("bad"),
        ).first()
        good, bad = (int(counts["good"]), int(counts["bad"])) if counts else (0, 0)
        if good:
            append(
                rows.where(F.col("reason").isNull()).drop("reason"),
                lay.commitlog,
                txn=Txn(f"delayq-kafka-ingest-{app_id}", batch_id),
                metadata=f"delayq kafka ingest batch {batch_id}",
            )
        if bad:
            quarantined = rows.where(F.col("reason").isNotNull()).select(
                *[F.col(f.name) for f in COMMITLOG],
                "reason",
                F.lit(None).cast("long").alias("stamp_batch"),
                F.lit(now).cast("timestamp").alias("quarantined_ts"),
            )
            append(
                quarantined.select(*[f.name for f in QUARANTINE]),
                lay.quarantine,
                txn=Txn(f"delayq-kafka-quarantine-{app_id}", batch_id),
            )
        return good, bad
    finally:
        rows.unpersist()


def start_ingest(
    spark: SparkSession,
    cfg: EngineConfig,
    clock: Clock | None = None,
    *,
    available_now: bool = False,
    trigger_interval: str = "500 milliseconds",
    out: Callable[[str], None] | None = None,
) -> StreamingQuery:
    """Start reading ``cfg.kafka_ingest_topics`` into ``commitlog``.

    Args:
        spark: a session with the Kafka connector on its class path (``make jars``).
        cfg: brokers, topics, topic map, starting offsets.
        clock: ``store_ts`` of the stored records.
        available_now: read what is there now, then stop (tests, catch-up runs).
        trigger_interval: how often to look for new records otherwise.
        out: where a line per micro-batch goes (stored and quarantined counts).

    Returns:
        The query; its checkpoint is ``_checkpoints/kafka_ingest``.
    """
    clock = clock or SystemClock()
    ensure_tables(spark, cfg, migrate=False)  # only the engine migrates
    source = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", cfg.kafka_bootstrap)
        .option("subscribe", ",".join(cfg.kafka_ingest_topics))
        .option("startingOffsets", cfg.kafka_starting_offsets)
        .option("maxOffsetsPerTrigger", cfg.kafka_max_offsets)
        .option("includeHeaders", "true")
        .option("failOnDataLoss", "true")
        .load()
    )

    checkpoint = layout(cfg).checkpoint("kafka_ingest")
    query_id: list[str] = []

    def run_batch(batch: DataFrame, batch_id: int) -> None:
        if not query_id:
            query_id.append(stream_query_id(spark, checkpoint))
        stored, bad = write_batch(spark, cfg, batch, query_id[0], batch_id, clock.now())
        if out is not None and (stored or bad):
            out(f"batch {batch_id}: {stored} records stored, {bad} quarantined")

    writer = (
        source.writeStream.foreachBatch(run_batch)
        .option("checkpointLocation", checkpoint)
        .queryName("delayq_kafka_ingest")
    )
    if available_now:
        return writer.trigger(availableNow=True).start()
    return writer.trigger(processingTime=trigger_interval).start()
