"""`delayq send` names the message field it refuses, not configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cli import main


@pytest.mark.parametrize("given", ["=v", "novalue"])
def test_a_property_without_a_name_or_value_is_named_as_the_message_field(
    given: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["send", "--set", f"lakehouse.path={tmp_path}", "--topic", "orders",
                 "--body", "b", "--property", given])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 2, printed
    assert f"invalid message property={given!r}: give it as NAME=VALUE" in printed.err
    assert "configuration" not in printed.err and "Traceback" not in printed.err
