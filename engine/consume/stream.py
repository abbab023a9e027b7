"""Consume topics as a group with Spark: ``readStream`` + ``foreachBatch``.

Example:
    >>> def handle(batch):
    ...     return batch.select("msg_id", F.when(F.col("body").isNull(), "empty")
    ...                         .alias("error"))
    >>> query = consume_stream(spark, cfg, "audit", ["orders"], handle)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime

import pyarrow as pa
import pyarrow.dataset as ds
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from engine.consume.commit_log import STREAM, append_commit, commit_columns, forward, offset_rows
from engine.consume.filters import message_filter
from engine.consume.retry import check_retry_delays, consumer_columns, sendback_rows
from engine.consume.subscription import known_topics
from engine.core.clock import Clock, SystemClock
from engine.core.config import EngineConfig, GroupConfig
from engine.core.errors import one_line
from engine.core.topics import check_group, retry_topic
from engine.lakehouse.delta.delta_log import table_id
from engine.lakehouse.delta.tables import ensure_consumer_log, ensure_topic_table
from engine.lakehouse.storage.fs import stream_query_id
from engine.lakehouse.storage.layout import layout

log = logging.getLogger(__name__)

#: What a stream handler gets: topic rows plus ``table`` and :func:`consumer_columns`.
Handler = Callable[[DataFrame], DataFrame | None]


def consume_stream(
    spark: SparkSession,
    cfg: EngineConfig,
    group: str,
    topics: Sequence[str],
    handler: Handler,
    *,
    settings: GroupConfig | None = None,
    clock: Clock | None = None,
    trigger_interval: str = "1 second",
    available_now: bool = False,
    tags: str | None = None,
    where: str | None = None,
) -> StreamingQuery:
    """Consume topics as ``group`` with ``readStream`` + ``foreachBatch``.

    ``handler(batch)`` gets each micro-batch (topic columns plus ``table``,
    ``real_topic``, ``reconsume_times``, ``origin_msg_id``) and returns ``None`` (all
    succeeded) or a DataFrame of ``msg_id`` and ``error`` (null: success; rows left out
    succeeded). A handler that raises fails the whole batch with the exception as the
    reason. Failures take the same retry and dead-letter path as :meth:`Consumer.nack`;
    each micro-batch commits once (``txnVersion`` = batch id), so a replayed batch sends
    nothing twice.

    ``tags`` and ``where`` filter the subscribed topics as :class:`~engine.consume.consumer.
    Consumer`'s do (not the group's retry topic): the handler gets only the messages they
    take, and the others count as consumed with the batch. A bad expression raises
    :class:`~engine.core.errors.ConsumerError` here, before the stream starts.

    Example:
        >>> def handle(batch):
        ...     return batch.select("msg_id", F.when(F.col("body").isNull(), "empty")
        ...                         .alias("error"))
        >>> query = consume_stream(spark, cfg, "audit", ["orders"], handle)  # doctest: +SKIP

    Returns:
        The started query; its checkpoint is ``_checkpoints/consumer_<group>``.
    """
    chosen_filter = message_filter(tags, where)  # a bad expression fails here
    group = check_group(group)
    keep = None
    if chosen_filter is not None:  # Kleene OR: a retried message is taken whatever it holds
        keep = (ds.field("table") == retry_topic(group)) | chosen_filter
    chosen = settings or cfg.group(group)
    check_retry_delays(cfg, group, chosen)
    names = [*known_topics(spark, cfg, list(topics)), retry_topic(group)]
    clock = clock or SystemClock()
    log_id = table_id(spark, ensure_consumer_log(spark, cfg))
    stream: DataFrame | None = None
    for name in dict.fromkeys(names):
        path = ensure_topic_table(spark, cfg, name)
        source = spark.readStream.format("delta").load(path).withColumn("table", F.lit(name))
        stream = source if stream is None else stream.unionByName(source)
    assert stream is not None

    checkpoint = layout(cfg).checkpoint(f"consumer_{group.lower()}")
    mode: list[str] = []

    def run_batch(batch: DataFrame, batch_id: int) -> None:
        # Batch ids start again in a new checkpoint: commits are named after its query id.
        if not mode:
            mode.append(f"{STREAM}-{stream_query_id(checkpoint)}")
        try:
            _stream_batch(
                spark, cfg, group, chosen, handler, batch, (mode[0], log_id), batch_id,
                clock.now(), keep,
            )  # fmt: skip
        except Exception as err:
            # Said here: Spark's own line about the query's end goes to spark.log only
            # (conf/log4j2.properties), and a caller may never look at the query.
            log.error("consumer group %s: batch %d failed, its stream stops: %s",
                      group, batch_id, one_line(err), exc_info=err)  # fmt: skip
            raise

    writer = (
        stream.writeStream.foreachBatch(run_batch)
        .option("checkpointLocation", checkpoint)
        .queryName(f"delayq_consumer_{group}")
    )
    writer = (
        writer.trigger(availableNow=True)
        if available_now
        else writer.trigger(processingTime=trigger_interval)
    )
    return writer.start()


def _stream_batch(
    spark: SparkSession,
    cfg: EngineConfig,
    group: str,
    settings: GroupConfig,
    handler: Handler,
    batch: DataFrame,
    commit: tuple[str, str],
    batch_id: int,
    now: datetime,
    keep: ds.Expression | None = None,
) -> None:
    mode, log_id = commit
    view = consumer_columns(batch).persist()
    # Positions come from every row; the handler sees (and can fail) only the rows kept.
    taken = view if keep is None else _kept(view, keep).persist()
    try:
        positions = (
            view.groupBy("table")
            .agg(
                F.max(F.struct("delivery_round", F.unix_micros("deliver_ts"), "msg_id")).alias("p"),
                F.count(F.lit(1)).alias("n"),
            )
            .collect()
        )
        if not positions:
            return
        errors: DataFrame | None = None
        try:
            outcome = handler(taken)
            if outcome is not None:
                # One reason per message; run now, so that an error raised while computing
                # the handler's result fails the batch's rows, not the stream.
                errors = (
                    outcome.where(F.col("error").isNotNull())
                    .groupBy("msg_id")
                    .agg(F.concat_ws("; ", F.sort_array(F.collect_set("error"))).alias("reason"))
                    .persist()
                )
                errors.count()
        except Exception as err:  # the handler's failure fails its rows, not the stream
            if errors is not None:
                errors.unpersist()
            reason = f"{type(err).__name__}: {err}"[:1000]
            errors = taken.select("msg_id", F.lit(reason).alias("reason")).persist()
        failed = None if errors is None else taken.join(errors, "msg_id")
        failed_rows = None if failed is None else failed.persist()
        try:
            failures = 0 if failed_rows is None else failed_rows.count()
            failed_per_table: dict[str, int] = {}
            if failed_rows is not None and failures:
                failed_per_table = {
                    r["table"]: r["count"] for r in failed_rows.groupBy("table").count().collect()
                }
            offsets = offset_rows(
                spark,
                [
                    (
                        str(r["table"]),
                        (int(r["p"][0]), int(r["p"][1]), str(r["p"][2])),
                        int(r["n"]) - failed_per_table.get(r["table"], 0),
                    )
                    for r in positions
                ],
            )
            rows = offsets
            if failed_rows is not None and failures:
                rows = offsets.unionByName(
                    sendback_rows(failed_rows, group, settings, now), allowMissingColumns=True
                )
            rows = commit_columns(rows, group, mode, batch_id, f"batch-{batch_id}", "", now)
            append_commit(spark, cfg, rows, group, mode, batch_id)
            forward(spark, cfg, group, mode, batch_id, log_id)
        finally:
            if failed_rows is not None:
                failed_rows.unpersist()
            if errors is not None:
                errors.unpersist()
    finally:
        if taken is not view:
            taken.unpersist()
        view.unpersist()


def _kept(view: DataFrame, keep: ds.Expression) -> DataFrame:
    """The rows of ``view`` for which the Arrow expression ``keep`` is true (in the workers)."""

    def apply(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            yield from pa.Table.from_batches([batch]).filter(keep).to_batches()

    return view.mapInArrow(apply, view.schema)
