"""The stamping stage: follow ``commitlog`` and stamp each new batch of files, exactly once.

A batch is planned before it is written, as Spark's streaming offset log does: the plan
(``<lakehouse>/_checkpoints/stamp/batches/<batch>.json``) names the batch id and the
``commitlog`` positions it covers (:class:`~engine.lakehouse.delta.appends.Position`). The
writes are idempotent per batch id (:class:`~engine.stamp.writer.StampWriter`), so after a crash the
newest plan is run again, over the same files, and stores nothing twice; the next batch
starts where it ended.

No Spark job runs on this path: the log is read as files, the rows as Arrow, and the
commits are delta-rs's. A new batch is looked for every ``stamp.interval`` (a look is one
file-exists check), so a message is stamped some tens of milliseconds after its commit.

A lakehouse stamped by an earlier version (a Spark Delta stream with its checkpoint in
``_checkpoints/stamp``) carries on from that stream's last batch.

Example:
    >>> stamper = Stamper(spark, cfg, lay, clock).open()  # doctest: +SKIP
    >>> stamper.run_batch()  # doctest: +SKIP
    BatchResult(batch=0, rows=3, scheduled=3, quarantined=0, ...)
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pyspark.sql import SparkSession

from engine.core.clock import Clock
from engine.core.config import EngineConfig
from engine.core.errors import CheckpointError, RetryableError
from engine.lakehouse.delta.appends import CommitlogSource, Position
from engine.lakehouse.state.lease import unfenced
from engine.lakehouse.state.offset_log import OffsetLog
from engine.lakehouse.storage.fs import list_files, read_text
from engine.lakehouse.storage.layout import Layout
from engine.stamp.writer import StampWriter, highest_batch

log = logging.getLogger(__name__)

#: Plans kept in the stamping log (older ones are removed).
KEEP_PLANS = 100
#: The checkpoint folder (under ``<lakehouse>/_checkpoints``) of the streaming query that
#: stamps instead with ``stamp.mode = streaming`` (:mod:`engine.stamp.query`), and the file
#: in it that says where the query began.
QUERY_CHECKPOINT = "stamp-query"
QUERY_START_FILE = "delayq.json"


@dataclass(frozen=True)
class StampPlan:
    """Batch ``batch`` stamps the ``commitlog`` files from ``start`` up to ``end``."""

    batch: int
    start: Position
    end: Position

    def row(self) -> dict[str, int]:
        """The plan as its JSON line."""
        return {
            "batch": self.batch,
            "start_version": self.start.version,
            "start_index": self.start.index,
            "end_version": self.end.version,
            "end_index": self.end.index,
        }

    @staticmethod
    def from_row(row: dict[str, int]) -> StampPlan:
        """A plan read back from its JSON line."""
        return StampPlan(
            int(row["batch"]),
            Position(int(row["start_version"]), int(row["start_index"])),
            Position(int(row["end_version"]), int(row["end_index"])),
        )


@dataclass(frozen=True)
class BatchResult:
    """What one stamping batch did, with its timings in seconds."""

    batch: int
    rows: int
    scheduled: int
    quarantined: int
    files: int
    seconds: float
    read_s: float
    write_s: float
    replayed: bool = False
    #: Where the rows were stamped and written: ``driver``, or ``executors`` (Spark tasks,
    #: :mod:`engine.stamp.tasks`; then ``read_s`` is 0 and ``write_s`` holds it all).
    where: str = "driver"


@dataclass
class StampStats:
    """Running totals of the stamping stage since the process started."""

    recent: deque[BatchResult] = field(default_factory=lambda: deque(maxlen=10_000))
    looks: int = 0
    batches: int = 0
    rows: int = 0
    scheduled: int = 0
    quarantined: int = 0


class Stamper:
    """Stamps ``commitlog``'s new files batch by batch (see the module's description).

    The constructor holds what it is given; :meth:`open` reads the stamping log.

    Args:
        spark: used only to read and write the small plan files (Hadoop's FileSystem).
        cfg: levels, limits and the batch budget (``stamp.max_files_per_batch``,
            ``stamp.max_bytes_per_batch``).
        layout: the lakehouse.
        clock: the stamping time of each batch.
        fence: called before a new batch is planned; raises once this engine no longer
            holds the lakehouse (:meth:`~engine.lakehouse.state.lease.Lease.check`).
    """

    def __init__(
        self,
        spark: SparkSession,
        cfg: EngineConfig,
        layout: Layout,
        clock: Clock,
        fence: Callable[[], None] | None = None,
    ):
        self.spark = spark
        self.fence = fence or unfenced
        self.cfg = cfg
        self.layout = layout
        self.source = CommitlogSource(layout.commitlog)
        self.writer = StampWriter(cfg, layout, clock)
        self.plans = OffsetLog(layout.checkpoint("stamp") + "/batches")
        self.stats = StampStats()
        self._position = Position(0, 0)
        self._next_batch = 0
        self._replay: StampPlan | None = None
        self._opened = False
        self._lock = threading.Lock()  # one batch at a time (the engine's loop, step())

    @property
    def position(self) -> Position:
        """Where the next batch starts in ``commitlog``."""
        return self._position

    def warm(self) -> bool:
        """Whether a first look at ``commitlog`` is done (the first batch of a fresh JVM
        takes seconds)."""
        return self.stats.looks > 0

    def has_state(self) -> bool:
        """Whether this lakehouse has been stamped before (a plan, or an earlier version's
        stream checkpoint)."""
        self.open()
        return self._replay is not None or self._next_batch > 0

    def open(self) -> Stamper:
        """Read where stamping stopped; the newest batch is run again first. Returns ``self``.

        Raises:
            CheckpointError: an earlier version's stream stopped inside a ``commitlog``
                version (see :func:`spark_stream_plan`), or the streaming query stamps
                this lakehouse (``stamp.mode = streaming``).
        """
        if self._opened:
            return self
        query = f"{self.layout.checkpoint(QUERY_CHECKPOINT)}/{QUERY_START_FILE}"
        if read_text(query) is not None:
            raise CheckpointError(
                f"{self.layout.root} is stamped by the streaming query delayq-stamp "
                f"({query}): set stamp.mode=streaming to go on stamping it"
            )
        plan = self._newest_plan()
        held = max(highest_batch(table) for table in self.writer.tables())
        if plan is not None and held > plan.batch:
            plan = self._newest_plan()  # planned and stamped meanwhile by an engine fenced since?
        if plan is not None and held > plan.batch:
            raise CheckpointError(
                f"{self.layout.schedule} holds stamping batch {held} but the stamping log "
                f"{self.plans.path} ends at batch {plan.batch}: restore the log (stamping from "
                "an older position would skip or repeat messages)"
            )
        if plan is not None:
            self._replay = plan
            self._position = plan.start
            self._next_batch = plan.batch
        self._opened = True
        return self

    def _newest_plan(self) -> StampPlan | None:
        last, rows, _ = self.plans.latest()
        if last is not None and not rows:
            raise CheckpointError(f"{self.plans.path}: the plan of batch {last} is empty")
        plan = StampPlan.from_row(rows[0]) if last is not None else None
        if plan is None:
            plan = spark_stream_plan(self.layout.checkpoint("stamp"))
            if plan is not None:
                log.info("carrying on from the stamping stream's batch %d", plan.batch)
                self.plans.write(plan.batch, [plan.row()])
        return plan

    def run_batch(self) -> BatchResult | None:
        """Stamp the next batch of new files (or run the newest plan again after a restart or
        a failure); ``None`` when there is nothing new.

        Example:
            >>> while stamper.run_batch():  # stamp everything committed so far  # doctest: +SKIP
            ...     pass
        """
        self.open()
        with self._lock:
            try:
                return self._run_batch()
            finally:
                # Counted once done: a first look that replays a large batch and rebuilds
                # the duplicate index after a restart takes seconds (the engine is warm after).
                self.stats.looks += 1

    def _run_batch(self) -> BatchResult | None:
        started = time.monotonic()
        plan = self._replay
        replayed = plan is not None
        if plan is not None:
            files = self.source.between(plan.start, plan.end)
        else:
            files, end = self.source.changes(
                self._position, self.cfg.stamp_max_files, self.cfg.stamp_max_bytes
            )
            if not files:
                self._position = end  # versions that added no data
                return None
            plan = StampPlan(self._next_batch, self._position, end)
            self.fence()  # raises once another engine has taken the lakehouse over
            try:
                self.plans.write(plan.batch, [plan.row()], exclusive=True)
            except FileExistsError as err:
                # Planned by another stamper: fenced since if this engine still holds the
                # lakehouse (else the check raises). Run that plan, as after a restart.
                self.fence()
                self._opened = False
                raise RetryableError(
                    f"stamping batch {plan.batch} was planned by another stamper ({err}); "
                    "running its plan"
                ) from err
        self._replay = plan  # until written: a failure runs this plan again, never a new one
        rows = self.source.read(files)
        read = time.monotonic()
        scheduled, quarantined = self.writer(rows, plan.batch)
        done = time.monotonic()
        self._replay = None
        self._position = plan.end
        self._next_batch = plan.batch + 1
        if plan.batch % KEEP_PLANS == 0 and plan.batch >= KEEP_PLANS:
            self.plans.purge(plan.batch - KEEP_PLANS)
        result = BatchResult(
            plan.batch,
            rows.num_rows,
            scheduled,
            quarantined,
            len(files),
            done - started,
            read - started,
            done - read,
            replayed,
        )
        self.stats.batches += 1
        self.stats.rows += rows.num_rows
        self.stats.scheduled += result.scheduled
        self.stats.quarantined += result.quarantined
        self.stats.recent.append(result)
        return result

    def finish(self) -> tuple[int, Position]:
        """Run the interrupted batch, if any; returns the next batch and where it starts, for
        the streaming query to go on from (:mod:`engine.stamp.query`)."""
        self.open()
        if self._replay is not None:
            self.run_batch()
        return self._next_batch, self._position

    def run_available(self) -> int:
        """Stamp everything committed to ``commitlog`` so far; returns how many rows.

        Example:
            >>> stamper.run_available()  # doctest: +SKIP
            3
        """
        rows = 0
        while (result := self.run_batch()) is not None:
            rows += result.rows
        return rows


def spark_stream_plan(checkpoint: str) -> StampPlan | None:
    """The last batch of the Spark stream that stamped this lakehouse before (``None`` when
    there was none), as a plan to run again: it covers the same files.

    Raises:
        CheckpointError: the stream stopped inside a ``commitlog`` version (a large commit
            cut into several batches); run the earlier version until it is idle first.
    """
    offsets = list_files(f"{checkpoint}/offsets")
    batches = sorted(int(name) for name in offsets if name.isdigit())
    if not batches:
        return None
    last = batches[-1]
    end = _spark_offset(checkpoint, last)
    if str(last) in list_files(f"{checkpoint}/commits"):
        return StampPlan(last, end, end)  # done: nothing to run again, carry on from its end
    start = _spark_offset(checkpoint, last - 1) if last - 1 in batches else Position(0, 0)
    return StampPlan(last, start, end)


def _spark_offset(checkpoint: str, batch: int) -> Position:
    """Where a Spark Delta stream's batch ended, as a :class:`Position`."""
    text = read_text(f"{checkpoint}/offsets/{batch}") or ""
    offset = json.loads(text.splitlines()[-1])
    version, index = int(offset["reservoirVersion"]), int(offset["index"])
    if index == -1:  # before the first file of `version`: every earlier version is done
        return Position(0, 0) if offset.get("isStartingVersion") else Position(version, 0)
    raise CheckpointError(
        f"the stamping stream of an earlier delayq stopped inside commitlog version {version} "
        f"(file {index}; {checkpoint}/offsets/{batch}): run that version until nothing is "
        "left to stamp, then start this one"
    )
