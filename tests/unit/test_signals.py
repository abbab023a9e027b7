"""Stop signals without Spark: the first asks, the second forces, the handlers come back."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from engine.run.signals import StopSignals

    with StopSignals() as signals:
        signals.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested.wait(5), "the first TERM asks for a stop"
        print("stop requested", flush=True)
        if sys.argv[1] == "twice":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            print("still running", flush=True)
    print("handler restored:", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
    """
)


def run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60
    )


def test_first_signal_asks_for_a_stop_and_handlers_come_back() -> None:
    done = run("once")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["stop requested", "handler restored: True"]


def test_a_second_signal_forces_the_stop() -> None:
    done = run("twice")
    assert done.returncode == -signal.SIGTERM
    assert "still running" not in done.stdout


SPARK_IN_BETWEEN = textwrap.dedent(
    """
    import os, signal
    from engine.run.signals import StopSignals

    def sparks_handler(number, frame):  # what a SparkContext installs for SIGINT
        print("spark's handler ran", flush=True)
        raise KeyboardInterrupt

    with StopSignals() as signals:
        signals.install()
        signal.signal(signal.SIGINT, sparks_handler)  # build_spark, between the two installs
        signals.install()
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.requested.wait(5), "Ctrl-C asks for a stop"
        print("stop requested", flush=True)
    print("spark's handler back:", signal.getsignal(signal.SIGINT) is sparks_handler, flush=True)
    """
)


def test_a_handler_spark_installs_in_between_is_taken_over_and_given_back() -> None:
    """``delayq run`` installs before Spark starts and again after: the SparkContext's SIGINT
    handler (cancel every job, raise KeyboardInterrupt wherever the main thread is, even
    inside a py4j call) must not be the one a Ctrl-C reaches while the engine runs."""
    done = subprocess.run(
        [sys.executable, "-c", SPARK_IN_BETWEEN], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["stop requested", "spark's handler back: True"]


def test_a_new_spark_session_keeps_a_ctrl_c_handler_its_caller_installed() -> None:
    """``build_spark`` (``_keeping_sigint``): the SparkContext it makes installs Spark's own
    SIGINT handler; a caller's handler (``delayq run``'s clean stop) comes back at once, so
    it covers the session's set-up after, while a plain session keeps Spark's."""
    from engine.lakehouse.catalog.session import _keeping_sigint

    def sparks(_number: int, _frame: object) -> None: ...

    def callers(_number: int, _frame: object) -> None: ...

    def new_context() -> str:
        signal.signal(signal.SIGINT, sparks)
        return "spark"

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, callers)
        assert _keeping_sigint(new_context) == "spark"  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGINT) is callers
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _keeping_sigint(new_context)  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGINT) is sparks
    finally:
        signal.signal(signal.SIGINT, before)
