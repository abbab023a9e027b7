"""A consumer group's commits in ``consumer_log``, and forwarding their send-backs.

A commit is one Delta append to ``consumer_log`` (idempotent: ``txnAppId`` per group and
mode, ``txnVersion`` = commit number) holding the new positions and the failed messages as
they will be sent back. They are then forwarded to ``commitlog`` with their own
``txnAppId``, so a crash between the two steps, or a commit replayed, sends each once.

Example:
    >>> append_commit(spark, cfg, rows, "billing", POLL, 12)  # doctest: +SKIP
    >>> forward(spark, cfg, "billing", POLL, 12, log_id)  # doctest: +SKIP
    1
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.core.config import EngineConfig
from engine.lakehouse.delta.delta_log import Txn, append, is_txn_race
from engine.lakehouse.storage.layout import layout
from schemas import CONSUMER_LOG

#: Commits of a polling consumer, and of a stream (``stream-<query id>``).
POLL = "poll"
STREAM = "stream"


def forward(
    spark: SparkSession, cfg: EngineConfig, group: str, mode: str, seq: int, log_id: str
) -> int:
    """Send commit ``seq``'s failed messages to ``commitlog``, once; return how many.

    The ``txnAppId`` names the ``consumer_log`` table (``log_id``): if it is ever made
    anew, commit numbers start again without colliding with the old ones.
    """
    lay = layout(cfg)
    rows = (
        spark.read.format("delta")
        .load(lay.consumer_log)
        .where(
            (F.col("group_name") == group)
            & (F.col("mode") == mode)
            & (F.col("commit_seq") == seq)
            & F.col("kind").isin("retry", "dead")
        )
        .select("sendback.*")
        .cache()
    )
    try:
        count = rows.count()
        if count:
            try:
                append(
                    rows,
                    lay.commitlog,
                    txn=Txn(f"delayq-sendback-{mode}-{group}-{log_id}", seq),
                    metadata=f"delayq {mode} consumer {group} commit {seq}",
                )
            except Exception as err:
                if not is_txn_race(err):
                    raise
                # another member of the group forwarded this commit at the same moment
        return count
    finally:
        rows.unpersist()


def append_commit(
    spark: SparkSession,
    cfg: EngineConfig,
    rows: DataFrame,
    group: str,
    mode: str,
    seq: int,
) -> None:
    """Append commit ``seq`` of ``group`` (``rows`` shaped by :func:`commit_columns`), once."""
    shaped = rows.select(
        *[
            F.col(f.name).alias(f.name)
            if f.name == "sendback" and f.name in rows.columns
            else (F.col(f.name) if f.name in rows.columns else F.lit(None))
            .cast(f.dataType)
            .alias(f.name)
            for f in CONSUMER_LOG
        ]
    )
    append(shaped, layout(cfg).consumer_log, txn=Txn(f"delayq-group-{mode}-{group}", seq))


def offset_rows(
    spark: SparkSession, positions: Iterable[tuple[str, tuple[int, int, str], int]]
) -> DataFrame:
    """``offset`` rows: per table, the last position consumed and how many were acked."""
    data = [(table, r, us, msg_id, acked) for table, (r, us, msg_id), acked in positions]
    schema = "topic string, delivery_round long, deliver_us long, msg_id string, acked long"
    return spark.createDataFrame(data, schema).select(
        F.lit("offset").alias("kind"),
        "topic",
        "delivery_round",
        F.timestamp_micros("deliver_us").alias("deliver_ts"),
        "msg_id",
        "acked",
    )


def commit_columns(
    df: DataFrame, group: str, mode: str, seq: int, commit_id: str, consumer: str, now: datetime
) -> DataFrame:
    """Add the columns naming the commit (group, mode, number, id, consumer, time)."""
    return df.select(
        F.lit(group).alias("group_name"),
        F.lit(mode).alias("mode"),
        F.lit(seq).cast("long").alias("commit_seq"),
        F.lit(commit_id).alias("commit_id"),
        F.lit(consumer).alias("consumer"),
        F.lit(now).cast("timestamp").alias("committed_ts"),
        *[F.col(c) for c in df.columns],
    )
