"""How programs end on failure: a mistake in one line, a bug in one line naming its log."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.core.errors import ConfigError
from engine.run.report import (
    EXIT_BUG,
    EXIT_ERROR,
    LOG_DIR_ENV,
    log_dir,
    run_main,
    setup_logging,
    summary,
)


@pytest.fixture
def log_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "logs"))
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield setup_logging("prog")
    for handler in set(root.handlers) - set(before):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)


def _buggy() -> int:
    raise KeyError("round 7")


def test_a_bug_is_one_line_naming_the_log_file_that_holds_the_traceback(
    log_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_main("prog", _buggy, log_file)
    err = capsys.readouterr().err
    assert code == EXIT_BUG == 70
    assert err.count("\n") == 1, err
    assert err.startswith("prog: internal error (a bug): KeyError: 'round 7'; ")
    assert f"the traceback is in {log_file}" in err and "Traceback" not in err
    assert log_file.parent == log_dir()
    text = log_file.read_text()
    assert "Traceback (most recent call last)" in text and "in _buggy" in text


def test_a_mistake_is_one_line_without_a_log(
    log_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def mistake() -> int:
        raise ConfigError("stamp.interval", "-1s", "must be positive")

    assert run_main("prog", mistake, log_file) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err == "prog: error: invalid configuration stamp.interval='-1s': must be positive\n"
    assert not log_file.exists()


def test_an_error_logged_with_its_traceback_is_one_line_on_the_console_and_whole_in_the_file(
    log_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        _buggy()
    except KeyError:
        logging.getLogger("delayq").error("the delivery stage stopped", exc_info=True)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.rstrip().endswith(
        f"ERROR delayq: the delivery stage stopped (KeyError: 'round 7'; see {log_file})"
    )
    assert "Traceback (most recent call last)" in log_file.read_text()


def test_a_message_that_quotes_its_error_does_not_say_it_twice(
    log_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        _buggy()
    except KeyError as err:
        logging.getLogger("delayq").error("the stamping stage stopped: %s", err, exc_info=True)
    err = capsys.readouterr().err
    assert err.rstrip().endswith(
        f"ERROR delayq: the stamping stage stopped: 'round 7' (KeyError; see {log_file})"
    )


def test_the_summary_is_the_first_line_that_says_something() -> None:
    error = RuntimeError("An error occurred while calling o42.save.\n: java.io.IOException: disk\n")
    assert summary(error) == "java.io.IOException: disk"
    assert summary(ValueError("")) == "ValueError"
