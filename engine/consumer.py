"""Consumer groups: poll with long polling, ack and nack, retries with backoff, dead letters.

A group reads its topics' tables in delivery order (``delivery_round``, ``deliver_ts``,
``msg_id``: rounds are global, so several topics merge into one order) plus its retry topic
``retry_<group>``. Progress is a position per topic table, recorded in ``consumer_log``.

A failed (nacked) message goes back through ``commitlog`` to ``retry_<group>`` with delay
level 3 + reconsumeTimes (RocketMQ's ``10s 30s 1m ... 2h``) or the group's own
``retry_delays``, and reconsumeTimes + 1. One that already came back
``max_reconsume_times`` times goes to ``dlq_<group>`` instead, with the reason and its
history of failures in its properties. Both are ordinary topic tables.

A commit is one Delta append to ``consumer_log`` (idempotent: ``txnAppId`` per group and
mode, ``txnVersion`` = commit number) holding the new positions and the failed messages as
they will be sent back. They are then forwarded to ``commitlog`` with their own
``txnAppId``, so a crash between the two steps, or a commit replayed, sends each once.

Example:
    >>> consumer = Consumer(spark, cfg, "billing", ["orders"])  # doctest: +SKIP
    >>> batch = consumer.poll(max_messages=100)  # waits up to 15 s for new rows
    >>> for m in batch:
    ...     if handle(m.body):
    ...         consumer.ack(m)
    ...     else:
    ...         consumer.nack(m, "payment service down")
    >>> consumer.commit()
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from engine.clock import Clock, SystemClock, from_micros
from engine.config import RETRY_FIRST_LEVEL, EngineConfig, GroupConfig
from engine.errors import ConfigError, ConsumerConflictError, ConsumerError
from engine.fs import hadoop_path, jvm, stream_query_id
from engine.tables import (
    RETRY_PREFIX,
    check_topic,
    dlq_topic,
    ensure_consumer_log,
    ensure_topic_table,
    latest_version,
    layout,
    list_topics,
    register_table,
    retry_topic,
    topic_table_name,
)
from schemas import COMMITLOG, CONSUMER_LOG

#: Properties the engine sets on a message it sends back (RocketMQ's names where it has one).
PROP_RETRY_TOPIC = "RETRY_TOPIC"
PROP_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
PROP_RECONSUME_TIME = "RECONSUME_TIME"
PROP_DLQ_REASON = "DLQ_REASON"
#: JSON list of the message's failures: ``{"group", "attempt", "reason", "at"}``.
PROP_FAILURES = "DELAYQ_FAILURES"
ENGINE_PROPERTIES = (
    PROP_RETRY_TOPIC,
    PROP_ORIGIN_MESSAGE_ID,
    PROP_RECONSUME_TIME,
    PROP_DLQ_REASON,
    PROP_FAILURES,
)
FAILURES_TYPE = "array<struct<group:string,attempt:int,reason:string,at:string>>"
#: How often a waiting poll looks for a new commit of its tables (a file probe, no read).
WAKE_CHECK_SECONDS = 0.1
POLL = "poll"
STREAM = "stream"


@dataclass(frozen=True)
class Received:
    """A message as a consumer gets it.

    Attributes:
        msg_id: id of this delivery of the message (a retry has its own id).
        topic: the real topic (the original one, for a message read from a retry topic).
        body: the payload.
        keys: lookup keys.
        tags: the tag, if any.
        properties: all properties, including the engine's (``RECONSUME_TIME``, ...).
        reconsume_times: how many times it failed before (0 on first delivery).
        origin_msg_id: id of the message as first sent.
        deliver_ts: when it was due.
        delivered_ts: when the engine delivered it.
        table: the topic table it was read from (``topic``, or ``retry_<group>``).
        delivery_round: the delivery round that wrote it.
    """

    msg_id: str
    topic: str
    body: bytes
    keys: tuple[str, ...]
    tags: str | None
    properties: Mapping[str, str]
    reconsume_times: int
    origin_msg_id: str
    deliver_ts: datetime
    delivered_ts: datetime
    table: str
    delivery_round: int
    _deliver_us: int = field(repr=False, compare=False, default=0)

    @property
    def position(self) -> tuple[int, int, str]:
        """Where it sits in its table: (delivery round, deliver time in µs, id)."""
        return (self.delivery_round, self._deliver_us, self.msg_id)


def consumer_columns(df: DataFrame) -> DataFrame:
    """Add what a consumer sees to topic rows that carry a ``table`` column.

    ``real_topic`` is the original topic (from ``RETRY_TOPIC`` for a retried message),
    ``reconsume_times`` and ``origin_msg_id`` come from the engine's properties.
    """
    props = F.col("properties")
    # Only the engine writes retry tables: elsewhere these are a producer's own properties.
    retried = F.col("table").startswith(RETRY_PREFIX)
    return df.select(
        *[F.col(c) for c in df.columns],
        F.coalesce(F.when(retried, props[PROP_RETRY_TOPIC]), F.col("topic")).alias("real_topic"),
        F.coalesce(F.when(retried, props[PROP_RECONSUME_TIME].try_cast("int")), F.lit(0)).alias(
            "reconsume_times"
        ),
        F.coalesce(props[PROP_ORIGIN_MESSAGE_ID], F.col("msg_id")).alias("origin_msg_id"),
    )


def sendback_rows(failed: DataFrame, group: str, settings: GroupConfig, now: datetime) -> DataFrame:
    """The ``commitlog`` rows that send failed messages back, with ``kind`` and ``reason``.

    Pure over ``failed`` (rows of :func:`consumer_columns` plus ``reason``, one per
    ``msg_id``): a message
    that came back fewer than ``max_reconsume_times`` times goes to ``retry_<group>``,
    due after its retry delay; others go to ``dlq_<group>`` at once. Ids are derived from
    (group, message, attempt), so computing this twice gives the same rows.
    """
    n = F.col("reconsume_times")
    dead = n >= F.lit(settings.max_reconsume_times)
    now_lit = F.lit(now).cast("timestamp")
    failure = F.struct(
        F.lit(group).alias("group"),
        n.alias("attempt"),
        F.coalesce(F.col("reason"), F.lit("")).alias("reason"),
        F.lit(now.isoformat()).alias("at"),
    )
    earlier = F.from_json(F.col("properties")[PROP_FAILURES], FAILURES_TYPE)
    history = F.when(earlier.isNull(), F.array(failure)).otherwise(
        F.concat(earlier, F.array(failure))
    )
    user_props = F.map_filter(
        F.coalesce(F.col("properties"), F.create_map().cast("map<string,string>")),
        lambda k, _v: ~k.isin(*ENGINE_PROPERTIES),
    )
    engine_props = F.create_map(
        F.lit(PROP_RETRY_TOPIC), F.col("real_topic"),
        F.lit(PROP_ORIGIN_MESSAGE_ID), F.col("origin_msg_id"),
        F.lit(PROP_RECONSUME_TIME), (n + 1).cast("string"),
        F.lit(PROP_FAILURES), F.to_json(history),
    )  # fmt: skip
    dead_props = F.create_map(F.lit(PROP_DLQ_REASON), F.coalesce(F.col("reason"), F.lit("")))
    properties = F.when(dead, F.map_concat(user_props, engine_props, dead_props)).otherwise(
        F.map_concat(user_props, engine_props)
    )
    level: Column = F.lit(None).cast("int")
    deliver_at: Column = F.lit(None).cast("timestamp")
    if settings.retry_delays is None:
        level = F.when(~dead, n + RETRY_FIRST_LEVEL)
    else:
        delays = F.array(*[F.lit(ms) for ms in settings.retry_delays])
        delay_ms = F.element_at(delays, F.least(n, F.lit(len(settings.retry_delays) - 1)) + 1)
        deliver_at = F.when(~dead, F.timestamp_millis(F.unix_millis(now_lit) + delay_ms))
    target = F.when(dead, F.lit(dlq_topic(group))).otherwise(F.lit(retry_topic(group)))
    new_id = F.upper(
        F.md5(F.concat_ws(":", F.lit(group), F.col("msg_id"), n.cast("string"), target))
    )
    message = {
        "msg_id": new_id,
        "topic": target,
        "keys": F.col("keys"),
        "tags": F.col("tags"),
        "properties": properties,
        "body": F.col("body"),
        "delay_level": level,
        "born_ts": F.col("born_ts"),
        "store_ts": now_lit,
        "deliver_at": deliver_at,
    }
    # keys keep their type (a cast cannot narrow containsNull).
    sendback = F.struct(
        *[
            (message[f.name] if f.name == "keys" else message[f.name].cast(f.dataType)).alias(
                f.name
            )
            for f in COMMITLOG
        ]
    )
    return failed.select(
        F.when(dead, F.lit("dead")).otherwise(F.lit("retry")).alias("kind"),
        F.col("table").alias("topic"),
        "delivery_round",
        "deliver_ts",
        "msg_id",
        F.col("reason"),
        sendback.alias("sendback"),
    )


def check_group(group: object) -> str:
    """Return ``group`` in lower case if it can name a consumer group, else raise naming it.

    Group names ignore case, like the topic tables named after them.
    """
    if not isinstance(group, str):
        raise ConsumerError(f"consumer group {group!r}: expected a name")
    try:
        check_topic(retry_topic(group), internal=True)
    except Exception:
        raise ConsumerError(
            f"consumer group {group!r}: use letters, digits and _ (at most 122)"
        ) from None
    return group.lower()


def check_retry_delays(cfg: EngineConfig, group: str, settings: GroupConfig) -> None:
    """Fail at start when a retry delay exceeds what the engine accepts."""
    longest = max(settings.retry_delays or (0,))
    if longest > cfg.max_delay_ms:
        raise ConfigError(
            f"consumers.groups.{group}.retry_delays",
            settings.retry_delays,
            f"longer than messages.max_delay={cfg.max_delay_ms // 1000}s",
        )


def known_topics(spark: SparkSession, cfg: EngineConfig, topics: Sequence[str]) -> list[str]:
    """Check subscribed topic names: each must have a table or a message sent to it.

    Raises:
        ConsumerError: naming the unknown topic and listing the known ones.
    """
    if not topics:
        raise ConsumerError("subscribe to at least one topic")
    tables = set(list_topics(spark, cfg))
    checked = []
    for topic in topics:
        try:
            check_topic(topic)
        except Exception as err:
            raise ConsumerError(f"cannot consume topic {topic!r}: {err}") from None
        name = topic_table_name(topic)
        if name not in tables and not _ever_sent(spark, cfg, name):
            shown = ", ".join(sorted(t for t in tables if not t.startswith(("retry_", "dlq_"))))
            raise ConsumerError(
                f"unknown topic {topic!r}: nothing was sent to it (topics: {shown or 'none'})"
            )
        checked.append(name)
    return checked


def _exists(spark: SparkSession, table: str) -> bool:
    """Whether a Delta table has been made at ``table`` (a file probe)."""
    log, fs = hadoop_path(spark, f"{table}/_delta_log")
    return bool(fs.exists(log))


def _ever_sent(spark: SparkSession, cfg: EngineConfig, name: str) -> bool:
    path = layout(cfg).commitlog
    if not _exists(spark, path):
        return False
    sent = spark.read.format("delta").load(path).where(F.lower("topic") == name)
    return not sent.limit(1).isEmpty()


def after(position: tuple[int, int, str] | None) -> Column:
    """Rows of a topic table after ``position`` (all rows when it is ``None``)."""
    if position is None:
        return F.lit(True)
    round_, deliver_us, msg_id = position
    key = F.struct(F.unix_micros("deliver_ts").alias("us"), F.col("msg_id").alias("id"))
    bound = F.struct(F.lit(deliver_us).alias("us"), F.lit(msg_id).alias("id"))
    # The plain bound on delivery_round lets Delta skip every older file.
    return (F.col("delivery_round") >= round_) & (
        (F.col("delivery_round") > round_) | (key > bound)
    )


ORDER = ("delivery_round", "deliver_ts", "msg_id")


def table_id(spark: SparkSession, path: str) -> str:
    """A Delta table's id (a new table at the same path has a new one)."""
    row = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").select("id").first()
    return str(row[0]) if row else ""


def _forward(
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
            (
                rows.write.format("delta")
                .mode("append")
                .option("txnAppId", f"delayq-sendback-{mode}-{group}-{log_id}")
                .option("txnVersion", seq)
                .option("userMetadata", f"delayq {mode} consumer {group} commit {seq}")
                .save(lay.commitlog)
            )
        return count
    finally:
        rows.unpersist()


def _append_commit(
    spark: SparkSession,
    cfg: EngineConfig,
    rows: DataFrame,
    group: str,
    mode: str,
    seq: int,
) -> None:
    (
        rows.select(
            *[
                F.col(f.name).alias(f.name)
                if f.name == "sendback" and f.name in rows.columns
                else (F.col(f.name) if f.name in rows.columns else F.lit(None))
                .cast(f.dataType)
                .alias(f.name)
                for f in CONSUMER_LOG
            ]
        )
        .write.format("delta")
        .mode("append")
        .option("txnAppId", f"delayq-group-{mode}-{group}")
        .option("txnVersion", seq)
        .save(layout(cfg).consumer_log)
    )


def _offset_rows(
    spark: SparkSession, positions: Iterable[tuple[str, tuple[int, int, str], int]]
) -> DataFrame:
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


def _commit_columns(
    df: DataFrame, group: str, mode: str, seq: int, commit_id: str, consumer: str, now: datetime
) -> DataFrame:
    return df.select(
        F.lit(group).alias("group_name"),
        F.lit(mode).alias("mode"),
        F.lit(seq).cast("long").alias("commit_seq"),
        F.lit(commit_id).alias("commit_id"),
        F.lit(consumer).alias("consumer"),
        F.lit(now).cast("timestamp").alias("committed_ts"),
        *[F.col(c) for c in df.columns],
    )


@dataclass
class _Table:
    """One subscribed topic table: where the group is, and the last version seen empty."""

    name: str
    path: str
    position: tuple[int, int, str] | None = None
    version: int = -1
    empty_at: int | None = None


class Consumer:
    """A member of a consumer group, reading with long polling.

    One consumer per group at a time commits; a second one that commits the same batch
    number gets :class:`~engine.errors.ConsumerConflictError` (its batch comes again).

    Args:
        spark: a Delta-enabled session.
        cfg: engine configuration; ``cfg.group(group)`` gives the retry settings.
        group: the group name (letters, digits, _).
        topics: the topics to read; the group's retry topic is read as well.
        settings: retry settings for this group, instead of the configured ones.
        clock: the time for commits and send-backs (waiting uses real time).
        name: this consumer's name in ``consumer_log`` (default: a random one).
    """

    def __init__(
        self,
        spark: SparkSession,
        cfg: EngineConfig,
        group: str,
        topics: Sequence[str],
        *,
        settings: GroupConfig | None = None,
        clock: Clock | None = None,
        name: str | None = None,
    ) -> None:
        self.spark = spark
        self.cfg = cfg
        self.group = check_group(group)
        self.settings = settings or cfg.group(self.group)
        check_retry_delays(cfg, self.group, self.settings)
        self.clock = clock or SystemClock()
        self.name = name or f"consumer-{uuid.uuid4().hex[:8]}"
        names = [*known_topics(spark, cfg, list(topics)), retry_topic(group)]
        lay = layout(cfg)
        self._probe = jvm(spark).org.apache.hadoop.fs.Path
        self._fs = hadoop_path(spark, lay.root)[1]
        self.tables = {n: _Table(n, lay.topic(n)) for n in dict.fromkeys(names)}
        for table in self.tables.values():
            table.version = self._start_version(table.path)
        self._log_path = ensure_consumer_log(spark, cfg)
        self._log_id = table_id(spark, self._log_path)
        self._log_version = -1
        self._batch: list[Received] = []
        self._commit_id = ""
        #: Wall-clock time a waiting poll last saw a new commit (for measuring wake-ups).
        self.woke_at: float | None = None
        self._settled: dict[str, str | None] = {}  # msg_id -> None (ack) or the reason
        self._closed = threading.Event()
        self.seq, self._unforwarded = self._restore()
        self._forward_pending()
        if cfg.register_tables:
            register_table(spark, cfg, "consumer_log", self._log_path)

    # ---------------------------------------------------------------- state

    def _restore(self) -> tuple[int, int | None]:
        """The group's last commit number and positions, from ``consumer_log``."""
        self._log_version = self._next_version(self._log_path, self._log_version)
        log = self.spark.read.format("delta").load(self._log_path)
        mine = log.where((F.col("group_name") == self.group) & (F.col("mode") == POLL))
        latest = mine.agg(F.max("commit_seq")).first()
        seq = -1 if latest is None or latest[0] is None else int(latest[0])
        rows = (
            mine.where(F.col("kind") == "offset")
            .groupBy("topic")
            .agg(
                F.max(
                    F.struct("delivery_round", F.unix_micros("deliver_ts"), F.col("msg_id"))
                ).alias("p")
            )
            .collect()
        )
        for row in rows:
            table = self.tables.get(row["topic"])
            if table is not None:
                table.position = (int(row["p"][0]), int(row["p"][1]), str(row["p"][2]))
        for table in self.tables.values():
            table.empty_at = None  # positions may have moved
        # The latest commit's send-backs may not have reached commitlog (a crash).
        return seq, (seq if seq >= 0 else None)

    def _catch_up(self) -> None:
        """Take the positions another consumer of the group committed since (a file probe
        when nothing changed)."""
        if self._next_version(self._log_path, self._log_version) != self._log_version:
            self.seq, self._unforwarded = self._restore()
            self._forward_pending()

    def positions(self) -> dict[str, tuple[int, int, str] | None]:
        """The committed position in each subscribed table."""
        return {name: t.position for name, t in self.tables.items()}

    # ---------------------------------------------------------------- polling

    def poll(self, max_messages: int = 32, timeout: float | None = None) -> list[Received]:
        """Up to ``max_messages`` new messages, in delivery order.

        With nothing new, waits up to ``timeout`` seconds (default: the group's
        ``poll_timeout``, 15 s) and returns as soon as a new commit of one of the tables
        holds messages for it; returns ``[]`` on timeout. Waiting probes each table's
        next Delta log file every 0.1 s; a table is read only when it has a new version.

        Raises:
            ConsumerError: on a bad argument, or when the last batch is not committed.
        """
        if isinstance(max_messages, bool) or not isinstance(max_messages, int):
            raise ConsumerError(f"max_messages={max_messages!r}: expected a whole number")
        if max_messages <= 0:
            raise ConsumerError(f"max_messages={max_messages}: must be at least 1")
        wait = self.settings.poll_timeout_ms / 1000 if timeout is None else timeout
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < 1e9:
            raise ConsumerError(f"timeout={timeout!r}: must be 0 or more seconds")
        if self._batch:
            raise ConsumerError(
                f"{len(self._batch)} messages of the last poll are not committed: "
                "ack or nack them, then commit()"
            )
        self._forward_pending()
        deadline = time.monotonic() + wait
        while True:
            self._catch_up()
            batch = self._read(max_messages)
            if batch:
                self._batch = batch
                self._settled = {}
                self._commit_id = uuid.uuid4().hex  # the same if commit() is retried
                return list(batch)
            if not self._wait_for_commit(deadline):
                return []

    def _start_version(self, path: str) -> int:
        """The table's latest version (-1 if it does not exist yet), asked once."""
        if not self._fs.exists(self._probe(f"{path}/_delta_log")):
            return -1
        return latest_version(self.spark, path)

    def _next_version(self, path: str, version: int) -> int:
        """``version``, or a later one if its next log files exist (a few ms, no read)."""
        if version < 0 and self._fs.exists(self._probe(f"{path}/_delta_log")):
            return latest_version(self.spark, path)  # created since
        while self._fs.exists(self._probe(f"{path}/_delta_log/{version + 1:020d}.json")):
            version += 1
        return version

    def _version(self, table: _Table) -> int:
        return self._next_version(table.path, table.version)

    def _wait_for_commit(self, deadline: float) -> bool:
        """Wait until a table has a version not yet read empty; False at the deadline."""
        while not self._closed.is_set():
            for table in self.tables.values():
                table.version = self._version(table)
                if table.version >= 0 and table.empty_at != table.version:
                    self.woke_at = time.time()
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._closed.wait(min(WAKE_CHECK_SECONDS, remaining))
        return False

    def _read(self, limit: int) -> list[Received]:
        found: list[Received] = []
        for table in self.tables.values():
            table.version = self._version(table)
            if table.version < 0 or table.empty_at == table.version:
                continue
            # The latest snapshot (Delta keeps it cached and updates it incrementally; a
            # versionAsOf read rebuilds one). It holds at least `probed`, so recording
            # `probed` as read-empty is safe: a later commit is still seen as new.
            probed = table.version
            rows = (
                self.spark.read.format("delta")
                .load(table.path)
                .where(after(table.position))
                .orderBy(*ORDER)
                .limit(limit)
                .withColumn("table", F.lit(table.name))
                .transform(consumer_columns)
                .select(
                    "*",
                    F.unix_micros("deliver_ts").alias("_deliver_us"),
                    F.unix_micros("delivered_ts").alias("_delivered_us"),
                )
                .collect()
            )
            if not rows:
                table.empty_at = probed
            found.extend(_received(r) for r in rows)
        found.sort(key=lambda m: m.position)
        return found[:limit]

    # ---------------------------------------------------------------- settling

    def _in_batch(self, message: Received | str) -> str:
        msg_id = message if isinstance(message, str) else message.msg_id
        if not any(m.msg_id == msg_id for m in self._batch):
            raise ConsumerError(f"message {msg_id} is not in the current batch (poll first)")
        return msg_id

    def ack(self, *messages: Received | str) -> None:
        """Mark messages of the current batch as consumed; no argument: all unsettled."""
        targets = messages or tuple(m.msg_id for m in self._batch if m.msg_id not in self._settled)
        for msg_id in [self._in_batch(m) for m in targets]:  # all checked before any is marked
            self._settled[msg_id] = None

    def nack(self, message: Received | str, reason: str = "failed") -> None:
        """Mark a message of the current batch as failed: it comes back later (or dies).

        Nothing is sent until :meth:`commit`; a crash before it means the message is
        polled again, not retried twice.
        """
        self._settled[self._in_batch(message)] = str(reason)

    def commit(self) -> int:
        """Commit the current batch: positions, and the failed messages sent back.

        Returns:
            How many failed messages were sent back (to retry or dead letters).

        Raises:
            ConsumerError: when a message of the batch was neither acked nor nacked.
            ConsumerConflictError: when another consumer of the group committed first.
        """
        self._forward_pending()
        if not self._batch:
            return 0
        open_ = [m.msg_id for m in self._batch if m.msg_id not in self._settled]
        if open_:
            raise ConsumerError(
                f"{len(open_)} messages are neither acked nor nacked: {', '.join(open_[:5])}"
            )
        seq, commit_id, now = self.seq + 1, self._commit_id, self.clock.now()
        last: dict[str, Received] = {}
        acked: dict[str, int] = {}
        for m in self._batch:
            last[m.table] = m
            acked[m.table] = acked.get(m.table, 0) + (self._settled[m.msg_id] is None)
        offsets = _offset_rows(
            self.spark, [(t, m.position, acked[t]) for t, m in sorted(last.items())]
        )
        failed = [m for m in self._batch if self._settled[m.msg_id] is not None]
        rows = offsets
        if failed:
            rows = offsets.unionByName(
                sendback_rows(self._failed_rows(failed), self.group, self.settings, now),
                allowMissingColumns=True,
            )
        rows = _commit_columns(rows, self.group, POLL, seq, commit_id, self.name, now)
        try:
            _append_commit(self.spark, self.cfg, rows, self.group, POLL, seq)
        except Exception as err:
            if "ConcurrentTransaction" not in str(err):
                raise
            # another consumer appended the same commit number at the same moment
        self._check_committed(seq, commit_id)
        self.seq = seq
        for table, m in last.items():
            self.tables[table].position = m.position
        self._batch, self._settled = [], {}
        self._unforwarded = seq
        self._log_version = self._next_version(self._log_path, self._log_version)
        return self._forward_pending()

    def _failed_rows(self, failed: list[Received]) -> DataFrame:
        """The failed messages' topic rows (read back exactly), with their reasons."""
        reasons = self.spark.createDataFrame(
            [(m.table, m.msg_id, m.delivery_round, self._settled[m.msg_id]) for m in failed],
            "table string, msg_id string, delivery_round long, reason string",
        )
        frames = []
        for name in sorted({m.table for m in failed}):
            rounds = sorted({m.delivery_round for m in failed if m.table == name})
            rows = (
                self.spark.read.format("delta")
                .load(self.tables[name].path)
                .where(F.col("delivery_round").isin(rounds))
                .withColumn("table", F.lit(name))
            )
            frames.append(rows.join(reasons, ["table", "msg_id", "delivery_round"]))
        out = frames[0]
        for frame in frames[1:]:
            out = out.unionByName(frame)
        return consumer_columns(out)

    def _check_committed(self, seq: int, commit_id: str) -> None:
        row = (
            self.spark.read.format("delta")
            .load(self._log_path)
            .where(
                (F.col("group_name") == self.group)
                & (F.col("mode") == POLL)
                & (F.col("commit_seq") == seq)
            )
            .select("commit_id")
            .first()
        )
        if row is None or row[0] != commit_id:
            self._batch, self._settled = [], {}
            self.seq, self._unforwarded = self._restore()
            self._forward_pending()
            raise ConsumerConflictError(
                f"another consumer of group {self.group!r} committed batch {seq} first: "
                "this batch was not committed; poll again"
            )

    def _forward_pending(self) -> int:
        if self._unforwarded is None:
            return 0
        count = _forward(self.spark, self.cfg, self.group, POLL, self._unforwarded, self._log_id)
        self._unforwarded = None
        return count

    def close(self) -> None:
        """Stop waiting (a poll in progress returns ``[]``). Uncommitted messages come again."""
        self._closed.set()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _received(row: Any) -> Received:
    props = dict(row["properties"] or {})
    return Received(
        msg_id=str(row["msg_id"]),
        topic=str(row["real_topic"]),
        body=bytes(row["body"] or b""),
        keys=tuple(row["keys"] or ()),
        tags=row["tags"],
        properties=props,
        reconsume_times=int(row["reconsume_times"]),
        origin_msg_id=str(row["origin_msg_id"]),
        deliver_ts=from_micros(int(row["_deliver_us"])),
        delivered_ts=from_micros(int(row["_delivered_us"] or 0)),
        table=str(row["table"]),
        delivery_round=int(row["delivery_round"]),
        _deliver_us=int(row["_deliver_us"]),
    )


# ---------------------------------------------------------------------- Spark helper

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
) -> StreamingQuery:
    """Consume topics as ``group`` with ``readStream`` + ``foreachBatch``.

    ``handler(batch)`` gets each micro-batch (topic columns plus ``table``,
    ``real_topic``, ``reconsume_times``, ``origin_msg_id``) and returns ``None`` (all
    succeeded) or a DataFrame of ``msg_id`` and ``error`` (null: success; rows left out
    succeeded). A handler that raises fails the whole batch with the exception as the
    reason. Failures take the same retry and dead-letter path as :meth:`Consumer.nack`;
    each micro-batch commits once (``txnVersion`` = batch id), so a replayed batch sends
    nothing twice.

    Example:
        >>> def handle(batch):
        ...     return batch.select("msg_id", F.when(F.col("body").isNull(), "empty")
        ...                         .alias("error"))
        >>> query = consume_stream(spark, cfg, "audit", ["orders"], handle)  # doctest: +SKIP

    Returns:
        The started query; its checkpoint is ``_checkpoints/consumer_<group>``.
    """
    group = check_group(group)
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
            mode.append(f"{STREAM}-{stream_query_id(spark, checkpoint)}")
        _stream_batch(
            spark, cfg, group, chosen, handler, batch, (mode[0], log_id), batch_id, clock.now()
        )

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
) -> None:
    mode, log_id = commit
    view = consumer_columns(batch).persist()
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
            outcome = handler(view)
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
            errors = view.select("msg_id", F.lit(reason).alias("reason")).persist()
        failed = None if errors is None else view.join(errors, "msg_id")
        failed_rows = None if failed is None else failed.persist()
        try:
            failures = 0 if failed_rows is None else failed_rows.count()
            failed_per_table: dict[str, int] = {}
            if failed_rows is not None and failures:
                failed_per_table = {
                    r["table"]: r["count"] for r in failed_rows.groupBy("table").count().collect()
                }
            offsets = _offset_rows(
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
            rows = _commit_columns(rows, group, mode, batch_id, f"batch-{batch_id}", "", now)
            _append_commit(spark, cfg, rows, group, mode, batch_id)
            _forward(spark, cfg, group, mode, batch_id, log_id)
        finally:
            if failed_rows is not None:
                failed_rows.unpersist()
            if errors is not None:
                errors.unpersist()
    finally:
        view.unpersist()


# ---------------------------------------------------------------------- lag


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


def _lag_tables(spark: SparkSession, cfg: EngineConfig) -> dict[str, str] | None:
    lay = layout(cfg)
    if not _exists(spark, lay.consumer_log):
        return None
    present = set(list_topics(spark, cfg))
    log = spark.read.format("delta").load(lay.consumer_log)
    names = [
        r[0] for r in log.where(F.col("kind") == "offset").select("topic").distinct().collect()
    ]
    return {n: lay.topic(n) for n in names if n in present}


def lag(spark: SparkSession, cfg: EngineConfig, group: str | None = None) -> DataFrame:
    """Each group's lag per topic table: ``group_name``, ``topic``, ``committed_ts``,
    ``lag`` (delivered, not yet committed), ``newest_delivered_ts``.

    Raises:
        ConsumerError: when ``group`` names a group that never committed.
    """
    tables = _lag_tables(spark, cfg)
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
    if not _exists(spark, lay.consumer_log):
        return []
    log = spark.read.format("delta").load(lay.consumer_log)
    return sorted(r[0] for r in log.select("group_name").distinct().collect())


def groups_hint(spark: SparkSession, cfg: EngineConfig) -> str:
    """``"groups: a, b"`` or ``"no group has committed yet"``, for error messages."""
    known = groups(spark, cfg)
    return f"groups: {', '.join(known)}" if known else "no group has committed yet"


def register_lag_view(spark: SparkSession, cfg: EngineConfig) -> None:
    """Create or replace ``<database>.consumer_lag`` over the groups known now."""
    tables = _lag_tables(spark, cfg)
    if tables is None:
        return
    if not spark.catalog.databaseExists(cfg.database):
        spark.sql(f"CREATE DATABASE IF NOT EXISTS `{cfg.database}`")
    body = lag_sql(layout(cfg).consumer_log, tables)
    spark.sql(f"CREATE OR REPLACE VIEW `{cfg.database}`.`consumer_lag` AS {body}")
