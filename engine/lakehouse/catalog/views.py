"""The SQL of the engine's views, as text: the delivery checkpoint, what is pending, what
is due, each message's history, and consumer lag. :mod:`engine.lakehouse.catalog.names` registers
them; the consumer's ``lag`` runs the same SQL.

Each function returns a view's query (``SELECT ...``); the catalog names it.

Example:
    >>> print(checkpoint_views("delayq")["due_forecast"][:37])
    SELECT date_trunc('MINUTE', greatest(
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.core.message import DUPLICATE
from schemas import DELAY_OFFSET, RATES_STATE, SCHEDULE


def delay_offset_query(path: str) -> str:
    """The query of the ``delay_offset`` view over the log at ``path`` (typed columns).

    Each line is parsed with the full schema, so files written before a column existed
    read it as null.
    """
    as_text = ", ".join(f"`{f.name}`: STRING" for f in DELAY_OFFSET.fields)
    casts = ", ".join(
        f"CAST(r.`{f.name}` AS {f.dataType.simpleString()}) AS `{f.name}`"
        for f in DELAY_OFFSET.fields
    )
    return (
        f"SELECT {casts} FROM "
        f"(SELECT from_json(value, 'STRUCT<{as_text}>') AS r FROM text.`{path}` "
        "WHERE trim(value) != '')"
    )


def checkpoint_views(database: str) -> dict[str, str]:
    """The queries of the views ``pending`` and ``due_forecast``, by name (they read
    ``delay_offset``, ``schedule`` and ``command_results`` in ``database``)."""
    db = f"`{database}`"
    latest = (
        f"SELECT watermark, stamp_batch, rates FROM {db}.delay_offset "
        "WHERE status = 'committed' ORDER BY round DESC LIMIT 1"
    )
    # rows a topic's rate cap keeps waiting: due by the watermark, above the topic's cursor
    held = (
        f"SELECT w.key AS topic, w.value.cursor_us AS us, w.value.cursor_id AS id, "
        f"w.value.cursor_rev AS rev FROM ({latest}) l "
        f"LATERAL VIEW explode(from_json(l.rates, '{RATES_STATE}')) w AS key, value "
        "WHERE w.value.cursor_us IS NOT NULL"
    )
    # Columns by name, not s.*: a view keeps the columns it was made with, and the text
    # changes with the schema, so the catalog alters the view after an upgrade.
    columns = ", ".join(f"s.`{f.name}`" for f in SCHEDULE.fields)
    return {
        "pending": f"SELECT {columns} FROM {db}.schedule s "
        f"LEFT JOIN ({latest}) c ON true "
        f"LEFT JOIN ({held}) h ON lower(s.topic) = h.topic "
        "WHERE (s.deliver_ts > coalesce(c.watermark, TIMESTAMP'1970-01-01 00:00:00') "
        "OR s.stamp_batch > coalesce(c.stamp_batch, -1) "
        "OR unix_micros(s.deliver_ts) > h.us OR (unix_micros(s.deliver_ts) = h.us "
        "AND (s.msg_id > h.id OR (s.msg_id = h.id AND coalesce(s.revision, 0) > h.rev)))) "
        f"AND NOT EXISTS (SELECT 1 FROM {db}.command_results r WHERE r.msg_id = s.msg_id "
        "AND r.revision = coalesce(s.revision, 0) "
        "AND r.result IN ('cancelled', 'rescheduled'))",
        "due_forecast": "SELECT date_trunc('MINUTE', "
        "greatest(deliver_ts, current_timestamp())) AS minute, "
        f"count(*) AS due FROM {db}.pending "
        "WHERE deliver_ts < current_timestamp() + INTERVAL 1 HOUR GROUP BY 1",
    }


#: The columns of ``schedule_request_results``, as the engine writes them (JSON lines).
_REQUEST_RESULTS = (
    ("version", "BIGINT"), ("row", "BIGINT"), ("name", "STRING"), ("action", "STRING"),
    ("result", "STRING"), ("revision", "BIGINT"), ("detail", "STRING"),
    ("decided_ts", "TIMESTAMP"), ("status", "STRING"),
)  # fmt: skip


def request_results_query(path: str) -> str:
    """The query of the ``schedule_request_results`` view over the outcomes the engine
    wrote at ``path`` (:mod:`engine.recur.requests`): one row per request applied or refused.

    Example:
        >>> request_results_query("/lake/_checkpoints/schedule-requests")[:38]
        'SELECT r.version AS request_version, r'
    """
    as_text = ", ".join(f"`{n}`: STRING" for n, _ in _REQUEST_RESULTS)
    return (
        "SELECT r.version AS request_version, r.row AS request_row, r.name, r.action, r.result, "
        "CAST(r.revision AS BIGINT) AS revision, r.detail, "
        "CAST(r.decided_ts AS TIMESTAMP) AS decided_ts FROM "
        f"(SELECT from_json(value, 'STRUCT<{as_text}>') AS r FROM text.`{path}` "
        "WHERE trim(value) != '') WHERE r.status = 'applied'"
    )


def schedules_query(database: str, next_path: str) -> str:
    """The query of the ``schedules`` view: each recurring schedule's newest revision (not
    deleted), with its next occurrence as the engine published it at ``next_path`` (null
    until the engine has seen that revision) and the missed occurrences it skipped."""
    db = f"`{database}`"
    published = (
        "STRUCT<name: STRING, revision: BIGINT, next_fire_ts: STRING, published_ts: STRING, "
        "skipped_total: BIGINT>"
    )
    return (
        "SELECT d.name, d.revision, d.state, d.topic, d.kind, d.expression, d.time_zone, "
        "d.start_ts, d.end_ts, d.jitter_ms, d.catch_up, d.catch_up_window_ms, "
        "d.effective_ts AS changed_ts, CAST(n.r.next_fire_ts AS TIMESTAMP) AS next_fire_ts, "
        "CAST(n.r.published_ts AS TIMESTAMP) AS engine_seen_ts, "
        "coalesce(n.r.skipped_total, 0) AS skipped_total "
        "FROM (SELECT *, row_number() OVER (PARTITION BY name ORDER BY revision DESC, "
        f"effective_ts DESC, action DESC, state DESC) AS newest FROM {db}.recurring) d "
        f"LEFT JOIN (SELECT from_json(value, '{published}') AS r FROM text.`{next_path}` "
        "WHERE trim(value) != '') n ON n.r.name = d.name AND n.r.revision = d.revision "
        "WHERE d.newest = 1 AND d.state != 'deleted'"
    )


def history_query(database: str, topics: Sequence[str]) -> str:
    """The query of the ``history`` view: every event of every message, one row each.

    The same events as ``delayq history`` (:func:`engine.control.inspect.history`): ``sent``,
    ``stamped``, ``quarantined`` or ``duplicate``, what a command decided, and ``delivered``
    into each of ``topics`` (the view is replaced when a topic table appears). For tools
    that have SQL only (JDBC, Spark Connect):
    ``SELECT * FROM delayq.history WHERE array_contains(keys, 'order-1') ORDER BY msg_id, at``.

    Example:
        >>> print(history_query("delayq", ["orders"])[:36])
        SELECT msg_id, keys, 'sent' AS event
    """
    db = f"`{database}`"
    stamped = "concat('queue ', queue_id, ', due ', deliver_ts)"
    moved = (
        "concat('to ', c.new_deliver_ts, ' (revision ', c.new_revision, '), command ', "
        "c.command_id, ', round ', c.round)"
    )
    command = "concat('command ', c.command_id, ', round ', c.round)"
    parts = [
        "SELECT msg_id, keys, 'sent' AS event, store_ts AS at, topic, CASE "
        "WHEN deliver_at IS NOT NULL THEN concat('deliver at ', deliver_at) "
        "WHEN delay_level > 0 THEN concat('delay level ', delay_level) "
        f"ELSE 'not delayed' END AS detail FROM {db}.`commitlog`",
        f"SELECT msg_id, keys, 'stamped', stamped_ts, topic, CASE WHEN coalesce(revision, 0) > 0 "
        f"THEN concat({stamped}, ', revision ', revision) ELSE {stamped} END "
        f"FROM {db}.`schedule`",
        f"SELECT msg_id, keys, CASE WHEN startswith(reason, '{DUPLICATE}') THEN 'duplicate' "
        f"ELSE 'quarantined' END, quarantined_ts, topic, reason FROM {db}.`quarantine`",
        f"SELECT c.msg_id, k.keys, c.result, c.decided_ts, c.topic, CASE "
        f"WHEN c.result = 'rescheduled' THEN {moved} "
        f"WHEN c.detail IS NOT NULL THEN concat(c.detail, ', ', {command}) ELSE {command} END "
        f"FROM {db}.`command_results` c LEFT JOIN (SELECT msg_id, first(keys) AS keys "
        f"FROM {db}.`commitlog` GROUP BY msg_id) k ON c.msg_id = k.msg_id",
    ] + [
        f"SELECT msg_id, keys, 'delivered', delivered_ts, topic, "
        f"concat('{database}.{name}, round ', delivery_round) FROM {db}.`{name}`"
        for name in topics
    ]
    return " UNION ALL ".join(parts)


def lag_sql(consumer_log: str, tables: Mapping[str, str]) -> str:
    """SQL for each group's lag per topic table: delivered rows after its position.

    Args:
        consumer_log: path of ``consumer_log``.
        tables: topic table name -> path, for the tables some group has committed.
    """
    positions = (
        "SELECT group_name, topic, max(struct(delivery_round, deliver_ts, msg_id)) AS p, "
        "max(committed_ts) AS committed_ts "
        f"FROM delta.`{consumer_log}` WHERE kind = 'offset' GROUP BY group_name, topic"
    )
    parts = [
        f"SELECT o.group_name, o.topic, o.committed_ts, count(x.msg_id) AS lag, "
        "max(x.delivered_ts) AS newest_delivered_ts "
        f"FROM ({positions}) o LEFT JOIN delta.`{path}` x ON o.topic = '{name}' "
        "AND x.delivery_round >= o.p.delivery_round "
        "AND struct(x.delivery_round, x.deliver_ts, x.msg_id) > o.p "
        f"WHERE o.topic = '{name}' GROUP BY o.group_name, o.topic, o.committed_ts"
        for name, path in sorted(tables.items())
    ]
    if not parts:
        return (
            "SELECT CAST(NULL AS STRING) AS group_name, CAST(NULL AS STRING) AS topic, "
            "CAST(NULL AS TIMESTAMP) AS committed_ts, 0L AS lag, "
            "CAST(NULL AS TIMESTAMP) AS newest_delivered_ts WHERE false"
        )
    return " UNION ALL ".join(parts)
