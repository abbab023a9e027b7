"""Maintenance on a schedule: runs every interval, survives a failing run, stops cleanly."""

from __future__ import annotations

import threading
import time

import pytest

from engine.core.config import DEFAULT_CONF, load_config
from engine.core.errors import ConfigError
from engine.run.upkeep import Upkeep


def test_runs_every_interval_and_a_failure_does_not_stop_it() -> None:
    calls: list[float] = []
    third = threading.Event()

    def run() -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("OPTIMIZE lost a race five times")
        if len(calls) == 3:
            third.set()

    upkeep = Upkeep(run, interval_s=0.05).start()
    assert third.wait(5), "runs again after a failure"
    upkeep.stop()
    assert (upkeep.failures, upkeep.runs) == (1, 2)
    done = len(calls)
    time.sleep(0.2)
    assert len(calls) == done, "nothing runs after stop()"


def test_stop_lets_a_run_in_progress_finish() -> None:
    started, finished = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        time.sleep(0.3)
        finished.set()

    upkeep = Upkeep(slow, interval_s=0.01).start()
    assert started.wait(5)
    upkeep.stop()
    assert finished.is_set(), "its Spark must not stop under a run"


def test_the_interval_is_off_by_default_and_not_too_short() -> None:
    assert load_config(DEFAULT_CONF).maintenance_interval_ms == 0
    assert load_config(DEFAULT_CONF, {"maintenance.interval": "1d"}).maintenance_interval_ms == (
        86_400_000
    )
    with pytest.raises(ConfigError, match=r"maintenance\.interval.*at least 10m"):
        load_config(DEFAULT_CONF, {"maintenance.interval": "5m"})
