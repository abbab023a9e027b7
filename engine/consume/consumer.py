"""Consumer groups: poll with long polling, ack and nack, retries with backoff, dead letters.

A group reads its topics' tables in delivery order (``delivery_round``, ``deliver_ts``,
``msg_id``: rounds are global, so several topics merge into one order) plus its retry topic
``retry_<group>``. Progress is a position per topic table, recorded in ``consumer_log``
(:mod:`engine.consume.commit_log`); failed messages go back as :mod:`engine.consume.retry`
says.

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

import re
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Self

from pyspark.sql import SparkSession

from engine.consume.commit_log import POLL
from engine.consume.filters import message_filter
from engine.consume.group_log import GroupLog
from engine.consume.retry import check_retry_delays, sendback_record
from engine.consume.subscription import known_topics
from engine.consume.topic_reader import TopicReader
from engine.core.clock import Clock, SystemClock, from_micros
from engine.core.config import EngineConfig, GroupConfig
from engine.core.errors import ConsumerConflictError, ConsumerError
from engine.core.message import PROP_ORIGIN_MESSAGE_ID, PROP_RECONSUME_TIME, PROP_RETRY_TOPIC
from engine.core.topics import RETRY_PREFIX, check_group, member_group, retry_topic
from engine.lakehouse.catalog.names import register_table
from engine.lakehouse.delta.delta_log import VersionTracker, table_id
from engine.lakehouse.delta.tables import ensure_consumer_log
from engine.lakehouse.storage.layout import layout

#: How often a waiting poll looks for a new commit of its tables (a file probe, no read).
WAKE_CHECK_SECONDS = 0.1


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
        receipt: for a message a :class:`~engine.control.simple_consumer.SimpleConsumer`
            received, the id of the copy that brings it back unless acknowledged.
        born_ts: when the producer made it (``None`` when it did not say).
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
    receipt: str = field(default="", compare=False)
    born_ts: datetime | None = field(default=None, compare=False)

    @property
    def position(self) -> tuple[int, int, str]:
        """Where it sits in its table: (delivery round, deliver time in µs, id)."""
        return (self.delivery_round, self._deliver_us, self.msg_id)


@dataclass
class _Table:
    """One subscribed topic table: where the group is, and the last version seen empty."""

    name: str
    tracker: VersionTracker
    reader: TopicReader
    position: tuple[int, int, str] | None = None
    empty_at: int | None = None
    filtered: bool = False  # the subscription's filter applies (not to the retry topic)
    skip_to: tuple[int, int, str] | None = None  # rows the filter passed over, up to here

    @property
    def path(self) -> str:
        """The table's path."""
        return self.tracker.path


class Consumer:
    """A member of a consumer group, reading with long polling.

    One consumer per group at a time commits; a second one that commits the same batch
    number gets :class:`~engine.core.errors.ConsumerConflictError` (its batch comes again).
    The constructor checks its arguments; :meth:`open` (called by the first :meth:`poll`,
    or by ``with``) checks the topics and restores the group's positions.

    Args:
        spark: a Delta-enabled session.
        cfg: engine configuration; ``cfg.group(group)`` gives the retry settings.
        group: the group name (letters, digits, _).
        topics: the topics to read; the group's retry topic is read as well.
        settings: retry settings for this group, instead of the configured ones.
        clock: the time for commits and send-backs (waiting uses real time).
        name: this consumer's name in ``consumer_log`` (default: a random one).
        tags: a tag expression, ``"TagA || TagB"`` (RocketMQ's ``subscribe(topic, expr)``):
            only messages with one of these tags; ``"*"`` or ``None``: all.
        where: a SQL92 condition over the messages' properties (RocketMQ's
            ``MessageSelector.bySql``), e.g. ``"region = 'eu' AND amount > 100"``
            (:mod:`engine.consume.filters`). Both filters apply to the subscribed topics, not
            to the group's retry topic; the messages they leave out count as consumed once
            the group commits a poll after them.
        broadcast: RocketMQ's broadcasting mode: every member gets every message. The
            member keeps its own positions, retries and dead letters as group
            ``<group>__<name>`` (``delayq lag`` lists it); ``name`` is required and must stay
            the same across restarts, or the member starts over as a new one. Without it
            (clustering mode) the members of a group share its messages.

    Raises:
        ConsumerError: when the group name, the tag expression or the condition is not
            valid (naming it).
        ConfigError: when a retry delay is longer than ``messages.max_delay``.
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
        tags: str | None = None,
        where: str | None = None,
        broadcast: bool = False,
    ) -> None:
        self.spark = spark
        self.filter = message_filter(tags, where)  # a bad expression fails here
        self.cfg = cfg
        if broadcast and not name:
            raise ConsumerError(
                f"broadcasting in group {group!r} needs name=: each member keeps its own "
                "positions under its name, which must stay the same across restarts"
            )
        base = check_group(group)
        self.group = member_group(base, name or "") if broadcast else base
        self.settings = settings or cfg.group(base)
        check_retry_delays(cfg, base, self.settings)
        self.clock = clock or SystemClock()
        self.name = name or f"consumer-{uuid.uuid4().hex[:8]}"
        self.topics = list(topics)
        self.tables: dict[str, _Table] = {}
        self._log = GroupLog(cfg, self.group, POLL)
        self._log_id = ""
        self._batch: list[Received] = []
        self._commit_id = ""
        self._settled: dict[str, str | None] = {}  # msg_id -> None (ack) or the reason
        self._delays: dict[str, int] = {}  # msg_id -> ms, for a nack with its own delay
        self._closed = threading.Event()
        self._opened = False
        self.seq = -1
        self._unforwarded: int | None = None
        self._sendbacks: list[dict[str, Any]] | None = None  # the last commit's, if known

    def open(self) -> Self:
        """Check the topics, restore the group's positions, forward what a crash left.

        Returns:
            ``self``.

        Raises:
            ConsumerError: when a topic is unknown (nothing was ever sent to it).
        """
        if self._opened:
            return self
        names = [*known_topics(self.spark, self.cfg, self.topics), retry_topic(self.group)]
        retry = retry_topic(self.group)
        self.tables = {n: self._table(n, n != retry) for n in dict.fromkeys(names)}
        for table in self.tables.values():
            table.tracker.latest()
        log_path = ensure_consumer_log(self.spark, self.cfg)
        self._log_id = table_id(self.spark, log_path)
        if self.cfg.register_tables:
            register_table(self.spark, self.cfg, "consumer_log", log_path)
        self.seq, self._unforwarded = self._restore()
        self._opened = True
        self._forward_pending()
        return self

    def _table(self, name: str, filtered: bool) -> _Table:
        path = layout(self.cfg).topic(name)
        reader = TopicReader(path)
        filtered = filtered and self.filter is not None
        return _Table(name, VersionTracker(path), reader, filtered=filtered)

    # ---------------------------------------------------------------- state

    def _restore(self) -> tuple[int, int | None]:
        """The group's last commit number and positions, from ``consumer_log`` (the commits
        made since the last look, read with Arrow)."""
        self._log.refresh()
        for name, position in self._log.positions.items():
            table = self.tables.get(name)
            if table is not None:
                table.position = position
        for table in self.tables.values():
            table.empty_at = None  # positions may have moved
            table.skip_to = None
        # The latest commit's send-backs may not have reached commitlog (a crash).
        seq = self._log.seq
        self._sendbacks = None
        return seq, (seq if seq >= 0 else None)

    def _catch_up(self) -> None:
        """Take the positions another consumer of the group committed since (a file probe
        when nothing changed)."""
        if self._log.latest() != self._log.version:
            seq = self.seq
            self.seq, unforwarded = self._restore()
            if self.seq != seq:  # another member committed: forward, should it have crashed
                self._unforwarded = unforwarded
            self._forward_pending()

    def positions(self) -> dict[str, tuple[int, int, str] | None]:
        """The committed position in each subscribed table."""
        self.open()
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
        self.open()
        self._forward_pending()
        deadline = time.monotonic() + wait
        while True:
            self._catch_up()
            batch = self._read(max_messages)
            if batch:
                self._batch = batch
                self._settled, self._delays = {}, {}
                self._commit_id = uuid.uuid4().hex  # the same if commit() is retried
                return list(batch)
            if not self._wait_for_commit(deadline):
                return []

    def _wait_for_commit(self, deadline: float) -> bool:
        """Wait until a table has a version not yet read empty; False at the deadline."""
        while not self._closed.is_set():
            for table in self.tables.values():
                version = table.tracker.latest()
                if version >= 0 and table.empty_at != version:
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._closed.wait(min(WAKE_CHECK_SECONDS, remaining))
        return False

    def _read(self, limit: int) -> list[Received]:
        found: list[Received] = []
        for table in self.tables.values():
            version = table.tracker.latest()
            if version < 0 or table.empty_at == version:
                continue
            # Rows of `version` or later: recording it as read-empty is safe, a later
            # commit is still seen as new.
            probed = version
            where = self.filter if table.filtered else None
            rows = table.reader.read(version, table.position, limit, where).to_pylist()
            table.skip_to = None
            if where is not None and len(rows) < limit:
                # every match of this version is in `rows`: the rest up to the version's
                # last row are filtered out, consumed once a commit passes them
                table.skip_to = table.reader.last(version, table.position)
            if not rows:
                table.empty_at = probed
            found.extend(_received(r, table.name) for r in rows)
        found.sort(key=lambda m: m.position)
        for dropped in found[limit:]:  # not in this batch: nothing after them is skipped
            self.tables[dropped.table].skip_to = None
        return found[:limit]

    def _skipped(self) -> dict[str, tuple[int, int, str]]:
        """Tables whose filter passed over rows beyond the committed position."""
        return {
            name: t.skip_to
            for name, t in self.tables.items()
            if t.skip_to is not None and (t.position is None or t.skip_to > t.position)
        }

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

    def nack(
        self, message: Received | str, reason: str = "failed", *, delay: float | None = None
    ) -> None:
        """Mark a message of the current batch as failed: it comes back later (or dies).

        Nothing is sent until :meth:`commit`; a crash before it means the message is
        polled again, not retried twice.

        Args:
            message: a message of the current batch, or its id.
            reason: why (kept in its failure history, and ``DLQ_REASON`` if it dies).
            delay: come back after this many seconds instead of the group's retry delay (as
                RocketMQ's ``setDelayLevelWhenNextConsume``); a message past
                ``max_reconsume_times`` then reaches the dead letters after it too.

        Raises:
            ConsumerError: the message is not in the batch, or ``delay`` is not a number of
                seconds within ``messages.max_delay``.
        """
        msg_id = self._in_batch(message)
        if delay is not None:
            if isinstance(delay, bool) or not isinstance(delay, int | float):
                raise ConsumerError(f"delay={delay!r}: expected seconds")
            if not 0 <= delay * 1000 <= self.cfg.max_delay_ms:
                raise ConsumerError(
                    f"delay={delay!r}: must be 0 to messages.max_delay "
                    f"({self.cfg.max_delay_ms // 1000} s)"
                )
            self._delays[msg_id] = round(delay * 1000)
        else:
            self._delays.pop(msg_id, None)
        self._settled[msg_id] = str(reason)

    def commit(self) -> int:
        """Commit the current batch: positions, and the failed messages sent back.

        Returns:
            How many failed messages were sent back (to retry or dead letters).

        Raises:
            ConsumerError: when a message of the batch was neither acked nor nacked.
            ConsumerConflictError: when another consumer of the group committed first.
        """
        self._forward_pending()
        skipped = self._skipped()
        if not self._batch and not skipped:
            return 0
        if not self._batch:
            self._commit_id = uuid.uuid4().hex  # only filtered-out rows to pass
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
        ends = {t: m.position for t, m in last.items()}
        for t, skip in skipped.items():
            ends[t] = max(ends.get(t, skip), skip)
        head = {
            "group_name": self.group, "mode": POLL, "commit_seq": seq, "commit_id": commit_id,
            "consumer": self.name, "committed_ts": now,
        }  # fmt: skip
        rows = [
            dict(head, kind="offset", topic=t, delivery_round=end[0],
                 deliver_ts=from_micros(end[1]), msg_id=end[2], acked=acked.get(t, 0))
            for t, end in sorted(ends.items())
        ]  # fmt: skip
        sendbacks = []
        for m in self._batch:
            reason = self._settled[m.msg_id]
            if reason is None:
                continue
            kind, back = sendback_record(self._failed(m, reason), self.group, self.settings, now)
            sendbacks.append(back)
            rows.append(
                dict(head, kind=kind, topic=m.table, delivery_round=m.delivery_round,
                     deliver_ts=m.deliver_ts, msg_id=m.msg_id, reason=reason, sendback=back)
            )  # fmt: skip
        written = self._log.append(rows, seq, f"delayq {POLL} consumer {self.group} commit {seq}")
        self._check_committed(seq, commit_id)
        self.seq = seq
        for table, end in ends.items():
            self.tables[table].position = end
            self.tables[table].skip_to = None
            reader = self.tables[table].reader
            reader.forget_before(reader.files.version, end)
        self._batch, self._settled, self._delays = [], {}, {}
        # A commit this call did not write (a retried commit() whose append had landed) is
        # forwarded as recorded.
        self._unforwarded, self._sendbacks = seq, (sendbacks if written else None)
        count = self._forward_pending()
        if self._log.seq > seq:
            # Other members committed after this one (the check read them): take their
            # positions, and forward the latest, should its member have crashed (after this
            # one's: a send-back's txn version only goes up).
            self.seq, self._unforwarded = self._restore()
            self._forward_pending()
        return count

    def _failed(self, m: Received, reason: str) -> dict[str, Any]:
        """A failed message as :func:`~engine.consume.retry.sendback_record` takes it."""
        return {
            "msg_id": m.msg_id, "keys": list(m.keys), "tags": m.tags,
            "properties": dict(m.properties), "body": m.body, "born_ts": m.born_ts,
            "real_topic": m.topic, "reconsume_times": m.reconsume_times,
            "origin_msg_id": m.origin_msg_id, "reason": reason,
            "delay_ms": self._delays.get(m.msg_id),
        }  # fmt: skip

    def _check_committed(self, seq: int, commit_id: str) -> None:
        self._log.refresh()
        if self._log.commit_id(seq) != commit_id:
            self._batch, self._settled, self._delays = [], {}, {}
            self.seq, self._unforwarded = self._restore()
            self._forward_pending()
            raise ConsumerConflictError(
                f"another consumer of group {self.group!r} committed batch {seq} first: "
                "this batch was not committed; poll again"
            )

    def _forward_pending(self) -> int:
        if self._unforwarded is None:
            return 0
        count = self._log.forward(self._unforwarded, self._log_id, self._sendbacks)
        self._unforwarded, self._sendbacks = None, None
        return count

    def abandon(self) -> None:
        """Drop the current batch without committing it: its messages come again (after a
        failed :meth:`commit`, say). The group's committed positions are read again."""
        self._batch, self._settled, self._delays = [], {}, {}
        self.seq, self._unforwarded = self._restore()
        self._forward_pending()

    def close(self) -> None:
        """Stop waiting (a poll in progress returns ``[]``). Uncommitted messages come again."""
        self._closed.set()

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _received(row: dict[str, Any], table: str) -> Received:
    """A topic row (as :class:`TopicReader` reads it) as the consumer gets it: the real topic,
    reconsume count and original id come from the engine's properties in a retry table."""
    props = dict(row["properties"] or [])
    retried = table.startswith(RETRY_PREFIX)  # elsewhere these are a producer's properties
    real_topic = props.get(PROP_RETRY_TOPIC) if retried else None
    origin = props.get(PROP_ORIGIN_MESSAGE_ID)
    return Received(
        msg_id=str(row["msg_id"]),
        topic=str(row["topic"] if real_topic is None else real_topic),
        body=bytes(row["body"] or b""),
        keys=tuple(row["keys"] or ()),
        tags=row["tags"],
        properties=props,
        reconsume_times=_whole(props.get(PROP_RECONSUME_TIME)) if retried else 0,
        origin_msg_id=str(row["msg_id"] if origin is None else origin),
        deliver_ts=from_micros(int(row["deliver_us"])),
        delivered_ts=row["delivered_ts"] or from_micros(0),
        table=table,
        delivery_round=int(row["delivery_round"]),
        _deliver_us=int(row["deliver_us"]),
        born_ts=row.get("born_ts"),
    )


def _whole(text: str | None) -> int:
    """A property as a whole number, 0 when missing or not a 32-bit one (as Spark's
    ``try_cast("int")`` then ``coalesce(..., 0)`` read it)."""
    found = _INT.fullmatch(text or "")
    value = int(found.group(1)) if found else 0
    return value if -(2**31) <= value < 2**31 else 0


_INT = re.compile(r"\s*([+-]?[0-9]+)\s*", re.ASCII)
