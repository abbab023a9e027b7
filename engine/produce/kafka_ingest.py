"""Kafka in: read Kafka topics into ``commitlog``, exactly once, bad records quarantined.

A streaming query reads ``kafka.ingest_topics`` (Spark's Kafka source, headers included).
Each micro-batch comes to the driver as Arrow, is shaped by
:func:`engine.produce.kafka_records.parse_records`, and is appended to ``commitlog`` (and the
records with bad headers to ``quarantine``, with the reason) as the producers' sends are:
Parquet plus one Delta log entry, no Spark job. Both appends record Delta's
``txnAppId``/``txnVersion`` (the batch id) and are skipped when it is recorded already, and a
record's ``msg_id`` is its ``UNIQ_KEY`` header or else derived from its Kafka topic,
partition, offset and timestamp: a batch replayed after a crash or restart is not stored
twice, and a record sent twice with the same ``UNIQ_KEY`` is delivered once (stamping drops
the second copy, see :mod:`engine.stamp.dedup`). Header names are in
:mod:`engine.core.kafka_headers`.

Example:
    >>> query = start_ingest(spark, cfg)  # doctest: +SKIP
    >>> query.awaitTermination()  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from engine.core.clock import Clock, SystemClock
from engine.core.config import EngineConfig
from engine.lakehouse.arrow_delta import ArrowDelta
from engine.lakehouse.delta_log import Txn
from engine.lakehouse.fs import stream_query_id
from engine.lakehouse.layout import layout
from engine.lakehouse.tables import ensure_tables
from engine.produce.ingest_lag import INGEST_CHECKPOINT
from engine.produce.kafka_records import KAFKA_RECORD, parse_records


def _append_once(table: ArrowDelta, rows: pa.Table, txn: Txn, metadata: str | None) -> None:
    """Append ``rows`` with ``txn`` unless a commit recorded it already (a replayed batch)."""
    done = table.txn_version(txn.app_id)
    if done is None or done < txn.version:
        table.append(rows, txn=txn, metadata=metadata)


def write_batch(
    commitlog: ArrowDelta,
    quarantine: ArrowDelta,
    cfg: EngineConfig,
    records: pa.Table,
    app_id: str,
    batch_id: int,
    now: datetime,
) -> tuple[int, int]:
    """Store one micro-batch of Kafka records (:data:`KAFKA_RECORD`); return (stored,
    quarantined).

    Each table's append is idempotent per (``app_id``, batch id), so a replayed batch
    stores nothing twice. ``app_id`` must change when batch ids start again (a new
    checkpoint): the stream's query id.

    Example:
        >>> lay = layout(cfg)  # doctest: +SKIP
        >>> tables = ArrowDelta(lay.commitlog), ArrowDelta(lay.quarantine)  # doctest: +SKIP
        >>> write_batch(*tables, cfg, records, "9f2c", 0, clock.now())  # doctest: +SKIP
        (1000, 2)
    """
    rows = parse_records(records, cfg, now)
    refused = pc.is_valid(rows["reason"])
    good = rows.filter(pc.invert(refused)).drop_columns(["reason"])
    bad = rows.filter(refused)
    if good.num_rows:
        _append_once(
            commitlog,
            good,
            Txn(f"delayq-kafka-ingest-{app_id}", batch_id),
            f"delayq kafka ingest batch {batch_id}",
        )
    if bad.num_rows:
        quarantined = bad.append_column(
            "stamp_batch", pa.nulls(bad.num_rows, pa.int64())
        ).append_column(
            "quarantined_ts", pa.array([now] * bad.num_rows, pa.timestamp("us", tz="UTC"))
        )
        _append_once(
            quarantine, quarantined, Txn(f"delayq-kafka-quarantine-{app_id}", batch_id), None
        )
    return good.num_rows, bad.num_rows


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

    lay = layout(cfg)
    checkpoint = lay.checkpoint(INGEST_CHECKPOINT)
    query_id: list[str] = []
    commitlog, quarantine = ArrowDelta(lay.commitlog), ArrowDelta(lay.quarantine)

    def run_batch(batch: DataFrame, batch_id: int) -> None:
        if not query_id:
            query_id.append(stream_query_id(checkpoint))
        records = batch.select(*KAFKA_RECORD.names).toArrow()
        stored, bad = write_batch(
            commitlog, quarantine, cfg, records, query_id[0], batch_id, clock.now()
        )
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
