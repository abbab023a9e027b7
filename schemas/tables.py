"""The Delta tables of a lakehouse and their columns.

Columns are nullable on purpose: a row that reaches ``commitlog`` by some other route than
the producer (a SQL ``INSERT``, another writer) may be incomplete, and the engine must be able
to read it and quarantine it with a reason instead of failing.

| table          | one row per                                   | partitioned by |
|----------------|-----------------------------------------------|----------------|
| ``commitlog``  | message sent                                  |                |
| ``schedule``   | stamped message waiting for (or past) delivery | ``queue_id``  |
| ``quarantine`` | message the engine refused, with the reason   |                |
| ``topics/<t>`` | message delivered to topic ``t``              |                |
| ``commands``   | cancel or reschedule asked by a user          |                |
| ``command_results`` | outcome of a command for one message     |                |
| ``consumer_log`` | consumer group commit: progress or a failed message |          |
| ``recurring``  | change to a recurring schedule (a revision)   |                |

``DELAY_OFFSET`` is the row shape of the delivery checkpoint, a log of JSON files (see
``engine.lakehouse.state.offset_log``) that SQL reads as the view ``<database>.delay_offset``.
"""

from __future__ import annotations

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)


def _fields(*pairs: tuple[str, object]) -> list[StructField]:
    return [StructField(name, dtype, nullable=True) for name, dtype in pairs]  # type: ignore[arg-type]


#: What a producer sends. ``store_ts`` is assigned when the row is committed here.
_MESSAGE = _fields(
    ("msg_id", StringType()),
    ("topic", StringType()),
    ("keys", ArrayType(StringType(), containsNull=False)),
    ("tags", StringType()),
    ("properties", MapType(StringType(), StringType(), valueContainsNull=True)),
    ("body", BinaryType()),
    ("delay_level", IntegerType()),
    ("born_ts", TimestampType()),
    ("store_ts", TimestampType()),
    # An absolute deliver time (timer message); null for level-delayed messages.
    ("deliver_at", TimestampType()),
)

COMMITLOG = StructType(_MESSAGE)

#: A stamped message: ``queue_id`` is the clamped level (0 = not delayed, -1 = a timer
#: message) and ``deliver_ts`` = ``store_ts`` + the level's delay (RocketMQ's tagsCode),
#: or ``deliver_at`` for a timer message.
#: ``stamp_batch`` is the stamping micro-batch that wrote the row. ``revision`` is 0 for a
#: stamped row and n for the row written by a message's n-th reschedule (null in rows
#: stamped before rescheduling existed: read it as 0). ``(msg_id, revision)`` names a row.
#: ``msg_id_hash`` is Spark's ``xxhash64(msg_id)``, the key of the deduplication index, kept
#: so that a restart rebuilds the index from two numeric columns (null in older rows).
SCHEDULE = StructType(
    _MESSAGE
    + _fields(
        ("queue_id", IntegerType()),
        ("deliver_ts", TimestampType()),
        ("stamp_batch", LongType()),
        ("stamped_ts", TimestampType()),
        ("revision", IntegerType()),
        ("msg_id_hash", LongType()),
    )
)

QUARANTINE = StructType(
    _MESSAGE
    + _fields(
        ("reason", StringType()),
        ("stamp_batch", LongType()),
        ("quarantined_ts", TimestampType()),
    )
)


def _message(*names: str) -> list[StructField]:
    by_name = {f.name: f for f in _MESSAGE}
    return [by_name[n] for n in names]


#: A delivered message in its real topic's table.
TOPIC = StructType(
    _message("msg_id", "topic", "keys", "tags", "properties", "body", "delay_level")
    + _fields(("queue_id", IntegerType()))
    + _message("born_ts", "store_ts")
    + _fields(
        ("deliver_ts", TimestampType()),
        ("delivered_ts", TimestampType()),
        ("delivery_round", LongType()),
    )
)

#: A command, appended by a client and applied by the delivery stage. ``action`` is
#: ``cancel`` (by ``msg_id``, or every pending message with ``key``, optionally only in
#: ``topic``) or ``reschedule`` (``msg_id`` to ``deliver_at``).
COMMANDS = StructType(
    _fields(
        ("command_id", StringType()),
        ("action", StringType()),
        ("msg_id", StringType()),
        ("key", StringType()),
        ("topic", StringType()),
        ("deliver_at", TimestampType()),
        ("issued_ts", TimestampType()),
        ("issued_by", StringType()),
    )
)

#: What a command did, one row per message row it touched (or one row saying why it
#: touched none). ``result`` is ``cancelled``, ``rescheduled``, ``already_delivered``,
#: ``already_cancelled`` or ``not_found``. A ``cancelled``/``rescheduled`` row names the
#: ``schedule`` row ``(msg_id, revision)`` that will not be delivered; a reschedule's new
#: row is ``(msg_id, new_revision)``, due at ``new_deliver_ts``. ``round`` is the delivery
#: round that decided it.
COMMAND_RESULTS = StructType(
    _fields(
        ("command_id", StringType()),
        ("action", StringType()),
        ("result", StringType()),
        ("msg_id", StringType()),
        ("revision", IntegerType()),
        ("topic", StringType()),
        ("queue_id", IntegerType()),
        ("deliver_ts", TimestampType()),
        ("new_revision", IntegerType()),
        ("new_deliver_ts", TimestampType()),
        ("detail", StringType()),
        ("round", LongType()),
        ("decided_ts", TimestampType()),
    )
)

#: A consumer group's commits. Each commit (``group_name``, ``mode``, ``commit_seq``) is
#: one Delta append holding, per topic table read, an ``offset`` row (the last message
#: consumed: ``delivery_round``, ``deliver_ts``, ``msg_id``) and, per failed message, a
#: ``retry`` or ``dead`` row whose ``sendback`` is the ``commitlog`` row to send (to
#: ``retry_<group>`` or ``dlq_<group>``). Recording both in one commit makes a crash
#: between a nack and its commit harmless: the send-back is forwarded from here, once.
CONSUMER_LOG = StructType(
    _fields(
        ("group_name", StringType()),
        ("mode", StringType()),
        ("commit_seq", LongType()),
        ("commit_id", StringType()),
        ("consumer", StringType()),
        ("committed_ts", TimestampType()),
        ("kind", StringType()),
        ("topic", StringType()),
        ("delivery_round", LongType()),
        ("deliver_ts", TimestampType()),
        ("msg_id", StringType()),
        ("acked", LongType()),
        ("reason", StringType()),
        ("sendback", COMMITLOG),
    )
)

#: A recurring schedule's revisions, one row each (``engine.recur``): ``action`` is
#: ``create``, ``update``, ``pause``, ``resume`` or ``delete``, ``state`` what the schedule is
#: after it (``active``, ``paused``, ``deleted``), ``effective_ts`` when it was made. The
#: message template is ``topic``/``body``/``keys``/``tags``/``properties``; ``kind`` and
#: ``expression`` say when it fires (``cron``, ``every``, ``at``) in ``time_zone``.
RECURRING = StructType(
    _fields(
        ("name", StringType()),
        ("revision", LongType()),
        ("action", StringType()),
        ("state", StringType()),
        ("effective_ts", TimestampType()),
        ("topic", StringType()),
        ("body", BinaryType()),
        ("keys", ArrayType(StringType(), containsNull=False)),
        ("tags", StringType()),
        ("properties", MapType(StringType(), StringType(), valueContainsNull=True)),
        ("kind", StringType()),
        ("expression", StringType()),
        ("time_zone", StringType()),
        ("start_ts", TimestampType()),
        ("end_ts", TimestampType()),
        ("jitter_ms", LongType()),
        ("catch_up", StringType()),
        ("catch_up_window_ms", LongType()),
    )
)

#: Changes to recurring schedules asked for in SQL (``INSERT INTO``): the engine applies
#: each row once, in commit order (``engine.recur.requests``). ``action`` is ``create``,
#: ``update``, ``pause``, ``resume`` or ``delete``; the other columns are the schedule's
#: fields (null: not given; for ``update``, unchanged).
SCHEDULE_REQUESTS = StructType(
    _fields(
        ("name", StringType()),
        ("action", StringType()),
        ("topic", StringType()),
        ("body", StringType()),
        ("cron", StringType()),
        ("every", StringType()),
        ("at", ArrayType(StringType(), containsNull=False)),
        ("time_zone", StringType()),
        ("start_ts", TimestampType()),
        ("end_ts", TimestampType()),
        ("jitter", StringType()),
        ("catch_up", StringType()),
        ("catch_up_window", StringType()),
        ("keys", ArrayType(StringType(), containsNull=False)),
        ("tags", StringType()),
        ("properties", MapType(StringType(), StringType(), valueContainsNull=True)),
        ("requested_ts", TimestampType()),
    )
)

#: The delayOffset checkpoint: one ``committed`` row per queue holding that queue's
#: progress, plus at most one ``planned`` row (``queue_id`` null) for a round whose topic
#: writes may have started. ``watermark``/``schedule_version``/``stamp_batch`` fix which
#: rows a round delivers, so a replayed round delivers exactly the same rows.
DELAY_OFFSET = StructType(
    _fields(
        ("checkpoint_id", StringType()),
        ("status", StringType()),
        ("queue_id", IntegerType()),
        ("round", LongType()),
        ("watermark", TimestampType()),
        ("schedule_version", LongType()),
        ("stamp_batch", LongType()),
        ("delivered", LongType()),
        ("delivered_total", LongType()),
        ("last_deliver_ts", TimestampType()),
        ("updated_ts", TimestampType()),
        ("stamped_total", LongType()),
        ("cancelled_total", LongType()),
        ("rescheduled_total", LongType()),
        ("commands_version", LongType()),
        # JSON: a plan's rate caps ({"caps": {topic: msg/s}}), or the capped topics'
        # state after a committed round (RATES_STATE)
        ("rates", StringType()),
    )
)

#: The capped topics' state in a committed ``DELAY_OFFSET`` row's ``rates`` (JSON), as Spark
#: SQL reads it (``from_json``): per topic table, when its cap lets the next row go, the key
#: of the last row delivered while rows wait (null: none waits), how many wait, the cap.
RATES_STATE = (
    "MAP<STRING, STRUCT<tat_ns: BIGINT, cursor_us: BIGINT, cursor_id: STRING, "
    "cursor_rev: BIGINT, waiting: BIGINT, rate: DOUBLE>>"
)


def column_names(schema: StructType) -> list[str]:
    """The column names of ``schema``, in order."""
    return [f.name for f in schema.fields]
