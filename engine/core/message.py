"""The message model: what a producer sends, how it is checked, and the engine's own names.

:class:`Message` is what a producer sends. :func:`validate` checks one in Python (at send
time, naming the bad field and value); :func:`rejection_reason` is the same rules as a Spark
column, for rows that reach ``commitlog`` another way (a DataFrame send, a SQL ``INSERT``):
stamping quarantines those with the reason. The ``PROP_*`` names are the properties the engine
sets itself (RocketMQ's names where it has one); producers may not forge them.

Example:
    >>> from engine.core.config import EngineConfig
    >>> validate(Message("orders", "paid", delay_level=3), EngineConfig())["delay_level"]
    3
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql import Column
from pyspark.sql import functions as F

from engine.core.clock import SystemClock, from_millis, truncate_ms
from engine.core.config import EngineConfig
from engine.core.errors import ConfigError, InvalidMessageError
from engine.core.levels import parse_duration_ms
from engine.core.topics import RESERVED_TOPICS, TOPIC_PATTERN, check_topic

#: Properties the engine sets on a message it sends back (RocketMQ's names where it has one).
#: How a duplicate's quarantine reason starts (``history`` calls such rows ``duplicate``).
DUPLICATE = "duplicate: "
PROP_RETRY_TOPIC = "RETRY_TOPIC"
PROP_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
PROP_RECONSUME_TIME = "RECONSUME_TIME"
PROP_DLQ_REASON = "DLQ_REASON"
#: JSON list of the message's failures: ``{"group", "attempt", "reason", "at"}``.
PROP_FAILURES = "DELAYQ_FAILURES"
#: Set on a message resent from the dead letters: the dead letter it came from.
PROP_DLQ_MSG_ID = "DLQ_MSG_ID"
#: A delivery window (milliseconds, as text): the message may go any time in this long
#: after its deliver time, and stamping spreads such messages over their windows
#: (EventBridge's flexible time window). Producers set it (``Message(window=...)``, ``delayq
#: send --window``, or the property itself from SQL or a Kafka header).
PROP_WINDOW = "DELAYQ_WINDOW_MS"
#: The longest delivery window, in milliseconds (one day).
MAX_WINDOW_MS = 86_400_000
#: What a valid window property holds (checked against :data:`MAX_WINDOW_MS` too).
WINDOW_CHARS = "[1-9][0-9]{0,7}"
#: Why a row's window property is refused (after the property's value).
WINDOW_REFUSED = f"' is not a whole number of milliseconds from 1 to {MAX_WINDOW_MS}"
ENGINE_PROPERTIES = (
    PROP_RETRY_TOPIC,
    PROP_ORIGIN_MESSAGE_ID,
    PROP_RECONSUME_TIME,
    PROP_DLQ_REASON,
    PROP_FAILURES,
)
#: Property names a producer may not set: the engine's own (a forged ``RECONSUME_TIME`` would
#: shorten a message's retries). The engine sets them itself when it sends messages back.
RESERVED_PROPERTIES = frozenset((*ENGINE_PROPERTIES, PROP_DLQ_MSG_ID))
#: What a user property name may hold (no ``=``, which ``--property NAME=VALUE`` splits on,
#: no spaces or control characters): the whole name, in Python (``fullmatch``) and in Spark
#: (``rlike``, whose ``$`` would also accept a name ending in a line break).
PROPERTY_NAME_CHARS = "[A-Za-z0-9_.:-]+"
#: A message id a producer gives (its idempotency key): these characters, 1 to 128 of them.
MSG_ID_CHARS = PROPERTY_NAME_CHARS
MAX_MSG_ID = 128
FAILURES_TYPE = "array<struct<group:string,attempt:int,reason:string,at:string>>"
#: The fields a message given as a mapping may have.
MESSAGE_FIELDS = frozenset(
    {
        "topic",
        "body",
        "keys",
        "tags",
        "properties",
        "delay_level",
        "born_ts",
        "deliver_at",
        "delay",
        "msg_id",
        "window",
    }
)


@dataclass(frozen=True)
class Message:
    """A message to send.

    Attributes:
        topic: the real topic it is delivered to (a SQL identifier).
        body: payload; ``str`` is encoded as UTF-8.
        keys: lookup keys; a string is split on spaces, like RocketMQ's ``KEYS``.
        tags: one tag, for consumers' filters.
        properties: user properties, string to string.
        delay_level: RocketMQ delay level; ``None`` or ``<= 0`` delivers at once,
            above the maximum is clamped.
        born_ts: the producer's own time (informational, UTC-aware).
        deliver_at: deliver at this time (a timer message): an aware ``datetime``,
            milliseconds since the epoch, or ISO-8601 text with a zone. A time in the past
            or now is delivered at once; millisecond precision, no rounding.
        delay: deliver this long after the message is stored: a ``timedelta`` or text such
            as ``"90s"``, ``"15m"``, ``"2d"``, ``"250ms"``.
        msg_id: the message's id, given by the producer to make sending idempotent: a
            message sent again with the same id (a retry after a timeout, another writer)
            within ``messages.dedup_window`` is delivered once. 1 to 128 characters of
            ``A-Z a-z 0-9 _ . - :``. Without it, the engine makes one (32 hex digits).
        window: a delivery window (``timedelta`` or text such as ``"30s"``, up to a day):
            the message may be delivered any time in this long after its deliver time,
            and the engine spreads such messages over their windows to flatten peaks
            (stored as the property ``DELAYQ_WINDOW_MS``).
    """

    topic: str
    body: bytes | str
    keys: Sequence[str] | str | None = None
    tags: str | None = None
    properties: Mapping[str, str] | None = None
    delay_level: int | None = None
    born_ts: datetime | None = None
    deliver_at: datetime | int | str | None = None
    delay: timedelta | str | None = None
    msg_id: str | None = None
    window: timedelta | str | None = None


def resolve_deliver_at(message: Message, cfg: EngineConfig, store_ts: datetime) -> datetime | None:
    """The absolute deliver time a timer message asks for, or ``None`` for a level message.

    Raises:
        InvalidMessageError: when the time does not parse, several delay kinds are given,
            or it lies more than ``messages.max_delay`` after ``store_ts``.
    """
    given = [n for n in ("deliver_at", "delay") if getattr(message, n) is not None]
    if message.delay_level is not None:
        given.append("delay_level")
    if len(given) > 1:
        raise InvalidMessageError(given[1], getattr(message, given[1]), f"give only one of {given}")
    return deliver_time(message.deliver_at, message.delay, cfg, store_ts)


def deliver_time(
    deliver_at: datetime | int | str | None,
    delay: timedelta | str | None,
    cfg: EngineConfig,
    now: datetime,
) -> datetime | None:
    """An absolute deliver time from ``deliver_at`` or ``delay`` (after ``now``), or ``None``.

    Raises:
        InvalidMessageError: when the time does not parse, or lies more than
            ``messages.max_delay`` after ``now``.
    """
    when: datetime | None = None
    if deliver_at is not None:
        when = _absolute(deliver_at)
    elif delay is not None:
        when = now + _relative(delay)
    if when is None:
        return None
    when = truncate_ms(when)
    if when - now > timedelta(milliseconds=cfg.max_delay_ms):
        field, value = ("deliver_at", deliver_at) if deliver_at is not None else ("delay", delay)
        raise InvalidMessageError(
            field, value, f"more than messages.max_delay={cfg.max_delay_ms // 1000}s ahead"
        )
    return when


def _absolute(value: object) -> datetime:
    if isinstance(value, datetime):
        if value.utcoffset() is None:
            raise InvalidMessageError("deliver_at", value, "must be timezone-aware")
        return value.astimezone(UTC)
    if isinstance(value, int) and not isinstance(value, bool):
        return from_millis(value)
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return from_millis(int(text))
        try:
            parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            parsed = None
        if parsed is None or parsed.utcoffset() is None:
            raise InvalidMessageError(
                "deliver_at", value, "expected ms since the epoch or ISO-8601 with a zone"
            )
        return parsed.astimezone(UTC)
    raise InvalidMessageError("deliver_at", value, "expected a datetime, ms or ISO-8601 text")


def _relative(value: object) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, str):
        try:
            return timedelta(milliseconds=parse_duration_ms(value, "delay"))
        except ConfigError:
            pass
    raise InvalidMessageError("delay", value, "expected a timedelta or e.g. '90s', '15m', '2d'")


def check_property_name(name: object, cfg: EngineConfig, engine: bool = False) -> None:
    """Refuse a property name that is empty, too long, has other characters than
    ``A-Z a-z 0-9 _ . - :``, or is one of the engine's own (unless ``engine`` sends it).

    Raises:
        InvalidMessageError: naming the property.

    Example:
        >>> from engine.core.config import EngineConfig
        >>> check_property_name("region", EngineConfig())
        >>> try:
        ...     check_property_name("a=b", EngineConfig())
        ... except InvalidMessageError as err:
        ...     print(err.field, err.value)
        properties a=b
    """
    if not isinstance(name, str) or not name:
        raise InvalidMessageError("properties", name, "property names must be non-empty strings")
    if len(name) > cfg.max_property_name:
        raise InvalidMessageError(
            "properties",
            name,
            f"property name longer than messages.max_property_name_length={cfg.max_property_name}",
        )
    if not re.fullmatch(PROPERTY_NAME_CHARS, name):
        raise InvalidMessageError(
            "properties", name, "property names may hold only A-Z a-z 0-9 _ . - :"
        )
    if not engine and name in RESERVED_PROPERTIES:
        raise InvalidMessageError(
            "properties", name, "is set by the engine itself; choose another name"
        )


def validate(
    message: Message, cfg: EngineConfig, store_ts: datetime | None = None, engine: bool = False
) -> dict[str, Any]:
    """Check a message and return its ``commitlog`` fields (without id and store time).

    Args:
        message: the message.
        cfg: limits (body size, maximum delay, property names).
        store_ts: the store time relative delays count from (default: now).
        engine: the engine sends it (a dead letter sent again): its own property names
            are allowed.

    Raises:
        InvalidMessageError: naming the first bad field and its value.
    """
    check_topic(message.topic)
    if message.msg_id is not None:
        check_msg_id(message.msg_id)
    body = message.body
    if isinstance(body, str):
        body = body.encode("utf-8")
    if not isinstance(body, bytes | bytearray):
        raise InvalidMessageError("body", body, "must be bytes or str")
    if not body and not cfg.allow_empty_body:
        raise InvalidMessageError(
            "body", "", "is empty (set messages.allow_empty_body = true to accept empty bodies)"
        )
    if len(body) > cfg.max_body_bytes:
        raise InvalidMessageError(
            "body",
            f"<{len(body)} bytes>",
            f"larger than messages.max_body_bytes={cfg.max_body_bytes}",
        )
    keys = message.keys
    if isinstance(keys, str):
        keys = keys.split()
    keys = list(keys or [])
    for key in keys:
        if not isinstance(key, str) or not key:
            raise InvalidMessageError("keys", message.keys, "each key must be a non-empty string")
    if message.tags is not None and not isinstance(message.tags, str):
        raise InvalidMessageError("tags", message.tags, "must be a string")
    properties = dict(message.properties or {})
    for name, value in properties.items():
        check_property_name(name, cfg, engine)
        if not isinstance(value, str):
            raise InvalidMessageError(
                f"properties[{name!r}]", value, "property values must be strings"
            )
    if message.window is not None:
        properties[PROP_WINDOW] = str(_window_ms(message.window))
    if PROP_WINDOW in properties and not window_ok(properties[PROP_WINDOW]):
        raise InvalidMessageError(
            f"properties[{PROP_WINDOW!r}]",
            properties[PROP_WINDOW],
            f"is not a whole number of milliseconds from 1 to {MAX_WINDOW_MS}",
        )
    level = message.delay_level
    if level is not None and (isinstance(level, bool) or not isinstance(level, int)):
        raise InvalidMessageError("delay_level", level, "must be a whole number or None")
    if level is not None and not -(2**31) <= level < 2**31:
        raise InvalidMessageError("delay_level", level, "out of range")
    born = message.born_ts
    if born is not None and (not isinstance(born, datetime) or born.utcoffset() is None):
        raise InvalidMessageError("born_ts", born, "must be a timezone-aware datetime")
    deliver_at = resolve_deliver_at(message, cfg, store_ts or SystemClock().now())
    return {
        "msg_id": message.msg_id,
        "deliver_at": deliver_at,
        "topic": message.topic,
        "keys": keys,
        "tags": message.tags,
        "properties": properties,
        "body": bytes(body),
        "delay_level": level,
        "born_ts": born,
    }


def window_ok(text: str) -> bool:
    """Whether a ``DELAYQ_WINDOW_MS`` property holds a valid window.

    Example:
        >>> window_ok("30000"), window_ok("0"), window_ok("2d")
        (True, False, False)
    """
    return bool(re.fullmatch(WINDOW_CHARS, text)) and int(text) <= MAX_WINDOW_MS


def _window_ms(window: timedelta | str) -> int:
    """A delivery window in milliseconds (1 ms to a day).

    Raises:
        InvalidMessageError: naming ``window`` and the value.
    """
    if isinstance(window, timedelta):
        ms = window // timedelta(milliseconds=1)
    elif isinstance(window, str):
        try:
            ms = parse_duration_ms(window, "window")
        except ConfigError:
            raise InvalidMessageError(
                "window", window, "expected a duration such as 30s, 5m or 250ms"
            ) from None
    else:
        raise InvalidMessageError("window", window, "must be a timedelta or text such as 30s")
    if not 1 <= ms <= MAX_WINDOW_MS:
        raise InvalidMessageError("window", window, "must be from 1ms to 1d")
    return int(ms)


def message_property(text: str) -> tuple[str, str]:
    """A ``--property NAME=VALUE`` of the command line (``delayq send``, ``delayq schedule``).

    Raises:
        InvalidMessageError: naming the field ``property`` and the text, without ``=`` or a
            name.

    Example:
        >>> message_property("region = eu")
        ('region', 'eu')
    """
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise InvalidMessageError("property", text, "give it as NAME=VALUE, e.g. region=eu")
    return name.strip(), value.strip()


def check_msg_id(msg_id: object) -> None:
    """Refuse a producer's message id that is not 1-128 characters of ``A-Z a-z 0-9 _ . - :``.

    Raises:
        InvalidMessageError: naming ``msg_id`` and the value.

    Example:
        >>> check_msg_id("order-1:paid")
        >>> try:
        ...     check_msg_id("a b")
        ... except InvalidMessageError as err:
        ...     print(err.field, err.value)
        msg_id a b
    """
    if not isinstance(msg_id, str) or not msg_id:
        raise InvalidMessageError("msg_id", msg_id, "must be a non-empty string")
    if len(msg_id) > MAX_MSG_ID:
        raise InvalidMessageError("msg_id", msg_id, f"longer than {MAX_MSG_ID} characters")
    if not re.fullmatch(MSG_ID_CHARS, msg_id):
        raise InvalidMessageError("msg_id", msg_id, "may hold only A-Z a-z 0-9 _ . - :")


def new_msg_id() -> str:
    """A new message id: 32 upper-case hex digits, like RocketMQ's."""
    return uuid.uuid4().hex.upper()


#: Each byte's two upper-case hex digits.
_HEX = np.frombuffer("".join(f"{b:02X}" for b in range(256)).encode(), np.uint8).reshape(256, 2)


def new_msg_ids(n: int) -> pa.Array:
    """``n`` new message ids at once, each as :func:`new_msg_id` makes one (a random UUID,
    version 4, as 32 upper-case hex digits), built with numpy: about 100 times quicker than
    ``n`` calls, which matters to a producer sending 100,000 rows at a time.

    Example:
        >>> ids = new_msg_ids(2).to_pylist()
        >>> [len(i) for i in ids], ids[0] != ids[1], ids[0][12], ids[0][16] in "89AB"
        ([32, 32], True, '4', True)
    """
    raw = np.frombuffer(os.urandom(16 * n), np.uint8).reshape(n, 16).copy()
    raw[:, 6] = (raw[:, 6] & 0x0F) | 0x40  # version 4
    raw[:, 8] = (raw[:, 8] & 0x3F) | 0x80  # the RFC 4122 variant
    text = _HEX[raw].tobytes()  # (n, 16, 2) digits, row after row
    offsets = np.arange(0, 32 * n + 1, 32, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(text))


def message_from_mapping(item: Mapping[str, Any], index: int) -> Message:
    """A :class:`Message` from a dict with the same fields (``index`` names it in errors).

    Raises:
        InvalidMessageError: on unknown fields, or without ``topic`` and ``body``.
    """
    unknown = set(item) - MESSAGE_FIELDS
    if unknown:
        raise InvalidMessageError(f"messages[{index}]", sorted(unknown), "unknown fields")
    if "topic" not in item or "body" not in item:
        raise InvalidMessageError(f"messages[{index}]", dict(item), "topic and body are required")
    return Message(**item)


def out_of_range(column: str) -> Column:
    """True when a timestamp lies outside the years the engine handles (1970 to 9000)."""
    value = F.col(column)
    return (value < F.lit("1970-01-01").cast("timestamp")) | (
        value >= F.lit("9000-01-01").cast("timestamp")
    )


def rejection_reason(cfg: EngineConfig) -> Column:
    """A column that is null for a valid ``commitlog`` row, else says what is wrong.

    The same rules as :func:`validate`, for rows that did not come through it (a DataFrame
    send, or a row inserted into ``commitlog`` by other means).
    """
    topic = F.col("topic")
    reserved = F.lower(topic).isin(*sorted(RESERVED_TOPICS))
    properties = F.coalesce(F.col("properties"), F.create_map().cast("map<string,string>"))
    bad_property = F.exists(
        F.map_entries(properties), lambda e: (F.length(e["key"]) == 0) | e["value"].isNull()
    )
    bad_name = F.filter(
        F.map_keys(properties),
        lambda k: ~k.rlike(f"^{PROPERTY_NAME_CHARS}\\z") | (F.length(k) > cfg.max_property_name),
    )
    empty_body = F.lit(False) if cfg.allow_empty_body else F.length("body") == 0
    window = F.try_element_at(properties, F.lit(PROP_WINDOW))
    return (
        F.when(F.col("msg_id").isNull(), F.lit("msg_id is missing"))
        .when(
            ~F.col("msg_id").rlike(f"^{MSG_ID_CHARS}\\z") | (F.length("msg_id") > MAX_MSG_ID),
            F.concat(
                F.lit("msg_id '"),
                F.col("msg_id"),
                F.lit(f"' is not 1 to {MAX_MSG_ID} characters of A-Z a-z 0-9 _ . - :"),
            ),
        )
        .when(topic.isNull() | (topic == ""), F.lit("topic is missing"))
        .when(
            ~topic.rlike(TOPIC_PATTERN),
            F.concat(F.lit("topic '"), topic, F.lit("' is not a valid topic name")),
        )
        .when(reserved, F.concat(F.lit("topic '"), topic, F.lit("' is an engine table name")))
        .when(F.col("body").isNull(), F.lit("body is missing"))
        .when(empty_body, F.lit("body is empty (messages.allow_empty_body is false)"))
        .when(
            F.length("body") > cfg.max_body_bytes,
            F.concat(
                F.lit("body is "),
                F.length("body").cast("string"),
                F.lit(f" bytes, over messages.max_body_bytes={cfg.max_body_bytes}"),
            ),
        )
        .when(F.col("store_ts").isNull(), F.lit("store_ts is missing"))
        .when(out_of_range("store_ts"), F.lit("store_ts is outside 1970-01-01..9000-01-01"))
        .when(out_of_range("deliver_at"), F.lit("deliver_at is outside 1970-01-01..9000-01-01"))
        .when(
            F.unix_millis("deliver_at") - F.unix_millis("store_ts") > cfg.max_delay_ms,
            F.lit(f"deliver_at is more than messages.max_delay={cfg.max_delay_ms // 1000}s ahead"),
        )
        .when(bad_property, F.lit("a property has an empty name or no value"))
        .when(
            window.isNotNull()
            & (~window.rlike(f"^{WINDOW_CHARS}\\z") | (window.try_cast("long") > MAX_WINDOW_MS)),
            F.concat(F.lit(f"property {PROP_WINDOW} '"), window, F.lit(WINDOW_REFUSED)),
        )
        .when(
            F.size(bad_name) > 0,
            F.concat(
                F.lit("property name '"),
                F.element_at(bad_name, 1),
                F.lit(
                    "' is longer than messages.max_property_name_length="
                    f"{cfg.max_property_name} or holds characters other than A-Z a-z 0-9 _ . - :"
                ),
            ),
        )
    )
