"""Kafka header names the engine reads and writes, and the headers that ask for a delay.

The ingest job (:mod:`engine.produce.kafka_ingest`) reads a record's delay from one header,
named as in RocketMQ where RocketMQ has one:

| header              | value (UTF-8 text)                | meaning                               |
|---------------------|-----------------------------------|---------------------------------------|
| ``DELAY``           | a whole number                    | delay level (RocketMQ's ``DELAY``)    |
| ``TIMER_DELIVER_MS``| ms since the epoch                | deliver at this time (RocketMQ 5)     |
| ``TIMER_DELAY_SEC`` | whole seconds                     | deliver this long after it is stored  |
| ``TIMER_DELAY_MS``  | whole milliseconds                | the same, in ms                       |
| ``REAL_TOPIC``      | a topic name                      | the topic to deliver to (1)           |
| ``KEYS``            | keys separated by spaces          | more lookup keys (RocketMQ's ``KEYS``)|
| ``TAGS``            | a tag                             | the message tag (RocketMQ's ``TAGS``) |
| ``UNIQ_KEY``        | the message's own id              | ``msg_id`` (2)                        |

(1) Without it, ``kafka.topic_map`` names the real topic. No delay header: delivered at
once. (2) RocketMQ's client-side message id: a record sent twice with the same one (a
producer's retry) is delivered once, within ``messages.dedup_window``; without it the id is
made from the record's topic, partition, offset and timestamp (a replayed Kafka batch is
stored once). Other headers become properties.

Delivered to Kafka (:mod:`engine.deliver.kafka_sink`), a message carries its properties as
headers, plus ``DELAYQ_MSG_ID``, ``DELAYQ_DELIVER_TS`` (ms) and ``TAGS``.

Example:
    >>> delay_headers(topic="orders", delay_level=3)
    [('REAL_TOPIC', b'orders'), ('DELAY', b'3')]
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from engine.core.clock import to_millis
from engine.core.errors import ConfigError, InvalidMessageError
from engine.core.levels import parse_duration_ms

HEADER_LEVEL = "DELAY"
HEADER_DELIVER_MS = "TIMER_DELIVER_MS"
HEADER_DELAY_SEC = "TIMER_DELAY_SEC"
HEADER_DELAY_MS = "TIMER_DELAY_MS"
HEADER_REAL_TOPIC = "REAL_TOPIC"
HEADER_KEYS = "KEYS"
HEADER_TAGS = "TAGS"
HEADER_UNIQ_KEY = "UNIQ_KEY"
#: Headers the engine interprets; every other header is kept as a property.
SPECIAL_HEADERS = (
    HEADER_LEVEL,
    HEADER_DELIVER_MS,
    HEADER_DELAY_SEC,
    HEADER_DELAY_MS,
    HEADER_REAL_TOPIC,
    HEADER_KEYS,
    HEADER_TAGS,
    HEADER_UNIQ_KEY,
)
TIMING_HEADERS = (HEADER_LEVEL, HEADER_DELIVER_MS, HEADER_DELAY_SEC, HEADER_DELAY_MS)
#: Set on messages the engine delivers to Kafka.
HEADER_MSG_ID = "DELAYQ_MSG_ID"
HEADER_DELIVER_TS = "DELAYQ_DELIVER_TS"


def delay_headers(
    *,
    topic: str | None = None,
    delay_level: int | None = None,
    deliver_at: datetime | int | None = None,
    delay: timedelta | str | int | None = None,
    keys: str | list[str] | None = None,
    tags: str | None = None,
    properties: Mapping[str, str] | None = None,
    msg_id: str | None = None,
) -> list[tuple[str, bytes]]:
    """Kafka headers asking the engine to deliver a record later.

    Args:
        topic: the real topic (``REAL_TOPIC``); without it the ingest job's
            ``kafka.topic_map`` decides.
        delay_level: a RocketMQ delay level (``DELAY``).
        deliver_at: an aware ``datetime`` or ms since the epoch (``TIMER_DELIVER_MS``).
        delay: a ``timedelta``, ``"90s"``-style text, or whole ms (``TIMER_DELAY_MS``).
        keys: extra lookup keys (``KEYS``).
        tags: the tag (``TAGS``).
        properties: more headers, kept as properties.
        msg_id: the message's own id (``UNIQ_KEY``): a record sent again with it is
            delivered once.

    Raises:
        InvalidMessageError: when more than one delay is given or a value is bad.
    """
    given = [n for n, v in (("delay_level", delay_level), ("deliver_at", deliver_at),
                            ("delay", delay)) if v is not None]  # fmt: skip
    if len(given) > 1:
        raise InvalidMessageError(given[1], locals()[given[1]], f"give only one of {given}")
    headers: list[tuple[str, str]] = []
    if topic is not None:
        headers.append((HEADER_REAL_TOPIC, topic))
    if delay_level is not None:
        if isinstance(delay_level, bool) or not isinstance(delay_level, int):
            raise InvalidMessageError("delay_level", delay_level, "must be a whole number")
        headers.append((HEADER_LEVEL, str(delay_level)))
    if deliver_at is not None:
        ms = to_millis(deliver_at) if isinstance(deliver_at, datetime) else int(deliver_at)
        headers.append((HEADER_DELIVER_MS, str(ms)))
    if delay is not None:
        headers.append((HEADER_DELAY_MS, str(_delay_ms(delay))))
    if keys:
        headers.append((HEADER_KEYS, keys if isinstance(keys, str) else " ".join(keys)))
    if tags is not None:
        headers.append((HEADER_TAGS, tags))
    if msg_id is not None:
        headers.append((HEADER_UNIQ_KEY, msg_id))
    for name, value in (properties or {}).items():
        headers.append((name, value))
    return [(name, value.encode("utf-8")) for name, value in headers]


def _delay_ms(delay: timedelta | str | int) -> int:
    if isinstance(delay, timedelta):
        return int(delay.total_seconds() * 1000)
    if isinstance(delay, int) and not isinstance(delay, bool):
        return delay
    try:
        return parse_duration_ms(str(delay), "delay")
    except ConfigError:
        raise InvalidMessageError("delay", delay, "expected e.g. '90s', '15m', '2d'") from None
