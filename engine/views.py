"""SQL views over the engine's tables: the delivery checkpoint, what is pending, what is due.

``register_views`` is called wherever the checkpoint log first has a file (at session start
through :func:`engine.tables.register_topic_tables`, and by the first delivery commit).
"""

from __future__ import annotations

from pyspark.sql import SparkSession

from schemas import DELAY_OFFSET


def register_views(
    spark: SparkSession, database: str, delay_offset_path: str, pending: bool = True
) -> None:
    """Create or replace ``delay_offset``, ``pending`` and ``due_forecast`` in ``database``.

    Args:
        spark: the session whose catalog gets the views.
        database: where the engine's tables are registered.
        delay_offset_path: the checkpoint log folder.
        pending: also the views that need ``schedule`` and ``command_results``.
    """
    statements = [delay_offset_view_sql(database, delay_offset_path)]
    for statement in statements + (views_sql(database) if pending else []):
        spark.sql(statement)


def delay_offset_view_sql(database: str, path: str) -> str:
    """SQL creating the ``delay_offset`` view over the log (typed columns).

    Each line is parsed with the full schema, so files written before a column existed
    read it as null.
    """
    as_text = ", ".join(f"`{f.name}`: STRING" for f in DELAY_OFFSET.fields)
    casts = ", ".join(
        f"CAST(r.`{f.name}` AS {f.dataType.simpleString()}) AS `{f.name}`"
        for f in DELAY_OFFSET.fields
    )
    return (
        f"CREATE OR REPLACE VIEW `{database}`.`delay_offset` AS SELECT {casts} FROM "
        f"(SELECT from_json(value, 'STRUCT<{as_text}>') AS r FROM text.`{path}` "
        "WHERE trim(value) != '')"
    )


def views_sql(database: str) -> list[str]:
    """SQL for the views ``pending`` and ``due_forecast`` (need ``delay_offset``)."""
    db = f"`{database}`"
    latest = (
        f"SELECT watermark, stamp_batch FROM {db}.delay_offset WHERE status = 'committed' "
        "ORDER BY round DESC LIMIT 1"
    )
    return [
        f"CREATE OR REPLACE VIEW {db}.pending AS SELECT s.* FROM {db}.schedule s "
        f"LEFT JOIN ({latest}) c ON true "
        "WHERE (s.deliver_ts > coalesce(c.watermark, TIMESTAMP'1970-01-01 00:00:00') "
        "OR s.stamp_batch > coalesce(c.stamp_batch, -1)) "
        f"AND NOT EXISTS (SELECT 1 FROM {db}.command_results r WHERE r.msg_id = s.msg_id "
        "AND r.revision = coalesce(s.revision, 0) "
        "AND r.result IN ('cancelled', 'rescheduled'))",
        f"CREATE OR REPLACE VIEW {db}.due_forecast AS "
        "SELECT date_trunc('MINUTE', greatest(deliver_ts, current_timestamp())) AS minute, "
        f"count(*) AS due FROM {db}.pending "
        "WHERE deliver_ts < current_timestamp() + INTERVAL 1 HOUR GROUP BY 1",
    ]
