"""Consumer lag: per group and topic table, the delivered rows after the group's position.

Example:
    >>> lag(spark, cfg, "billing").show()  # doctest: +SKIP
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.core.config import EngineConfig
from engine.core.errors import ConsumerError
from engine.lakehouse.catalog import lag_tables
from engine.lakehouse.delta_log import table_exists
from engine.lakehouse.layout import layout
from engine.lakehouse.views import lag_sql


def lag(spark: SparkSession, cfg: EngineConfig, group: str | None = None) -> DataFrame:
    """Each group's lag per topic table: ``group_name``, ``topic``, ``committed_ts``,
    ``lag`` (delivered, not yet committed), ``newest_delivered_ts``.

    Raises:
        ConsumerError: when ``group`` names a group that never committed.
    """
    tables = lag_tables(spark, cfg)
    sql = lag_sql(layout(cfg).consumer_log, tables or {})
    out = spark.sql(sql)
    if group is not None:
        out = out.where(F.col("group_name") == group)
        if out.isEmpty():
            raise ConsumerError(f"unknown consumer group {group!r}: {groups_hint(spark, cfg)}")
    return out.orderBy("group_name", "topic")


def groups(spark: SparkSession, cfg: EngineConfig) -> list[str]:
    """Names of the consumer groups that committed at least once."""
    lay = layout(cfg)
    if not table_exists(spark, lay.consumer_log):
        return []
    log = spark.read.format("delta").load(lay.consumer_log)
    return sorted(r[0] for r in log.select("group_name").distinct().collect())


def groups_hint(spark: SparkSession, cfg: EngineConfig) -> str:
    """``"groups: a, b"`` or ``"no group has committed yet"``, for error messages."""
    known = groups(spark, cfg)
    return f"groups: {', '.join(known)}" if known else "no group has committed yet"
