"""Send-time validation: bad messages fail with the field and value named."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import InvalidMessageError
from engine.producer import Message, validate

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
