"""Send delayed messages through Kafka with kafka-python, and the header names the engine reads.

The ingest job (``jobs/kafka_ingest.py``) reads Kafka records into ``commitlog``. A record's
value is the body and its key the first key. Its delay comes from one header, named as in
RocketMQ where RocketMQ has one:

| header              | value (UTF-8 text)                | meaning                               |
|---------------------|-----------------------------------|---------------------------------------|
| ``DELAY``           | a whole number                    | delay level (RocketMQ's ``DELAY``)    |
| ``TIMER_DELIVER_MS``| ms since the epoch                | deliver at this time (RocketMQ 5)     |
| ``TIMER_DELAY_SEC`` | whole seconds                     | deliver this long after it is stored  |
| ``TIMER_DELAY_MS``  | whole milliseconds                | the same, in ms                       |
| ``REAL_TOPIC``      | a topic name                      | the topic to deliver to (1)           |
| ``KEYS``            | keys separated by spaces          | more lookup keys (RocketMQ's ``KEYS``)|
| ``TAGS``            | a tag                             | the message tag (RocketMQ's ``TAGS``) |

(1) Without it, ``kafka.topic_map`` names the real topic. No delay header: delivered at
once. Other headers become properties. Delivered to Kafka, a message carries its properties
as headers, plus ``DELAYQ_MSG_ID``, ``DELAYQ_DELIVER_TS`` (ms) and ``TAGS``.

Example:
    >>> producer = DelayedProducer("127.0.0.1:9092")  # doctest: +SKIP
    >>> producer.send("delayq_in", b"remind", topic="orders", delay="15m", key="order-7")
    >>> producer.send("delayq_in", b"close", topic="orders", deliver_at=1767268800000)
    >>> producer.flush()
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from engine.clock import to_millis
from engine.errors import InvalidMessageError

HEADER_LEVEL = "DELAY"
HEADER_DELIVER_MS = "TIMER_DELIVER_MS"
HEADER_DELAY_SEC = "TIMER_DELAY_SEC"
HEADER_DELAY_MS = "TIMER_DELAY_MS"
HEADER_REAL_TOPIC = "REAL_TOPIC"
HEADER_KEYS = "KEYS"
HEADER_TAGS = "TAGS"
#: Headers the engine interprets; every other header is kept as a property.
SPECIAL_HEADERS = (
    HEADER_LEVEL,
    HEADER_DELIVER_MS,
    HEADER_DELAY_SEC,
    HEADER_DELAY_MS,
    HEADER_REAL_TOPIC,
    HEADER_KEYS,
    HEADER_TAGS,
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
    for name, value in (properties or {}).items():
        headers.append((name, value))
    return [(name, value.encode("utf-8")) for name, value in headers]


def _delay_ms(delay: timedelta | str | int) -> int:
    from engine.errors import ConfigError
    from engine.levels import parse_duration_ms

    if isinstance(delay, timedelta):
        return int(delay.total_seconds() * 1000)
    if isinstance(delay, int) and not isinstance(delay, bool):
        return delay
    try:
        return parse_duration_ms(str(delay), "delay")
    except ConfigError:
        raise InvalidMessageError("delay", delay, "expected e.g. '90s', '15m', '2d'") from None


class DelayedProducer:
    """A kafka-python producer (idempotent, ``acks=all``) that sets the delay headers.

    Args:
        bootstrap_servers: the Kafka brokers.
        **config: more ``KafkaProducer`` settings.
    """

    def __init__(self, bootstrap_servers: str, **config: Any) -> None:
        from kafka import KafkaProducer

        settings: dict[str, Any] = {"acks": "all", "enable_idempotence": True, **config}
        self._producer = KafkaProducer(bootstrap_servers=bootstrap_servers, **settings)

    def send(
        self,
        kafka_topic: str,
        value: bytes | str,
        *,
        key: bytes | str | None = None,
        topic: str | None = None,
        delay_level: int | None = None,
        deliver_at: datetime | int | None = None,
        delay: timedelta | str | int | None = None,
        keys: str | list[str] | None = None,
        tags: str | None = None,
        properties: Mapping[str, str] | None = None,
    ) -> Any:
        """Send one record to ``kafka_topic`` (the ingest job's topic); returns its future.

        ``topic`` is the real topic the engine delivers to; the delay arguments are those of
        :func:`delay_headers`.
        """
        headers = delay_headers(
            topic=topic, delay_level=delay_level, deliver_at=deliver_at, delay=delay,
            keys=keys, tags=tags, properties=properties,
        )  # fmt: skip
        raw_key = key.encode("utf-8") if isinstance(key, str) else key
        body = value.encode("utf-8") if isinstance(value, str) else value
        return self._producer.send(kafka_topic, value=body, key=raw_key, headers=headers)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every record sent is acknowledged."""
        self._producer.flush(timeout)

    def close(self) -> None:
        """Flush and close the producer."""
        self._producer.close()

    def __enter__(self) -> DelayedProducer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
