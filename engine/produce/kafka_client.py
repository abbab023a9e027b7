"""Send delayed messages through Kafka with kafka-python.

The ingest job (``jobs/kafka_ingest.py``) reads Kafka records into ``commitlog``. A record's
value is the body and its key the first key; its delay and real topic come from headers
(see :mod:`engine.core.kafka_headers`, which this producer sets).

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

from engine.core.kafka_headers import delay_headers

__all__ = ["DelayedProducer", "delay_headers"]


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
