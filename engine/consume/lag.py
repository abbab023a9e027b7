"""Consumer lag: per group and topic table, the delivered rows after the group's position.

Example:
    >>> lag(spark, cfg, "billing").show()  # doctest: +SKIP
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from engine.core.config import EngineConfig
from engine.core.errors import ConsumerError
from engine.lakehouse.catalog.names import lag_tables
from engine.lakehouse.catalog.views import lag_sql
from engine.lakehouse.delta.delta_log import table_exists
from engine.lakehouse.storage.layout import layout


def lag(spark: SparkSession, cfg: EngineConfig, group: str | None = None) -> DataFrame:
    """Each group's lag per topic table: ``group_name``, ``topic``, ``committed_ts``,
    ``lag`` (delivered, not yet committed), ``newest_delivered_ts``. ``group`` ignores case
    and includes its broadcasting members (``<group>__<member>``).

    Raises:
        ConsumerError: when ``group`` names a group that never committed.
    """
    tables = lag_tables(spark, cfg)
    sql = lag_sql(layout(cfg).consumer_log, tables or {})
    out = spark.sql(sql)
    if group is not None:
        out = out.where(_in_group(group))
        if out.isEmpty():
            raise ConsumerError(f"unknown consumer group {group!r}: {groups_hint(spark, cfg)}")
    return out.orderBy("group_name", "topic")


def _in_group(group: str) -> Column:
    """The rows of ``group`` (any case) and of its broadcasting members, ``<group>__<member>``."""
    name = group.lower()
    return (F.col("group_name") == name) | F.col("group_name").startswith(f"{name}__")


def groups(spark: SparkSession, cfg: EngineConfig) -> list[str]:
    """Names of the consumer groups that committed at least once."""
    lay = layout(cfg)
    if not table_exists(lay.consumer_log):
        return []
    log = spark.read.format("delta").load(lay.consumer_log)
    return sorted(r[0] for r in log.select("group_name").distinct().collect())


def groups_hint(spark: SparkSession, cfg: EngineConfig) -> str:
    """``"groups: a, b"`` or ``"no group has committed yet"``, for error messages."""
    known = groups(spark, cfg)
    return f"groups: {', '.join(known)}" if known else "no group has committed yet"


def members(
    spark: SparkSession,
    cfg: EngineConfig,
    now: datetime,
    group: str | None = None,
    window_s: float = 300.0,
) -> DataFrame:
    """Each group's members (the consumers that committed): ``group_name``, ``consumer``,
    ``last_commit_ts``, ``handled`` (messages acked or sent back in the last ``window_s``
    seconds), ``share`` (of the group's handled messages in that window) and ``handled_total``.

    Example:
        >>> members(spark, cfg, datetime.now(UTC), "workers").show()  # doctest: +SKIP

    Raises:
        ConsumerError: when ``group`` names a group that never committed.
    """
    path = layout(cfg).consumer_log
    if not table_exists(path):
        if group is not None:
            raise ConsumerError(f"unknown consumer group {group!r}: {groups_hint(spark, cfg)}")
        return spark.createDataFrame([], MEMBERS_SCHEMA)
    log = spark.read.format("delta").load(path)
    if group is not None:
        log = log.where(_in_group(group))
    # One handled message: an acked count on an offset row, or one sent-back row.
    handled = F.when(F.col("kind") == "offset", F.coalesce("acked", F.lit(0))).when(
        F.col("kind").isin("retry", "dead"), F.lit(1)
    )
    since = F.lit(now - timedelta(seconds=window_s)).cast("timestamp")
    recent = F.when(F.col("committed_ts") >= since, handled)
    per_member = log.groupBy("group_name", "consumer").agg(
        F.max("committed_ts").alias("last_commit_ts"),
        F.coalesce(F.sum(recent), F.lit(0)).cast("long").alias("handled"),
        F.coalesce(F.sum(handled), F.lit(0)).cast("long").alias("handled_total"),
    )
    group_total = Window.partitionBy("group_name")
    out = per_member.withColumn(
        "share",
        F.round(F.col("handled") / F.nullif(F.sum("handled").over(group_total), F.lit(0)), 3),
    ).select("group_name", "consumer", "last_commit_ts", "handled", "share", "handled_total")
    if group is not None and out.isEmpty():
        raise ConsumerError(f"unknown consumer group {group!r}: {groups_hint(spark, cfg)}")
    return out.orderBy("group_name", F.desc("last_commit_ts"))


MEMBERS_SCHEMA = (
    "group_name string, consumer string, last_commit_ts timestamp, handled long, "
    "share double, handled_total long"
)
