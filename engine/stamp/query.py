"""The stamping stage as a Spark Structured Streaming query, ``delayq-stamp``
(``stamp.mode = streaming``).

The query reads ``commitlog`` through a Python streaming source of its own
(:class:`CommitlogStream`, format ``delayq_commitlog``): an offset is a
:class:`~engine.lakehouse.delta.appends.Position` (a ``commitlog`` version and the index of
the next data file it added), planned on the driver from the Delta log exactly as the driver
path plans its batches (``stamp.max_files_per_batch``, ``stamp.max_bytes_per_batch``), and
written to Spark's offsets log before the batch runs. The source's rows are the batch's data
files (a partition per group of about equal bytes), which Spark tasks read, stamp and write.

Its ``foreachBatch`` stamps the batch and appends it to ``schedule`` and ``quarantine``
(:class:`~engine.stamp.writer.StampWriter`): each commit records the stamping batch as the
``txn`` of ``delayq-stamp``, so a batch Spark runs again after a crash (its offsets written,
its commit not) covers the same files and stores nothing twice.

A batch over ``stamp.driver_batch_bytes`` is stamped and written by Spark tasks, its rows
never collected on the driver (:mod:`engine.stamp.tasks`); a smaller one is read and written
on the driver, where a Spark job would cost more than the work.

The query's checkpoint is ``<lakehouse>/_checkpoints/stamp-query``. Stamping batch numbers go
on from where the driver path stopped: the first start takes the driver path's position and
next batch (after running its interrupted batch, if any) and keeps them in the checkpoint's
``delayq.json``; stamping batch = that first batch + Spark's batch id.

Seen where Spark users look: ``spark.streams.active``, the UI's Structured Streaming tab and
a ``StreamingQueryListener``'s progress events, with the query named ``delayq-stamp``.

Example:
    >>> stamping = StampQuery(spark, cfg, lay, clock).open()  # doctest: +SKIP
    >>> stamping.run_available()  # doctest: +SKIP
    3
    >>> stamping.start(); stamping.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import LongType, StringType, StructField, StructType

from engine.core.clock import Clock
from engine.core.config import EngineConfig
from engine.core.errors import CheckpointError
from engine.core.groups import balanced
from engine.lakehouse.catalog.session import QuietStreamReader, carrying_s3, link_checkpoints
from engine.lakehouse.delta.appends import Added, CommitlogSource, Position
from engine.lakehouse.state.lease import unfenced
from engine.lakehouse.state.offset_log import OffsetLog
from engine.lakehouse.storage.fs import put_if_absent, read_text, spark_next_batch, spark_offset
from engine.lakehouse.storage.layout import Layout
from engine.lakehouse.storage.location import arrive
from engine.stamp.stamper import KEEP_PLANS, BatchResult, Stamper, StampPlan, StampStats
from engine.stamp.stamper import QUERY_CHECKPOINT as CHECKPOINT
from engine.stamp.stamper import QUERY_START_FILE as START_FILE
from engine.stamp.tasks import stamp_on_executors
from engine.stamp.writer import StampWriter

log = logging.getLogger(__name__)

QUERY_NAME = "delayq-stamp"
#: How often an idle look checks for the next ``commitlog`` version on a local lakehouse
#: (``stamp.idle_wait``; an object store is asked every ``stamp.interval``).
IDLE_POLL_MS = 10
SOURCE_FORMAT = "delayq_commitlog"
#: The source's rows: a batch's ``commitlog`` data files (Spark tasks read them,
#: :mod:`engine.stamp.tasks`), a partition per group of about equal bytes.
FILES = StructType(
    [
        StructField("index", LongType()),
        StructField("path", StringType()),
        StructField("size", LongType()),
    ]
)
_CHECKPOINT_ERROR = re.compile(r"CheckpointError: (.+)")
_PYTHON_ERROR = re.compile(r"^(\w+): (.*)$", re.MULTILINE)


class CommitlogStream(DataSource):
    """``commitlog`` as a Spark streaming source; the options say where and from where.

    Options: ``path`` (the table), ``start`` (the first offset, JSON of a position),
    ``max_files`` and ``max_bytes`` (a batch's budget). An S3 lakehouse's settings travel
    with the class (see :func:`commitlog_stream`), never in the options, which Spark shows.
    """

    #: The S3 settings of the lakehouse (``S3Settings`` fields), set by
    #: :func:`commitlog_stream` on a class made for one query.
    s3: ClassVar[dict[str, Any] | None] = None

    @classmethod
    def name(cls) -> str:
        return SOURCE_FORMAT

    def schema(self) -> StructType:
        return FILES

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return CommitlogReader(dict(self.options), self.s3)


def commitlog_stream(path: str) -> type[CommitlogStream]:
    """The source class for the ``commitlog`` at ``path``, carrying its S3 settings if any.

    Example:
        >>> commitlog_stream("/lake/commitlog").name()
        'delayq_commitlog'
    """
    return carrying_s3(CommitlogStream, path)


def _position(offset: dict[str, int]) -> Position:
    return Position(int(offset["version"]), int(offset["index"]))


def _offset(position: Position) -> dict[str, int]:
    return {"version": position.version, "index": position.index}


class CommitlogReader(QuietStreamReader):
    """Plans batches from ``commitlog``'s Delta log (on the driver) and reads their files (on
    executors); see :class:`CommitlogStream`."""

    def __init__(self, options: dict[str, str], s3: dict[str, Any] | None) -> None:
        self.path = options["path"]
        self.start = json.loads(options["start"])
        self.max_files = int(options["max_files"])
        self.max_bytes = int(options["max_bytes"])
        self.tasks = int(options.get("tasks", "1"))
        self.idle_wait = int(options.get("idle_wait_ms", "0")) / 1000
        self.idle_poll = int(options.get("idle_poll_ms", "10")) / 1000
        self.s3 = s3
        self._source: CommitlogSource | None = None
        self._idle = False  # the last look found nothing new
        # A batch the driver stamped before the query started: Spark's batch from its start
        # must end where the driver's did (StampQuery.prerun).
        self.firsts: list[tuple[Position, dict[str, int]]] = [
            (_position(f["start"]), f["end"]) for f in json.loads(options.get("first", "[]"))
        ]

    def _commitlog(self) -> CommitlogSource:
        if self._source is None:
            arrive(self.path, self.s3)
            self._source = CommitlogSource(self.path)
        return self._source

    def initialOffset(self) -> dict[str, int]:
        return dict(self.start)

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        """The end of the next batch; after a look that found nothing, waits up to
        ``idle_wait_ms`` for a new version first (see ``stamp.idle_wait``)."""
        for first, planned in self.firsts:
            if _position(start) == first:
                return dict(planned)
        source, position = self._commitlog(), _position(start)
        files, end = source.changes(position, self.max_files, self.max_bytes)
        if not files and self._idle and self.idle_wait > 0:
            deadline = time.monotonic() + self.idle_wait
            while not files and time.monotonic() < deadline:
                time.sleep(self.idle_poll)
                files, end = source.changes(position, self.max_files, self.max_bytes)
        self._idle = not files
        return _offset(end)

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        files = self._commitlog().between(_position(start), _position(end))
        return [InputPartition(group) for group in file_groups(files, self.tasks)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        rows: list[tuple[int, str, int]] = partition.value
        yield pa.RecordBatch.from_arrays(
            [
                pa.array([r[0] for r in rows], pa.int64()),
                pa.array([r[1] for r in rows], pa.string()),
                pa.array([r[2] for r in rows], pa.int64()),
            ],
            names=FILES.fieldNames(),
        )

    def commit(self, end: dict[str, int]) -> None:
        return None


def file_groups(files: Sequence[Added], tasks: int) -> list[list[tuple[int, str, int]]]:
    """A batch's files as ``(index in the batch, path, bytes)``, in at most ``tasks`` groups of
    about equal bytes (the largest first into the lightest group), each in batch order.

    Example:
        >>> files = [Added(0, i, f"/l/f{i}", size) for i, size in enumerate([9, 1, 1, 7])]
        >>> [[f[0] for f in group] for group in file_groups(files, 2)]
        [[0], [1, 2, 3]]
    """
    groups = balanced([f.size for f in files], tasks)
    return [[(i, files[i].path, files[i].size) for i in group] for group in groups]


def _planned(checkpoint: str, batch_id: int) -> Position:
    """The end offset of Spark's batch ``batch_id`` (the source's line of its offsets file).

    Raises:
        CheckpointError: the file is missing or holds no offset of this source.
    """
    offset = spark_offset(checkpoint, batch_id)
    if offset is None:
        raise CheckpointError(f"{checkpoint}/offsets/{batch_id}: no offset of {SOURCE_FORMAT}")
    return _position(offset)


def python_cause(err: BaseException) -> BaseException:
    """What a failure of delayq's Python code in a Spark worker was, read from the traceback
    Spark wraps it in (planning runs in a Python worker of the driver, reading in the
    executors'): a :class:`CheckpointError` it raised, or a bug (Python's own errors, other
    than ``OSError``'s) as a ``RuntimeError`` that stops the stage at once; else ``err``.

    Example:
        >>> python_cause(RuntimeError("Traceback ...\\nKeyError: 'ms'"))
        RuntimeError("a bug in a Spark worker's Python: KeyError: 'ms'")
    """
    text = str(err)
    if "Traceback" not in text:
        return err
    found = _CHECKPOINT_ERROR.search(text)
    if found:
        return CheckpointError(found.group(1))
    raised = [
        (name, message)
        for name, message in _PYTHON_ERROR.findall(text)
        if isinstance(kind := getattr(builtins, name, None), type) and issubclass(kind, Exception)
    ]
    if raised:
        name, message = raised[-1]  # the exception that ended the traceback
        if not issubclass(getattr(builtins, name), OSError):
            return RuntimeError(f"a bug in a Spark worker's Python: {name}: {message}")
    return err


def query_failure(
    query: StreamingQuery | None, raised: BaseException | None
) -> BaseException | None:
    """Why a stage's query stopped, if it stopped with an error: what its batch ``raised``
    when it raised, else Spark's error, each read by :func:`python_cause`; ``None`` while it
    runs or when it stopped cleanly.

    Example:
        >>> query_failure(None, None) is None
        True
    """
    if query is None or query.isActive:
        return None
    spark_error = query.exception()
    if spark_error is None:
        return None
    return python_cause(raised or spark_error)


def newest_plan(layout: Layout) -> StampPlan | None:
    """The newest stamping batch planned on this lakehouse (``None``: none yet), by the driver
    path or the query (which records each batch with files there too), for maintenance to
    know what stamping has read.

    Example:
        >>> newest_plan(lay)  # doctest: +SKIP
        StampPlan(batch=41, start=Position(version=40, index=0), end=...)
    """
    last, rows, _ = OffsetLog(layout.checkpoint("stamp") + "/batches").latest()
    return StampPlan.from_row(rows[0]) if last is not None and rows else None


@dataclasses.dataclass(frozen=True)
class QueryStart:
    """Where the query began: Spark's batch 0 is stamping batch ``first_batch`` and starts at
    ``start`` in ``commitlog``."""

    first_batch: int
    start: Position


class StampQuery:
    """The ``delayq-stamp`` streaming query over one lakehouse (see the module's description).

    The constructor holds what it is given; :meth:`open` reads (or, the first time, fixes)
    where the query starts.

    Args:
        spark: the engine's session.
        cfg: levels, limits and the batch budget.
        layout: the lakehouse.
        clock: the stamping time of each batch.
        fence: called before a batch writes; raises once this engine no longer holds the
            lakehouse.
    """

    def __init__(
        self,
        spark: SparkSession,
        cfg: EngineConfig,
        layout: Layout,
        clock: Clock,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.spark = spark
        self.cfg = cfg
        self.layout = layout
        self.clock = clock
        self.fence = fence or unfenced
        self.checkpoint = layout.checkpoint(CHECKPOINT)
        self.writer = StampWriter(cfg, layout, clock)
        self.source = CommitlogSource(layout.commitlog)
        self.plans = OffsetLog(layout.checkpoint("stamp") + "/batches")
        self.stats = StampStats()
        self.query: StreamingQuery | None = None
        self.error: BaseException | None = None  # what the last failed batch raised
        self._begin: QueryStart | None = None
        self._lock = threading.Lock()
        self._firsts: list[StampPlan] = []  # claimed by plan_first for Spark's next batches
        self._firsts_done: set[int] = set()  # ... those stamp_first (or the query) stamped
        self._first_lock = threading.Lock()  # held while stamp_first runs
        self._ran = 0  # batches Spark ran (a batch stamp_first did counts too)

    def has_state(self) -> bool:
        """Whether this lakehouse has been stamped before (by this query or the driver path)."""
        if read_text(f"{self.checkpoint}/{START_FILE}") is not None:
            return True
        return self._driver().has_state()

    def _driver(self) -> Stamper:
        return Stamper(self.spark, self.cfg, self.layout, self.clock, self.fence)

    def open(self) -> StampQuery:
        """Read where the query starts; the first time, finish the driver path's interrupted
        batch and start after it. Returns ``self``."""
        if self._begin is not None:
            return self
        text = read_text(f"{self.checkpoint}/{START_FILE}")
        if text is None:
            driver = self._driver().open()
            begin = QueryStart(*driver.finish())
            row = {"first_batch": begin.first_batch, **_offset(begin.start)}
            put_if_absent(f"{self.checkpoint}/{START_FILE}", (json.dumps(row) + "\n").encode())
            text = read_text(f"{self.checkpoint}/{START_FILE}")
            if not text:
                raise CheckpointError(f"{self.checkpoint}/{START_FILE} is missing or empty")
        row = json.loads(text)
        begin = QueryStart(int(row["first_batch"]), _position(row))
        self._begin = begin
        return self

    def plan_first(self) -> list[StampPlan]:
        """Before the query starts (Spark takes seconds to start it), claim its next batch for
        :meth:`stamp_first` to stamp on the driver meanwhile: messages sent before a restart
        are then stamped at once. It is the batch Spark's next one will be, over the same
        files: the range Spark planned for it before a crash, else the range claimed for it
        by a start that stopped before Spark ran it, else the new files up to the budget.
        Every start of the query plans a claimed batch's range exactly
        (:meth:`_first_offsets`), and the query finds the batch done. Empty when there is
        nothing to stamp, or the batch is for Spark tasks (over ``stamp.driver_batch_bytes``).

        Raises:
            CheckpointError: the stamping log holds another range for that batch.

        Example:
            >>> stamping.plan_first()  # doctest: +SKIP
            [StampPlan(batch=42, start=Position(version=40, index=0), end=...)]
        """
        self.open()
        start, batch = self._next_start()
        logged = spark_offset(self.checkpoint, batch - self._first_batch())  # before a crash
        claimed = self._claimed(batch)
        if logged is not None:
            end = _position(logged)
        elif claimed is not None:
            end = claimed.end  # (checked against the start by _claim)
        else:
            _, end = self.source.changes(start, self.cfg.stamp_max_files, self.cfg.stamp_max_bytes)
        files = self.source.between(start, end)
        if not files or sum(f.size for f in files) > self.cfg.stamp_driver_bytes:
            return []
        with self._lock:
            if self.query is not None and self.query.isActive:
                raise RuntimeError(f"{QUERY_NAME} is running: it plans its batches itself")
            self.fence()
            plan = StampPlan(batch, start, end)
            self._claim(plan)
            self._firsts, self._firsts_done = [plan], set()
        self.writer.warm(batch, hold=True)  # (read while the queries start, after its lookup)
        return [plan]

    def _first_batch(self) -> int:
        assert self._begin is not None
        return self._begin.first_batch

    def _next_start(self) -> tuple[Position, int]:
        """Where Spark's next batch starts in ``commitlog``, and its stamping batch."""
        assert self._begin is not None
        spark_batch = spark_next_batch(self.checkpoint)
        start = self._begin.start
        if spark_batch > 0:
            start = _planned(self.checkpoint, spark_batch - 1)
        return start, self._begin.first_batch + spark_batch

    def _claimed(self, batch: int) -> StampPlan | None:
        """The range the stamping log holds for ``batch``, if any."""
        try:
            rows = self.plans.read(batch)
        except FileNotFoundError:
            return None
        return StampPlan.from_row(rows[0]) if rows else None

    def stamp_first(self) -> list[BatchResult]:
        """Stamp the batches :meth:`plan_first` claimed, on the driver (the query's run of
        such a batch waits for it, then finds it done); what each did.

        Example:
            >>> [r.rows for r in stamping.stamp_first()]  # doctest: +SKIP
            [1000]
        """
        results = []
        for plan in self._firsts:
            with self._first_lock:
                if plan.batch in self._firsts_done:
                    continue
                started = time.monotonic()
                self.fence()
                files = self.source.between(plan.start, plan.end)
                rows = self.source.read(files)
                read = time.monotonic()
                scheduled, quarantined = self.writer(rows, plan.batch)
                self._firsts_done.add(plan.batch)
            done = time.monotonic()
            result = BatchResult(
                plan.batch, rows.num_rows, scheduled, quarantined, len(files),
                done - started, read - started, done - read, where="driver",
            )  # fmt: skip
            self._count(result)
            results.append(result)
        return results

    def _count(self, result: BatchResult) -> None:
        stats = self.stats
        stats.batches += 1
        stats.rows += result.rows
        stats.scheduled += result.scheduled
        stats.quarantined += result.quarantined
        stats.recent.append(result)

    def _stream(self, available_now: bool = False) -> DataFrame:
        assert self._begin is not None
        # An idle look waits for the next commit (not with availableNow: it ends when idle).
        wait = 0 if available_now else self.cfg.stamp_idle_wait_ms
        poll = self.cfg.stamp_interval_ms if self.cfg.on_object_store else IDLE_POLL_MS
        link_checkpoints(self.spark)
        self.spark.dataSource.register(commitlog_stream(self.layout.commitlog))
        return (
            self.spark.readStream.format(SOURCE_FORMAT)
            .option("path", self.layout.commitlog)
            .option("start", json.dumps(_offset(self._begin.start)))
            .option("max_files", str(self.cfg.stamp_max_files))
            .option("max_bytes", str(self.cfg.stamp_max_bytes))
            .option("tasks", str(self.spark.sparkContext.defaultParallelism))
            .option("idle_wait_ms", str(wait))
            .option("idle_poll_ms", str(poll))
            .option("first", json.dumps(self._first_offsets()))
            .load()
        )

    def _first_offsets(self) -> list[dict[str, dict[str, int]]]:
        """The range claimed for Spark's next batch before Spark planned it (by
        :meth:`plan_first`, in this process or one that stopped or died since): the source
        must plan exactly it, whichever start of the query comes next."""
        start, batch = self._next_start()
        if spark_offset(self.checkpoint, batch - self._first_batch()) is not None:
            return []  # Spark planned it: it runs that range again
        claimed = self._claimed(batch)
        if claimed is None or claimed.start != start:
            return []  # (another start: _claim refuses what does not match)
        return [{"start": _offset(claimed.start), "end": _offset(claimed.end)}]

    def _run(self, frame: DataFrame, batch_id: int) -> None:
        """``foreachBatch``: stamp Spark's batch ``batch_id`` (stamping batch first + it)."""
        assert self._begin is not None
        self._ran += 1
        try:
            self.fence()  # raises once another engine has taken the lakehouse over
            start, end = self._range(batch_id)
            plan = StampPlan(self._begin.first_batch + batch_id, start, end)
            if plan not in self._firsts:
                self._batch(frame, plan)
                return
            with self._first_lock:  # (stamp_first may be stamping it: wait for it)
                if plan.batch not in self._firsts_done:
                    self._batch(frame, plan)
                    self._firsts_done.add(plan.batch)
        except BaseException as err:
            self.error = err
            raise

    def _batch(self, frame: DataFrame, plan: StampPlan) -> None:
        started = time.monotonic()
        files = self.source.between(plan.start, plan.end)
        if files:
            self._claim(plan)
        where = "executors"
        if sum(f.size for f in files) <= self.cfg.stamp_driver_bytes:
            where = "driver"  # small: read and written here, no Spark job (stamp.mode)
            rows = self.source.read(files)
            read = time.monotonic()
            scheduled, quarantined = self.writer(rows, plan.batch)
            count = rows.num_rows
        else:  # Spark tasks read, stamp and write the files; the driver commits them
            read = started
            scheduled, quarantined = stamp_on_executors(frame, self.writer, plan.batch, self.fence)
            count = scheduled + quarantined
        done = time.monotonic()
        result = BatchResult(
            plan.batch, count, scheduled, quarantined, len(files), done - started,
            read - started, done - read, where=where,
        )  # fmt: skip
        self._count(result)

    def _claim(self, plan: StampPlan) -> None:
        """Record the batch's files in the stamping log under its number, put-if-absent, as
        the driver path plans: one range per stamping batch, whoever runs it.

        Raises:
            CheckpointError: the number already names other files (Spark's offsets log was
                lost or rewritten since the batch first ran, or a driver-path engine fenced
                since stamped it): writing would skip or repeat messages.
        """
        try:
            self.plans.write(plan.batch, [plan.row()], exclusive=True)
        except FileExistsError:
            held = [StampPlan.from_row(r) for r in self.plans.read(plan.batch)]
            if held != [plan]:
                raise CheckpointError(
                    f"stamping batch {plan.batch} covers {plan.start}..{plan.end} in "
                    f"{CHECKPOINT}'s offsets log but {held} in the stamping log "
                    f"{self.plans.path}: restore the query's checkpoint (stamping another "
                    "range under this number would skip or repeat messages)"
                ) from None
        if plan.batch % KEEP_PLANS == 0 and plan.batch >= KEEP_PLANS:
            self.plans.purge(plan.batch - KEEP_PLANS)

    def _range(self, batch_id: int) -> tuple[Position, Position]:
        """Where Spark's batch ``batch_id`` starts and ends in ``commitlog``, from the query's
        offsets log (written before the batch runs)."""
        assert self._begin is not None
        end = _planned(self.checkpoint, batch_id)
        start = self._begin.start if batch_id == 0 else _planned(self.checkpoint, batch_id - 1)
        return start, end

    def start(self) -> StreamingQuery:
        """Start the query in the background, a trigger every ``stamp.interval``.

        Example:
            >>> query = stamping.start(); query.name  # doctest: +SKIP
            'delayq-stamp'
        """
        return self._start(available_now=False)

    def _start(self, available_now: bool) -> StreamingQuery:
        self.open()
        with self._lock:
            if self.query is not None and self.query.isActive:
                raise RuntimeError(f"{QUERY_NAME} is running")
            self.error = None
            # The taken ids, read while Spark starts the query (seconds with millions),
            # unless stamp_first runs: it reads them, or waits for plan_first's reading.
            assert self._begin is not None
            if self._first_lock.acquire(blocking=False):
                try:
                    self.writer.warm(self._begin.first_batch + spark_next_batch(self.checkpoint))
                finally:
                    self._first_lock.release()
            writer = (
                self._stream(available_now)
                .writeStream.queryName(QUERY_NAME)
                .option("checkpointLocation", self.checkpoint)
                .foreachBatch(self._run)
            )
            if available_now:
                writer = writer.trigger(availableNow=True)
            else:
                writer = writer.trigger(processingTime=f"{self.cfg.stamp_interval_ms} milliseconds")
            self.query = writer.start()
            return self.query

    def run_available(self) -> int:
        """Stamp everything committed to ``commitlog`` so far (an ``availableNow`` run of the
        query); returns how many rows.

        Example:
            >>> stamping.run_available()  # doctest: +SKIP
            3
        """
        before = self.stats.rows
        while True:  # (Spark may run one batch per availableNow run of a Python source)
            ran = self._ran
            query = self._start(available_now=True)
            try:
                query.awaitTermination()
            except Exception as err:
                raise python_cause(self.error or err) from err
            self.stats.looks += 1
            if self._ran == ran:
                return self.stats.rows - before

    def warm(self) -> bool:
        """Whether the query has finished a first trigger (or a run of what was available)."""
        query = self.query
        return self.stats.looks > 0 or (query is not None and query.lastProgress is not None)

    def failure(self) -> BaseException | None:
        """Why the query stopped, if it stopped with an error (the batch's own exception
        when a batch raised it), else ``None``."""
        return query_failure(self.query, self.error)

    def stop(self) -> None:
        """Stop the query; a batch in progress is run again at the next start."""
        with self._lock:
            if self.query is not None:
                self.query.stop()
