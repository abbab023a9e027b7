"""Receive with invisibility, as RocketMQ 5's ``SimpleConsumer``: receive, ack, change the
invisible time.

``receive(max, invisible=30)`` hands out messages and, in the same commit that moves the
group past them, schedules a copy of each to come back (to ``retry_<group>``, with
``RECONSUME_TIME`` + 1; to ``dlq_<group>`` once ``max_reconsume_times`` is reached) when
its invisible time is over. ``ack`` cancels that copy; ``change_invisible`` reschedules it.
The engine's delay queue keeps the time (as RocketMQ's revive service does with its
checkpoints), so a message nobody acknowledges is back after ``invisible`` seconds, and a
consumer that crashes loses nothing. Members of a group may receive at the same time: a
batch is handed out only once its commit wins (a member that loses the race reads on from
the winner's position), so no message goes to two members at once.

Example:
    >>> simple = SimpleConsumer(spark, cfg, "billing", ["orders"], invisible=30)  # doctest: +SKIP
    >>> for m in simple.receive(max_messages=16):  # doctest: +SKIP
    ...     if handle(m.body):
    ...         simple.ack(m)
    ...     else:
    ...         simple.change_invisible(m, 60)   # try again in a minute
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace

from pyspark.sql import SparkSession

from engine.consume.consumer import Consumer, Received
from engine.consume.retry import sendback_id
from engine.control.commands import DEFAULT_WAIT_S, cancel_many, reschedule_many
from engine.core.clock import Clock, SystemClock
from engine.core.config import EngineConfig, GroupConfig
from engine.core.errors import ConsumerConflictError, ConsumerError
from engine.core.topics import dlq_topic, retry_topic

DEFAULT_INVISIBLE_S = 30.0
#: The invisible time counts from the receiving commit: shorter ones could be over before
#: ``receive`` has returned.
MIN_INVISIBLE_S = 1.0
#: Reason recorded in a copy's failure history (and ``DLQ_REASON``).
NOT_ACKED = "not acknowledged within {seconds:g} s"
RACE_RETRIES = 5


class SimpleConsumer:
    """A member of a consumer group that receives with an invisible time.

    Args:
        spark: a Delta-enabled session.
        cfg: engine configuration.
        group: the group name.
        topics: the topics to read (the group's retry topic is read as well).
        invisible: seconds a received message stays hidden unless acknowledged.
        settings: the group's retry settings (``max_reconsume_times``).
        clock: the time of commits and of the copies' deliver times.
        tags: a tag expression (see :class:`~engine.consume.consumer.Consumer`).
        where: a SQL92 property condition.
        name: this member's name in ``consumer_log`` and ``delayq lag --members``.

    Raises:
        ConsumerError: a bad group name, filter or invisible time.
    """

    def __init__(
        self,
        spark: SparkSession,
        cfg: EngineConfig,
        group: str,
        topics: Sequence[str],
        *,
        invisible: float = DEFAULT_INVISIBLE_S,
        settings: GroupConfig | None = None,
        clock: Clock | None = None,
        tags: str | None = None,
        where: str | None = None,
        name: str | None = None,
    ) -> None:
        self.consumer = Consumer(
            spark, cfg, group, topics, settings=settings, clock=clock, tags=tags, where=where,
            name=name,
        )  # fmt: skip
        self.spark = spark
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.invisible = self._seconds(invisible, "invisible")

    def _seconds(self, value: float, name: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConsumerError(f"{name}={value!r}: expected seconds")
        if not MIN_INVISIBLE_S <= value <= self.cfg.max_delay_ms / 1000:
            raise ConsumerError(
                f"{name}={value!r}: must be at least {MIN_INVISIBLE_S:g} s and at most "
                f"messages.max_delay ({self.cfg.max_delay_ms // 1000} s)"
            )
        return float(value)

    def receive(
        self, max_messages: int = 32, invisible: float | None = None, timeout: float | None = None
    ) -> list[Received]:
        """Up to ``max_messages`` messages, hidden for ``invisible`` seconds (default: the
        consumer's) unless acknowledged; waits up to ``timeout`` (as :meth:`Consumer.poll`).

        Each message carries its ``receipt``: the id of the copy that brings it back.

        Raises:
            ConsumerError: a bad argument.
        """
        seconds = self.invisible if invisible is None else self._seconds(invisible, "invisible")
        for _ in range(RACE_RETRIES):
            batch = self.consumer.poll(max_messages, timeout)
            if not batch:
                return []
            reason = NOT_ACKED.format(seconds=seconds)
            for m in batch:
                self.consumer.nack(m, reason, delay=seconds)
            try:
                self._commit()
            except ConsumerConflictError:
                continue  # another member took these: read on from its position
            return [replace(m, receipt=self.receipt(m)) for m in batch]
        return []

    def _commit(self) -> None:
        """Commit the received batch; if that fails, drop the batch (its messages come
        again, or, had the commit landed, the group's positions show it) and raise."""
        try:
            self.consumer.commit()
        except ConsumerConflictError:
            raise
        except Exception:
            with contextlib.suppress(Exception):
                self.consumer.abandon()
            raise

    def receipt(self, message: Received) -> str:
        """The id of the copy of ``message`` that comes back unless it is acknowledged (as
        :func:`~engine.consume.retry.sendback_rows` names it)."""
        group = self.consumer.group
        attempt = message.reconsume_times
        dead = attempt >= self.consumer.settings.max_reconsume_times
        target = dlq_topic(group) if dead else retry_topic(group)
        return sendback_id(group, message.msg_id, attempt, target)

    def ack(self, *messages: Received, wait: float = DEFAULT_WAIT_S) -> list[str]:
        """Acknowledge received messages: they do not come back.

        Returns:
            One status per message: ``cancelled`` (acknowledged), ``already_delivered``
            (its invisible time was over: it came back, and will be received again),
            ``already_cancelled`` (acknowledged before), ``not_found`` (not a receipt of
            this lakehouse), or ``pending`` (no engine answered within ``wait``; applied
            when one runs).
        """
        if not messages:
            return []
        receipts = [self._receipt(m) for m in messages]
        results = cancel_many(self.spark, self.cfg, receipts, wait=wait, clock=self.clock)
        return [r.status for r in results]

    def change_invisible(
        self, message: Received, invisible: float, wait: float = DEFAULT_WAIT_S
    ) -> str:
        """Hide a received message for ``invisible`` seconds from now instead.

        Returns:
            ``rescheduled``, ``already_delivered`` (too late: it came back),
            ``already_cancelled`` (acknowledged before) or ``pending``.
        """
        seconds = self._seconds(invisible, "invisible")
        moves = [(self._receipt(message), None, f"{round(seconds * 1000)}ms")]
        (result,) = reschedule_many(self.spark, self.cfg, moves, wait=wait, clock=self.clock)
        return result.status

    def _receipt(self, message: Received) -> str:
        if not message.receipt:
            raise ConsumerError(f"message {message.msg_id} was not received by a SimpleConsumer")
        return message.receipt

    def close(self) -> None:
        """Stop waiting in :meth:`receive`."""
        self.consumer.close()
