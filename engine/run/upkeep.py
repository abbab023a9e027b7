"""Maintenance on a schedule inside a running engine (``maintenance.interval``, off by default).

Every interval, :class:`Upkeep` runs ``delayq maintain``'s work
(:func:`~engine.control.maintain.maintain`) in a thread of its own, beside the stamping and
delivery stages, and prints its lines with a ``maintain:`` prefix. A run that fails is logged
and tried again at the next interval; the engine carries on. Stopping lets a run in progress
finish (its Spark must not stop under it), waiting at most :data:`STOP_WAIT_S`.

Example:
    >>> upkeep = Upkeep(lambda: maintain_once(spark, cfg, print), 86_400)  # doctest: +SKIP
    >>> upkeep.start().stop()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from engine.core.config import EngineConfig

log = logging.getLogger(__name__)

#: Longest :meth:`Upkeep.stop` waits for a run in progress.
STOP_WAIT_S = 300.0


class Upkeep:
    """Calls ``run`` every ``interval_s`` seconds (first after one interval) until stopped.

    Args:
        run: one maintenance run.
        interval_s: seconds between the starts of two runs.
        name: the thread's name.
        what: what a run does, for the log line of one that fails.
    """

    def __init__(
        self,
        run: Callable[[], Any],
        interval_s: float,
        name: str = "delayq-maintain",
        what: str = "scheduled maintenance",
    ) -> None:
        self.run = run
        self.interval_s = interval_s
        self.name = name
        self.what = what
        self.runs = 0
        self.failures = 0
        self._failing = 0  # failures in a row
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Upkeep:
        """Start the schedule in the background; returns ``self``."""
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self.run()
                self.runs += 1
                self._failing = 0
            except Exception as err:  # the next run tries again; delivery is not affected
                self.failures += 1
                self._failing += 1
                if self._failing == 1:  # the traceback once, then a line per failure
                    log.exception("%s failed; next try in %g s", self.what, self.interval_s)
                else:
                    log.error("%s failed again (%d in a row): %s", self.what, self._failing, err)

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop; a run in progress finishes first (at most ``wait_s`` seconds)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(wait_s)


def maintain_once(spark: Any, cfg: EngineConfig, say: Callable[[str], None]) -> None:
    """One maintenance run over every table, its lines given to ``say``.

    Example:
        >>> maintain_once(spark, cfg, print)  # doctest: +SKIP
        schedule: pruned 0 rows delivered or cancelled before 2026-11-17 09:00:00+00:00
    """
    from engine.control.maintain import maintain

    for report in maintain(spark, cfg, say):
        say(report.line())


__all__ = ["STOP_WAIT_S", "Upkeep", "maintain_once"]
