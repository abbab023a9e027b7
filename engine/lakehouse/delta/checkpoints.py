"""Delta checkpoints written beside the hot path, by one background thread.

A checkpoint (every ``delta.checkpointInterval`` versions, 10 unless the table says
otherwise) lets a reader start from one Parquet file instead of replaying every commit.
Writing one reads the whole table state, which grows with the table's files: done inside a
delivery round or a stamping batch it would make their latency grow with the table. Appends
ask :data:`CHECKPOINTS` for one and return; the thread writes it (delta-rs) and removes log
files past the table's log retention, unless ``delta.enableExpiredLogCleanup`` is false. A
checkpoint that fails or never runs loses nothing: the commits are the table, the checkpoint
only a shortcut, and a later one is asked again.

Example:
    >>> CHECKPOINTS.request("/lake/topics/orders")  # doctest: +SKIP
    >>> CHECKPOINTS.wait(timeout=10)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Mapping

from engine.lakehouse.storage.location import store_for

log = logging.getLogger(__name__)

#: A checkpoint every this many versions, as Spark's Delta does by default (delta-rs would
#: wait 100): Spark readers of a table appended from here replay at most this many commits.
#: A table's own ``delta.checkpointInterval`` wins.
CHECKPOINT_INTERVAL = 10


def checkpoint_interval(configuration: Mapping[str, str]) -> int:
    """Versions between checkpoints: the table's ``delta.checkpointInterval``, else
    :data:`CHECKPOINT_INTERVAL`.

    Example:
        >>> checkpoint_interval({"delta.checkpointInterval": "25"}), checkpoint_interval({})
        (25, 10)
    """
    try:
        value = int(configuration.get("delta.checkpointInterval", CHECKPOINT_INTERVAL))
    except ValueError:
        return CHECKPOINT_INTERVAL  # Delta itself would refuse the table's writes
    return value if value > 0 else CHECKPOINT_INTERVAL


def cleans_expired_log(configuration: Mapping[str, str]) -> bool:
    """Whether log files past the table's log retention are deleted after a checkpoint:
    ``delta.enableExpiredLogCleanup`` (default true), as Spark's Delta does.

    Example:
        >>> cleans_expired_log({"delta.enableExpiredLogCleanup": "false"})
        False
    """
    return configuration.get("delta.enableExpiredLogCleanup", "true").strip().lower() != "false"


class Checkpointer:
    """Writes the checkpoints appends ask for, one table at a time, on a daemon thread.

    The thread starts with the first request. Requests for a table already waiting are one.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, None] = {}  # table uris, oldest first
        self._busy = False
        self._stopping = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def request(self, uri: str) -> None:
        """Ask for a checkpoint of the table at ``uri`` (a lakehouse location) at its latest
        version."""
        with self._cond:
            if self._stopping:
                return
            self._waiting.setdefault(uri, None)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="delayq-checkpoints", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait until every asked checkpoint is written (or failed); ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._waiting or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Drop what waits, let a checkpoint being written finish (up to ``timeout``)."""
        with self._cond:
            self._stopping = True
            self._waiting.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                uri = next(iter(self._waiting))
                del self._waiting[uri]
                self._busy = True
            try:
                table = store_for(uri).delta_table(uri)
                table.create_checkpoint()
                if cleans_expired_log(table.metadata().configuration):
                    table.cleanup_metadata()  # log files past delta.logRetentionDuration
            except Exception as err:  # the commits stand; a later request checkpoints again
                log.warning("checkpoint of %s failed: %s", uri, err)
                log.debug("checkpoint failure", exc_info=True)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


#: The process's checkpointer.
CHECKPOINTS = Checkpointer()
atexit.register(CHECKPOINTS.stop)

__all__ = [
    "CHECKPOINTS",
    "CHECKPOINT_INTERVAL",
    "Checkpointer",
    "checkpoint_interval",
    "cleans_expired_log",
]
