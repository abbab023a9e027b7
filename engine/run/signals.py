"""Clean stops on Ctrl-C and SIGTERM: the JVM hands the signal to Python instead of dying.

Under ``spark-submit`` the Python driver is a child of the JVM, in the same process group, so
a Ctrl-C reaches both. The JVM's own handler starts its shutdown at once: it stops the
SparkContext under the running queries, which print pages of stack traces, while Python is
still stopping the engine; the process then exits 130. :class:`StopSignals` replaces both
processes' ``INT`` and ``TERM`` handlers while the engine runs: the first signal only sets
:attr:`StopSignals.requested`, which the engine's loop watches (it finishes the round in
progress, stops its queries, prints what it delivered and exits 0); a second signal to the
same process forces the stop as the default handlers would. The previous handlers come back
when the ``with`` block ends.

Example:
    >>> with StopSignals() as signals:  # doctest: +SKIP
    ...     signals.install(spark)
    ...     engine.run(stop=signals.requested)  # Ctrl-C or `kill <pid>` stops it cleanly
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, ClassVar

from pyspark.java_gateway import ensure_callback_server_started
from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

#: The signals that ask the engine to stop, here and (by name) in the JVM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
JVM_SIGNALS = ("INT", "TERM")


class _PassOn:
    """A ``sun.misc.SignalHandler`` written in Python (py4j calls it back)."""

    def __init__(self, on_signal: Callable[[str], None]) -> None:
        self._on_signal = on_signal

    def handle(self, received: Any) -> None:
        """Called by the JVM, in a py4j thread, when it receives the signal."""
        self._on_signal(str(received.getName()))

    class Java:
        implements: ClassVar[list[str]] = ["sun.misc.SignalHandler"]


class StopSignals:
    """The first ``INT``/``TERM`` asks for a stop; a second one to the same process forces it.

    Attributes:
        requested: set once a stop was asked for.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._previous: dict[int, Any] = {}
        self._received = 0
        self._jvm: Any = None
        self._jvm_previous: dict[str, Any] = {}
        self._jvm_received = 0
        self._pass_on: _PassOn | None = None  # referenced here, so py4j keeps it

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.restore()

    def install(self, spark: SparkSession | None = None) -> StopSignals:
        """Handle the signals here, and in ``spark``'s JVM when given; returns ``self``.

        Only the main thread can install signal handlers: elsewhere this does nothing.
        """
        if threading.current_thread() is not threading.main_thread():
            return self
        for number in STOP_SIGNALS:
            # Again after Spark started: a SparkContext made in between put its own SIGINT
            # handler in place, which cancels every Spark job and raises KeyboardInterrupt
            # wherever the main thread is, even inside a py4j call (which then fails with
            # "Gateway must be connected to send cancel cmd.": a stop reported as a bug).
            if signal.getsignal(number) != self._here:
                self._previous[number] = signal.signal(number, self._here)
        if spark is not None and self._jvm is None:
            try:
                gateway: Any = spark.sparkContext._gateway
                ensure_callback_server_started(gateway)  # type: ignore[no-untyped-call]
                jvm = gateway.jvm
                self._pass_on = _PassOn(self._from_jvm)
                for name in JVM_SIGNALS:
                    previous = jvm.sun.misc.Signal.handle(jvm.sun.misc.Signal(name), self._pass_on)
                    self._jvm_previous[name] = previous
                self._jvm = jvm
            except Exception:  # a JVM without sun.misc: keep its own handlers
                log.debug("could not take over the JVM's signal handlers", exc_info=True)
        return self

    def restore(self) -> None:
        """Put the previous handlers back (here and in the JVM)."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
        if self._jvm is not None:
            for name, handler in self._jvm_previous.items():
                try:
                    self._jvm.sun.misc.Signal.handle(self._jvm.sun.misc.Signal(name), handler)
                except Exception:  # the JVM is going down already
                    log.debug("could not restore the JVM's %s handler", name, exc_info=True)
            self._jvm, self._jvm_previous = None, {}

    def _here(self, number: int, _frame: FrameType | None) -> None:
        self._received += 1
        if self._received == 1:
            self.requested.set()
            return
        # A second one: stop now, as the default handler would have at the first.
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)

    def _from_jvm(self, name: str) -> None:
        self._jvm_received += 1
        if self._jvm_received == 1:
            self.requested.set()
            return
        previous = self._jvm_previous.get(name)
        if previous is not None and self._jvm is not None:
            previous.handle(self._jvm.sun.misc.Signal(name))  # the JVM's own: it shuts down


__all__ = ["JVM_SIGNALS", "STOP_SIGNALS", "StopSignals"]
