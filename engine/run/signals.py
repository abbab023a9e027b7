"""Clean stops on Ctrl-C and SIGTERM: the JVM hands the signal to Python instead of dying.

Under ``spark-submit`` the Python driver is a child of the JVM, in the same process group, so
a Ctrl-C reaches both. The JVM's own handler starts its shutdown at once: it stops the
SparkContext under the running queries, which print pages of stack traces, while Python is
still stopping the engine; the process then exits 130. :class:`StopSignals` replaces the
JVM's ``INT`` and ``TERM`` handlers with one that only passes the signal on to this process,
and makes the first ``INT`` or ``TERM`` here a :class:`KeyboardInterrupt` (later ones, while
the engine stops, are ignored). The engine finishes the round in progress, stops its
queries, prints what it delivered and exits 0; the JVM follows.

Example:
    >>> StopSignals().install(spark)  # doctest: +SKIP
    >>> engine.run()  # Ctrl-C or `kill <pid>` now stops it cleanly  # doctest: +SKIP
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

#: The signals that ask the engine to stop.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _PassOn:
    """A ``sun.misc.SignalHandler`` written in Python (py4j calls it back)."""

    def __init__(self, on_signal: Callable[[], None]) -> None:
        self._on_signal = on_signal

    def handle(self, _signal: Any) -> None:
        """Called by the JVM, in a py4j thread, when it receives the signal."""
        self._on_signal()

    class Java:
        implements: ClassVar[list[str]] = ["sun.misc.SignalHandler"]


class StopSignals:
    """Turns the first ``INT``/``TERM`` (to Python or to the JVM) into one KeyboardInterrupt.

    Attributes:
        requested: set once a stop was asked for.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._jvm_handler: _PassOn | None = None

    def install(self, spark: SparkSession | None = None) -> StopSignals:
        """Handle the signals here, and in ``spark``'s JVM when given; returns ``self``.

        Only the main thread can install signal handlers: elsewhere this does nothing.
        """
        if threading.current_thread() is not threading.main_thread():
            return self
        for number in STOP_SIGNALS:
            signal.signal(number, self._here)
        if spark is not None:
            try:
                gateway: Any = spark.sparkContext._gateway
                ensure_callback_server_started(gateway)  # type: ignore[no-untyped-call]
                jvm = gateway.jvm
                self._jvm_handler = _PassOn(self._from_jvm)
                for name in ("INT", "TERM"):
                    jvm.sun.misc.Signal.handle(jvm.sun.misc.Signal(name), self._jvm_handler)
            except Exception:  # a JVM without sun.misc: keep its own handlers
                log.debug("could not take over the JVM's signal handlers", exc_info=True)
        return self

    def _here(self, _number: int, _frame: FrameType | None) -> None:
        if self.requested.is_set():
            return  # already stopping: the JVM passing the same Ctrl-C on, or a second one
        self.requested.set()
        raise KeyboardInterrupt

    def _from_jvm(self) -> None:
        if not self.requested.is_set():
            os.kill(os.getpid(), signal.SIGINT)


__all__ = ["STOP_SIGNALS", "StopSignals"]
