"""Send-time validation: bad messages fail with the field and value named."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from engine.core.config import EngineConfig
from engine.core.errors import InvalidMessageError
from engine.core.message import Message, validate

CFG = EngineConfig(max_body_bytes=10)


@pytest.mark.parametrize(
    ("message", "field", "needle"),
    [
        (Message("", "x"), "topic", "required"),
        (Message("order-events", "x"), "topic", "letters, digits"),
        (Message("9lives", "x"), "topic", "letters, digits"),
        (Message("commitlog", "x"), "topic", "engine table"),
        (Message("orders", "x" * 11), "body", "max_body_bytes=10"),
        (Message("orders", 42), "body", "bytes or str"),  # type: ignore[arg-type]
        (Message("orders", "x", delay_level="3"), "delay_level", "whole number"),  # type: ignore[arg-type]
        (Message("orders", "x", delay_level=True), "delay_level", "whole number"),
        (Message("orders", "x", properties={"a": 1}), "properties['a']", "strings"),  # type: ignore[dict-item]
        (Message("orders", "x", properties={"": "v"}), "properties", "non-empty"),
        (Message("orders", "x", keys=["ok", ""]), "keys", "non-empty"),
        (Message("orders", ""), "body", "allow_empty_body"),
        (Message("orders", b""), "body", "is empty"),
        (Message("orders", "x", properties={"RECONSUME_TIME": "15"}), "properties", "engine"),
        (Message("orders", "x", properties={"DLQ_MSG_ID": "x"}), "properties", "engine"),
        (Message("orders", "x", properties={"a=b": "v"}), "properties", "A-Z a-z 0-9"),
        (Message("orders", "x", properties={"a b": "v"}), "properties", "A-Z a-z 0-9"),
        (Message("orders", "x", properties={"k" * 129: "v"}), "properties", "length=128"),
        (Message("orders", "x", msg_id=""), "msg_id", "non-empty"),
        (Message("orders", "x", msg_id="a b"), "msg_id", "A-Z a-z 0-9"),
        (Message("orders", "x", msg_id="i" * 129), "msg_id", "128 characters"),
    ],
)
def test_bad_messages_are_refused(message: Message, field: str, needle: str) -> None:
    with pytest.raises(InvalidMessageError) as err:
        validate(message, CFG)
    assert err.value.field == field
    assert needle in str(err.value)


def test_good_message_is_normalised() -> None:
    fields = validate(Message("Orders_2", "héllo", keys="k1 k2", delay_level=-3), EngineConfig())
    assert fields["body"] == "héllo".encode()
    assert fields["keys"] == ["k1", "k2"]
    assert fields["delay_level"] == -3


STORE = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"deliver_at": 1767268800123}, datetime(2026, 1, 1, 12, 0, 0, 123_000, tzinfo=UTC)),
        ({"deliver_at": "1767268800123"}, datetime(2026, 1, 1, 12, 0, 0, 123_000, tzinfo=UTC)),
        (
            {"deliver_at": "2026-01-01T13:30:00.250+01:00"},
            STORE + timedelta(minutes=30, milliseconds=250),
        ),
        ({"deliver_at": "2026-01-01T12:00:05Z"}, STORE + timedelta(seconds=5)),
        ({"delay": "90s"}, STORE + timedelta(seconds=90)),
        ({"delay": "250ms"}, STORE + timedelta(milliseconds=250)),
        ({"delay": timedelta(days=2)}, STORE + timedelta(days=2)),
        ({"deliver_at": STORE - timedelta(hours=1)}, STORE - timedelta(hours=1)),
        ({"delay_level": 3}, None),
    ],
)
def test_deliver_time_forms(kwargs: dict[str, object], expected: datetime | None) -> None:
    fields = validate(Message("orders", "x", **kwargs), EngineConfig(), STORE)  # type: ignore[arg-type]
    assert fields["deliver_at"] == expected


@pytest.mark.parametrize(
    ("kwargs", "field", "needle"),
    [
        ({"deliver_at": "2026-01-01T12:00:00"}, "deliver_at", "with a zone"),
        ({"deliver_at": "tomorrow"}, "deliver_at", "ISO-8601"),
        ({"deliver_at": datetime(2026, 1, 2)}, "deliver_at", "timezone-aware"),  # noqa: DTZ001
        ({"delay": "soon"}, "delay", "'90s'"),
        ({"delay": "31d"}, "delay", "max_delay"),
        ({"deliver_at": "2026-03-01T00:00:00Z"}, "deliver_at", "max_delay"),
        ({"delay": "5s", "delay_level": 2}, "delay_level", "only one"),
        ({"deliver_at": 1, "delay": "5s"}, "delay", "only one"),
    ],
)
def test_bad_deliver_times_are_refused(kwargs: dict[str, object], field: str, needle: str) -> None:
    with pytest.raises(InvalidMessageError) as err:
        validate(Message("orders", "x", **kwargs), EngineConfig(), STORE)  # type: ignore[arg-type]
    assert err.value.field == field
    assert needle in str(err.value)


def test_limits_on_bodies_and_property_names_come_from_config() -> None:
    relaxed = EngineConfig(allow_empty_body=True, max_property_name=3)
    assert validate(Message("orders", ""), relaxed)["body"] == b""
    with pytest.raises(InvalidMessageError, match="max_property_name_length=3"):
        validate(Message("orders", "x", properties={"abcd": "v"}), relaxed)
    with pytest.raises(InvalidMessageError, match="A-Z a-z 0-9"):
        validate(Message("orders", "x", properties={"region\n": "v"}), EngineConfig())
    fields = validate(
        Message("orders", "x", properties={"a.b": "v", "c-d:e_1": "w"}), EngineConfig()
    )
    assert fields["properties"] == {"a.b": "v", "c-d:e_1": "w"}


def test_the_engine_may_send_its_own_property_names() -> None:
    resent = Message("orders", "x", properties={"ORIGIN_MESSAGE_ID": "A1", "DLQ_MSG_ID": "B2"})
    assert validate(resent, EngineConfig(), engine=True)["properties"]["DLQ_MSG_ID"] == "B2"
