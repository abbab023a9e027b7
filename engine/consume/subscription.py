"""What a consumer group may subscribe to: topics that have a table or were sent to.

Example:
    >>> known_topics(spark, cfg, ["Orders"])  # doctest: +SKIP
    ['orders']
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.core.config import EngineConfig
from engine.core.errors import ConsumerError, InvalidMessageError
from engine.core.topics import check_topic, is_group_topic, topic_table_name
from engine.lakehouse.delta.delta_log import list_topics, table_exists
from engine.lakehouse.storage.layout import layout


def known_topics(spark: SparkSession, cfg: EngineConfig, topics: Sequence[str]) -> list[str]:
    """Check subscribed topic names: each must have a table or a message sent to it.

    Raises:
        ConsumerError: naming the unknown topic and listing the known ones.
    """
    if not topics:
        raise ConsumerError("subscribe to at least one topic")
    tables = set(list_topics(cfg))
    checked = []
    for topic in topics:
        try:
            check_topic(topic)
        except InvalidMessageError as err:
            raise ConsumerError(f"cannot consume topic {topic!r}: {err}") from None
        name = topic_table_name(topic)
        if name not in tables and not _ever_sent(spark, cfg, name):
            shown = ", ".join(sorted(t for t in tables if not is_group_topic(t)))
            raise ConsumerError(
                f"unknown topic {topic!r}: nothing was sent to it (topics: {shown or 'none'})"
            )
        checked.append(name)
    return checked


def _ever_sent(spark: SparkSession, cfg: EngineConfig, name: str) -> bool:
    path = layout(cfg).commitlog
    if not table_exists(path):
        return False
    sent = spark.read.format("delta").load(path).where(F.lower("topic") == name)
    return not sent.limit(1).isEmpty()
