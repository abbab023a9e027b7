"""The delivery stage as a Spark Structured Streaming query, ``delayq-deliver``
(``delivery.mode = streaming``).

The query's source is the clock (:class:`ClockStream`, format ``delayq_clock``): an offset is a
watermark in milliseconds, and each trigger plans the next one, the system clock plus
``delivery.max_lead`` (at most 3/4 of ``delivery.poll_interval``), into Spark's offsets log
before the batch runs. The batch covers (previous watermark, new watermark]: its
``foreachBatch`` runs one delivery round capped at the batch's watermark
(:meth:`~engine.deliver.round.Delivery.run_round` with ``until``). The round keeps its own
exactly-once record, the delayOffset checkpoint: its plan before the first topic write, its
progress after the last, and no topic commit before the clock reaches its watermark. A batch
Spark runs again after a crash replays the round's plan, or finds it committed and delivers
nothing twice; its watermark is never taken below the committed progress.

The round is the driver path's (the rows are read and written as Arrow on the driver): this
query is where Spark's scheduling and progress reporting come in. It triggers every
``delivery.poll_interval``; the checkpoint is ``<lakehouse>/_checkpoints/deliver-query``.

Each batch's progress (``query.lastProgress``, a ``StreamingQueryListener``'s
``onQueryProgress``) carries the round's figures as the observed metrics named ``delayq``:
``delivered_rows`` and ``lateness_avg_ms`` / ``lateness_p99_ms`` / ``lateness_max_ms``
(``delivered_ts - deliver_ts``; the p99 estimated from the lateness buckets, the rest exact).
Spark computes them where it computes any observed metric, over the batch's one row, which
the source reads after the round (the figures reach it as a job property): the batch's
``numInputRows`` is that one row, its watermark. A batch reports at most once a second
(:data:`REPORT_EVERY_S`); one that reports nothing (its round delivered nothing, another
Spark job was running, or the last report is under a second old: its figures then come
summed with the next batch that reports) runs no job for them: its row is not read and its
figures are null.

Example:
    >>> deliver = DeliverQuery(spark, cfg, lay, run_round, start_at)  # doctest: +SKIP
    >>> deliver.start().name  # doctest: +SKIP
    'delayq-deliver'
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit
from pyspark.sql.streaming.query import StreamingQuery

from engine.core.clock import from_millis, to_millis
from engine.core.config import EngineConfig
from engine.core.errors import CheckpointError
from engine.deliver.lateness import Lateness
from engine.deliver.quiet import Quiet, load_quiet, next_offset, save_quiet
from engine.lakehouse.catalog.session import QuietStreamReader, carrying_s3, link_checkpoints
from engine.lakehouse.delta.delta_log import commit_exists
from engine.lakehouse.storage.fs import spark_offset
from engine.lakehouse.storage.layout import Layout
from engine.lakehouse.storage.location import arrive
from engine.stamp.query import query_failure

log = logging.getLogger(__name__)

QUERY_NAME = "delayq-deliver"
SOURCE_FORMAT = "delayq_clock"
CHECKPOINT = "deliver-query"
#: The name of the observed metrics each batch's progress carries.
METRICS = "delayq"
#: The Spark job property that hands a batch's figures to its source's read.
FIGURES_PROPERTY = "delayq.deliver.figures"
#: The shortest time between two batches that report figures (the rounds between come summed
#: with the next): a report is a Spark job; one each batch (5 a second) took a steady flow's
#: p99 at 50,000 msg/s from 409 to 546 ms in one run on 2 cores.
REPORT_EVERY_S = 1.0
#: The observed metrics, in the order the source's row holds them after its watermark.
FIGURES = ("delivered_rows", "lateness_avg_ms", "lateness_p99_ms", "lateness_max_ms")


@dataclass(frozen=True)
class Delivered:
    """What a delivery batch's round did: its record for holding the clock (``None``: no
    hold) and the lateness of the rows it delivered."""

    quiet: Quiet | None
    lateness: Lateness = field(default_factory=Lateness)


def figures(lateness: Lateness) -> dict[str, float]:
    """A round's figures as a batch's observed metrics report them (:data:`FIGURES`).

    Example:
        >>> figures(Lateness((0, 0, 4) + (0,) * 9, 0.6, 4, 0.2))["lateness_max_ms"]
        200.0
    """
    n = lateness.n
    return {
        "delivered_rows": n,
        "lateness_avg_ms": round(lateness.total_s / n * 1000, 3) if n else 0.0,
        "lateness_p99_ms": round(lateness.quantile(0.99) * 1000, 3),
        "lateness_max_ms": round(lateness.max_s * 1000, 3),
    }


def batch_figures(progress: Any) -> dict[str, float] | None:
    """The ``delayq`` figures a delivery batch's progress carries (``None``: none, as for
    a batch Spark ran before the engine reported them; a batch that reported nothing has
    them all 0).

    Example:
        >>> batch_figures(engine.deliver_query.query.lastProgress)  # doctest: +SKIP
        {'delivered_rows': 1000, 'lateness_avg_ms': 61.2, 'lateness_p99_ms': 142.0, ...}
    """
    observed = getattr(progress, "observedMetrics", None) or {}
    row = observed.get(METRICS)
    if row is None:
        return None
    values = row.asDict()
    return {name: float(values[name] or 0) for name in FIGURES if name in values}


def _observed() -> list[Any]:
    """The batch's observed metrics over its row: the rows summed, the lateness its own."""
    return [F.sum(FIGURES[0]).alias(FIGURES[0])] + [F.max(n).alias(n) for n in FIGURES[1:]]


class ClockStream(DataSource):
    """The clock as a Spark streaming source: offsets are watermarks in milliseconds.

    Options: ``start`` (the first offset, ms), ``lead`` (how far ahead of the clock a batch is
    planned, ms); to hold the offset while nothing can fall due (:mod:`engine.deliver.quiet`):
    ``quiet`` (the local file of the last round's record), ``idle`` (the longest hold, ms),
    ``poll`` (the trigger interval, ms),
    ``schedule`` and ``commands`` (the tables whose new versions end a hold).
    """

    #: The S3 settings of the lakehouse (``S3Settings`` fields), set by :func:`clock_stream`
    #: on a class made for one query.
    s3: ClassVar[dict[str, Any] | None] = None

    @classmethod
    def name(cls) -> str:
        return SOURCE_FORMAT

    def schema(self) -> str:
        return "watermark_ms long, delivered_rows long, " + ", ".join(
            f"{name} double" for name in FIGURES[1:]
        )

    def streamReader(self, schema: object) -> DataSourceStreamReader:
        return ClockReader(dict(self.options), self.s3)


def clock_stream(schedule: str) -> type[ClockStream]:
    """The source class for a lakehouse whose ``schedule`` is at ``schedule``, carrying its
    S3 settings if any.

    Example:
        >>> clock_stream("/lake/schedule").name()
        'delayq_clock'
    """
    return carrying_s3(ClockStream, schedule)


class ClockReader(QuietStreamReader):
    """Plans each batch's watermark from the clock (see :class:`ClockStream`); a batch holds
    one row, its watermark and the figures of the round it ran (:data:`FIGURES`)."""

    def __init__(self, options: dict[str, str], s3: dict[str, Any] | None = None) -> None:
        self.start_ms = int(options["start"])
        self.lead_ms = int(options["lead"])
        self.quiet = options.get("quiet", "")
        self.idle_ms = int(options.get("idle", "0"))
        self.poll_ms = int(options.get("poll", "0"))
        self.schedule = options.get("schedule", "")
        self.commands = options.get("commands", "")
        self.s3 = s3
        self._arrived = False

    def initialOffset(self) -> dict[str, int]:
        return {"ms": self.start_ms}

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        start_ms = int(start["ms"])
        now = int(time.time() * 1000)
        planned = max(start_ms, now + self.lead_ms)
        if self.quiet:  # (holds while nothing can be due: the same offset, no batch)
            # (a batch may be planned at a row's time up to a poll interval on, as the round
            # will take it; not without a lead)
            reach = max(planned, now + self.poll_ms) if self.lead_ms > 0 else planned
            quiet = load_quiet(self.quiet)
            planned = next_offset(quiet, start_ms, planned, reach, self.idle_ms, self._newer)
        return {"ms": planned}

    def _newer(self, quiet: Quiet) -> bool:
        """Whether ``schedule`` or ``commands`` has a version after the record's (or it cannot
        tell: a hold is an optimisation, and never worth a failed query)."""
        try:
            if not self._arrived:
                arrive(self.schedule, self.s3)
                self._arrived = True
            return commit_exists(self.schedule, quiet.schedule + 1) or commit_exists(
                self.commands, quiet.commands + 1
            )
        except Exception:
            log.warning("could not look for new versions; no hold", exc_info=True)
            return True

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        return [InputPartition(int(end["ms"]))]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        from pyspark import TaskContext  # (the executor's: the job's properties)

        context = TaskContext.get()
        said = context.getLocalProperty(FIGURES_PROPERTY) if context is not None else None
        found = json.loads(said) if said else {}
        yield (int(partition.value), int(found.get(FIGURES[0], 0)),
               *(float(found.get(name, 0.0)) for name in FIGURES[1:]))  # fmt: skip

    def commit(self, end: dict[str, int]) -> None:
        return None


def batch_watermark(checkpoint: str, batch_id: int) -> datetime:
    """The watermark Spark's offsets log holds for ``batch_id`` of the delivery query.

    Raises:
        CheckpointError: the batch has no offset (the checkpoint was tampered with).

    Example:
        >>> batch_watermark("/lake/_checkpoints/deliver-query", 41)  # doctest: +SKIP
        datetime.datetime(2026, 11, 27, 20, 1, 2, 150000, tzinfo=datetime.timezone.utc)
    """
    offset = spark_offset(checkpoint, batch_id)
    if offset is None:
        raise CheckpointError(f"{checkpoint}/offsets/{batch_id}: no offset of {SOURCE_FORMAT}")
    return from_millis(int(offset["ms"]))


class DeliverQuery:
    """The ``delayq-deliver`` streaming query (see the module's description).

    Args:
        spark: the engine's session.
        cfg: the poll interval and the lead.
        layout: the lakehouse (the query's checkpoint).
        deliver: runs one round capped at the watermark it is given (the engine's, which
            also names new tables and tells listeners), and returns what the round did
            (:class:`Delivered`).
        start_at: the watermark the query starts from the first time (the committed
            progress); later starts go on from Spark's checkpoint.
    """

    def __init__(
        self,
        spark: SparkSession,
        cfg: EngineConfig,
        layout: Layout,
        deliver: Callable[[datetime], Delivered],
        start_at: Callable[[], datetime],
    ) -> None:
        self.spark = spark
        self.cfg = cfg
        self.layout = layout
        self.checkpoint = layout.checkpoint(CHECKPOINT)
        self.deliver = deliver
        self.start_at = start_at
        self.query: StreamingQuery | None = None
        self.error: BaseException | None = None  # what the last failed batch raised
        self._lock = threading.Lock()
        self._folder = ""  # a local folder of this run's quiet record
        self._quiet = ""  # that record's file (empty: no holds)
        self._unreported = Lateness()  # rounds whose figures no batch has reported yet
        self._reporting = True  # (off after a failed report, until the next start)
        self.reported: dict[str, float] | None = None  # the last figures reported
        self.report_every_s = REPORT_EVERY_S
        self._next_report = 0.0  # (time.monotonic())

    def _run(self, frame: DataFrame, batch_id: int) -> None:
        """``foreachBatch``: one delivery round capped at the batch's watermark, then the
        record the clock source holds the next offset by, and the round's figures."""
        self._record(None)  # (a round that fails leaves none)
        try:
            done = self.deliver(batch_watermark(self.checkpoint, batch_id))
        except BaseException as err:
            self.error = err
            raise
        self._record(done.quiet)
        self._unreported += done.lateness
        self._report(frame)

    def _report(self, frame: DataFrame) -> None:
        """Read the batch's row with the figures of the rounds not reported yet, which makes
        Spark compute the batch's observed metrics. Best effort (the round is committed):
        not while another Spark job runs (a round written ahead, a stamping batch's tasks),
        which the job would wait behind, holding the next batch back; those rounds' figures
        come with the next batch that reports. No job when there is nothing to report (an
        idle engine), within :data:`REPORT_EVERY_S` of the last report, or after a report
        failed, until the query starts again."""
        if not (self._unreported.n and self._reporting) or time.monotonic() < self._next_report:
            return
        context = self.spark.sparkContext
        try:
            if context.statusTracker().getActiveJobsIds():
                return
            said = figures(self._unreported)
            context.setLocalProperty(FIGURES_PROPERTY, json.dumps(said))
            frame.collect()
            self._unreported, self.reported = Lateness(), said
            self._next_report = time.monotonic() + self.report_every_s
        except Exception as err:
            self._reporting = False
            log.warning("%s: its batches' figures are not reported until it starts again (%s)",
                        QUERY_NAME, err, exc_info=True)  # fmt: skip
        finally:
            with contextlib.suppress(Exception):
                context.setLocalProperty(FIGURES_PROPERTY, None)  # type: ignore[arg-type]

    def _record(self, quiet: Quiet | None) -> None:
        """Leave ``quiet`` for the clock source (best effort: without a record it holds
        nothing, which is always safe)."""
        if not self._quiet:
            return
        try:
            save_quiet(self._quiet, quiet)
        except OSError:
            log.warning("could not write %s; no hold", self._quiet, exc_info=True)
            with contextlib.suppress(OSError):
                save_quiet(self._quiet, None)

    def start(self) -> StreamingQuery:
        """Start the query in the background, a trigger every ``delivery.poll_interval``.

        Example:
            >>> deliver.start().name  # doctest: +SKIP
            'delayq-deliver'
        """
        lead = min(self.cfg.max_lead_ms, self.cfg.poll_interval_ms * 3 // 4)
        with self._lock:
            if self.query is not None and self.query.isActive:
                raise RuntimeError(f"{QUERY_NAME} is running")
            self.error = None
            self._reporting = True
            link_checkpoints(self.spark)
            self.spark.dataSource.register(clock_stream(self.layout.schedule))
            if self._folder:  # (a restart after a failure: the last run's record goes)
                shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = self._quiet = ""
            if self.cfg.idle_interval_ms > 0:
                self._folder = tempfile.mkdtemp(prefix="delayq-clock-")
                self._quiet = os.path.join(self._folder, "quiet.json")
            frame = (
                self.spark.readStream.format(SOURCE_FORMAT)
                .option("start", str(to_millis(self.start_at())))
                .option("lead", str(max(0, lead)))
                .option("quiet", self._quiet)
                .option("idle", str(self.cfg.idle_interval_ms))
                .option("poll", str(self.cfg.poll_interval_ms))
                .option("schedule", self.layout.schedule)
                .option("commands", self.layout.commands)
                .load()
                .observe(METRICS, *_observed())
            )
            self.query = (
                frame.writeStream.queryName(QUERY_NAME)
                .option("checkpointLocation", self.checkpoint)
                .foreachBatch(self._run)
                .trigger(processingTime=f"{self.cfg.poll_interval_ms} milliseconds")
                .start()
            )
            return self.query

    def failure(self) -> BaseException | None:
        """Why the query stopped, if it stopped with an error (the round's own exception when
        a round raised it), else ``None``."""
        return query_failure(self.query, self.error)

    def figures(self) -> dict[str, float] | None:
        """The figures the newest batch that reported some gave Spark's progress (``None``:
        none yet), kept here: no call to Spark.

        Example:
            >>> deliver.figures()["lateness_p99_ms"]  # doctest: +SKIP
            142.0
        """
        return self.reported

    def stop(self) -> None:
        """Stop the query; a round in progress is replayed from its plan at the next start."""
        with self._lock:
            if self.query is not None:
                self.query.stop()
            if self._folder:
                shutil.rmtree(self._folder, ignore_errors=True)
                self._folder = ""
