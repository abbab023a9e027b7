"""A streaming source's planning process ends quietly when Spark closes its connection, and
only then (:func:`engine.lakehouse.catalog.session.hung_up`)."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine
from engine.lakehouse.catalog.session import hung_up


def _raised(code: str, filename: str) -> BaseException:
    with pytest.raises(BaseException) as caught:
        exec(compile(code, filename, "exec"), {})
    return caught.value


def test_a_closed_connection_met_by_pysparks_runner_ends_the_process_quietly(
    tmp_path: Path,
) -> None:
    runner = str(tmp_path / "pyspark" / "serializers.py")
    for error in ("EOFError", "BrokenPipeError", "ConnectionResetError"):
        assert hung_up(_raised(f"raise {error}()", runner)), error


def test_a_failure_in_delayqs_code_or_of_another_kind_is_reported_to_spark(
    tmp_path: Path,
) -> None:
    ours = str(Path(engine.__file__).parent / "stamp" / "query.py")
    assert not hung_up(_raised("raise EOFError()", ours))  # a bug of ours: Spark hears it
    runner = str(tmp_path / "pyspark" / "serializers.py")
    assert not hung_up(_raised("raise ValueError('bad offset')", runner))
    assert not hung_up(None)  # the runner ended without an error
