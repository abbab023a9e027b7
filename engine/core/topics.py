"""Topic and group names: what a topic may be called, which names the engine keeps.

A topic name is a SQL identifier, so that its table can be named in SQL
(``SELECT * FROM delayq.orders``). The engine's own tables and views share the database, so
topics may not take their names, and ``retry_<group>`` / ``dlq_<group>`` belong to consumer
groups (RocketMQ's ``%RETRY%<group>`` and ``%DLQ%<group>``).

Example:
    >>> check_topic("orders")
    'orders'
    >>> retry_topic("Billing"), dlq_topic("Billing")
    ('retry_billing', 'dlq_billing')
"""

from __future__ import annotations

import re

from engine.core.errors import ConsumerError, InvalidMessageError

#: Topic names: a SQL identifier, so that the topic's table can be named in SQL.
TOPIC_CHARS = r"[A-Za-z_][A-Za-z0-9_]{0,127}"
#: The whole name, for Spark (Java) and pyarrow (RE2) alike: ``\z`` is the very end, where
#: ``$`` would also accept a name ending in a line break.
TOPIC_PATTERN = f"^{TOPIC_CHARS}\\z"
_TOPIC = re.compile(TOPIC_CHARS)
#: The engine's own tables, made when the engine or a producer first opens a lakehouse.
ENGINE_TABLES = ("commitlog", "schedule", "quarantine", "commands", "command_results")
#: Tables made on first use; registered by name when present.
OPTIONAL_TABLES = ("consumer_log", "recurring", "schedule_requests")
#: The engine's views.
ENGINE_VIEWS = (
    "delay_offset", "pending", "due_forecast", "consumer_lag", "schedules",
    "schedule_request_results",
)  # fmt: skip
#: A consumer group's retry and dead-letter topics (RocketMQ's %RETRY%<group>, %DLQ%<group>).
RETRY_PREFIX = "retry_"
DLQ_PREFIX = "dlq_"
RESERVED_TOPICS = frozenset({*ENGINE_TABLES, *OPTIONAL_TABLES, *ENGINE_VIEWS})


def check_topic(topic: object, internal: bool = False) -> str:
    """Return ``topic`` if it is a valid topic name, else raise naming it.

    Args:
        topic: the name to check.
        internal: allow the engine's own group topics (``retry_<group>``, ``dlq_<group>``).

    Raises:
        InvalidMessageError: when the name is missing, not an identifier, or reserved.

    Example:
        >>> check_topic("retry_billing", internal=True)
        'retry_billing'
    """
    if not isinstance(topic, str) or not topic:
        raise InvalidMessageError("topic", topic, "a topic is required")
    if not _TOPIC.fullmatch(topic):
        raise InvalidMessageError(
            "topic", topic, "must be letters, digits and _ (not starting with a digit), <= 128"
        )
    if topic.lower() in RESERVED_TOPICS:
        raise InvalidMessageError("topic", topic, "is the name of an engine table")
    if not internal and topic.lower().startswith((RETRY_PREFIX, DLQ_PREFIX)):
        raise InvalidMessageError(
            "topic", topic, f"{RETRY_PREFIX}* and {DLQ_PREFIX}* are consumer groups' topics"
        )
    return topic


def topic_table_name(topic: str) -> str:
    """The table name of a topic: its name in lower case (SQL names ignore case).

    Example:
        >>> topic_table_name("Orders")
        'orders'
    """
    return topic.lower()


def retry_topic(group: str) -> str:
    """The retry topic of consumer group ``group`` (RocketMQ's ``%RETRY%<group>``)."""
    return f"{RETRY_PREFIX}{group.lower()}"


def dlq_topic(group: str) -> str:
    """The dead-letter topic of consumer group ``group`` (RocketMQ's ``%DLQ%<group>``)."""
    return f"{DLQ_PREFIX}{group.lower()}"


def is_group_topic(name: str) -> bool:
    """Whether a topic table belongs to a consumer group (retry or dead letters)."""
    return name.lower().startswith((RETRY_PREFIX, DLQ_PREFIX))


def check_group(group: object) -> str:
    """Return ``group`` in lower case if it can name a consumer group, else raise naming it.

    Group names ignore case, like the topic tables named after them.

    Raises:
        ConsumerError: when the name is not an identifier (at most 122 characters).

    Example:
        >>> check_group("Billing")
        'billing'
    """
    if not isinstance(group, str):
        raise ConsumerError(f"consumer group {group!r}: expected a name")
    try:
        check_topic(retry_topic(group), internal=True)
    except InvalidMessageError:
        raise ConsumerError(
            f"consumer group {group!r}: use letters, digits and _ (at most 122)"
        ) from None
    return group.lower()


def member_group(group: str, member: str) -> str:
    """The group a broadcasting member commits as, ``<group>__<member>``: its own positions,
    retry topic and dead letters. Member names ignore case, as group names do, and may not
    hold ``__`` (``a`` + ``b__c`` would be ``a__b`` + ``c``).

    Raises:
        ConsumerError: when ``group`` or ``member`` cannot name a group, naming it.

    Example:
        >>> member_group("Billing", "host_a")
        'billing__host_a'
    """
    group = check_group(group)
    if not isinstance(member, str) or not member or "__" in member:
        raise ConsumerError(f"broadcasting member {member!r}: expected a name without __")
    try:
        return check_group(f"{group}__{member}")
    except ConsumerError:
        raise ConsumerError(
            f"broadcasting member {member!r} of group {group!r}: use letters, digits and _ "
            f"(group and member together at most 120)"
        ) from None
