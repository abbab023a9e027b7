"""The delivery stage: move due ``schedule`` rows into their topic tables, exactly once.

Each round ``k`` fixes a plan: a watermark ``W_k`` (its cutoff time) and the ``schedule``
version ``V_k`` it reads. It delivers, from that snapshot, the rows with::

    deliver_ts <= W_k  AND  (deliver_ts > W_{k-1}  OR  stamp_batch > S_{k-1})

where ``W_{k-1}``/``S_{k-1}`` come from the committed progress: rows that became due since
the last round, plus rows stamped since then that are already due (messages stamped late
are not lost behind an advanced watermark). :mod:`engine.deliver.due` reads them.

A round runs on the driver, without a Spark job unless it has cancel or reschedule commands
to decide: the snapshot is read and the topic tables are appended through delta-rs
(:mod:`engine.lakehouse.delta.arrow_delta`), in tens of milliseconds where a Spark job and a Spark
Delta commit take about a second each on a small machine.

Exactly once, across crashes and replays:

1. a round that will write first records its plan (``status = planned``) in
   ``delay_offset``;
2. it applies open cancel/reschedule commands (:mod:`engine.deliver.commands`): their outcomes go to
   ``command_results`` and rescheduled rows to ``schedule`` (``txnVersion = k``), and the
   rows they remove are left out of the topic writes;
3. each topic table gets one write per sink (:mod:`engine.deliver.sinks`); a replayed
   round skips the writes its sinks say finished (for Delta: the table's ``txn`` record, or
   the round's tag in its recent history). The Delta data files are written first, unseen;
   the commits that show them (and Kafka sends) wait until the clock has reached ``W_k``.
   The engine's own loop plans ``W_k`` a little ahead of the clock (``delivery.max_lead``)
   so that the files are ready by then;
4. then progress is committed (``status = committed``), never ahead of the delivery.

After a crash between 1 and 4 the engine finds the plan and replays round ``k`` with the
same ``W_k``, ``V_k`` and commands version: exactly the same rows, minus the topics already
written. The round does no catalog work: the engine names new tables after it.

Example:
    >>> delivery = Delivery(spark, cfg, lay, clock).open()  # doctest: +SKIP
    >>> delivery.run_round().delivered  # doctest: +SKIP
    12
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import to_arrow_schema

from engine.core.clock import Clock, from_micros, from_millis, to_micros, to_millis
from engine.core.config import EngineConfig
from engine.core.errors import RetryableError
from engine.deliver.ahead import (
    SOONEST_S,
    Ahead,
    ReadAhead,
    ahead_round,
    job_group,
    mass_due,
    read_rows,
)
from engine.deliver.checkpoint import (
    RETAIN_ROUNDS,
    Plan,
    Progress,
    QueueProgress,
    checkpoint_rows,
    count_stamped,
    read_checkpoint,
)
from engine.deliver.commands import (
    REMOVING,
    RESCHEDULE_QUEUE,
    CommandTables,
    Resolution,
    open_commands,
    pruned_ids,
    removed_before,
    rescheduled_rows,
    resolve,
    results_table,
    targets,
    unstamped,
)
from engine.deliver.due import (
    TS,
    WINDOW_STATS,
    Candidates,
    Window,
    counted_summary,
    read_candidates,
    removed_marks,
    summary_of,
    to_topic_rows,
    topic_tables,
)
from engine.deliver.lateness import Lateness
from engine.deliver.quiet import Quiet, next_due_us
from engine.deliver.rates import (
    DEFAULT,
    Backlog,
    Capped,
    TopicRate,
    cap_rows,
    cursors,
    lowered_topic,
)
from engine.deliver.sinks import DeltaTopicSink, SinkFactory, Sinks, SinkSet
from engine.deliver.tasks import (
    RoundJob,
    Written,
    deliver_in_group,
    deliver_on_executors,
    merged,
)
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.delta_log import Txn, VersionTracker
from engine.lakehouse.delta.live_files import LiveFiles
from engine.lakehouse.delta.log_append import FileLayout, write_files
from engine.lakehouse.state.lease import unfenced
from engine.lakehouse.state.offset_log import OffsetLog
from engine.lakehouse.storage.layout import Layout
from engine.lakehouse.storage.location import carried
from schemas import TOPIC

log = logging.getLogger(__name__)

#: Rounds whose topic-file times set the lead of a round planned ahead (their median).
LEAD_ROUNDS = 5
#: The rows a round found when Spark tasks read them (none came to the driver).
_NO_ROWS = pa.table({"deliver_ts": pa.array([], TS)})
#: The layout of a topic table as delayq creates it (what tasks assume of a new one).
_TOPIC_ARROW = to_arrow_schema(TOPIC, timezone="UTC")
#: A stamping batch above any (a window of every row due in it, whenever stamped).
_NO_BATCH = 2**62
#: Later than any row's time (no row left to fall due).
_NEVER = datetime.max.replace(tzinfo=UTC)
#: A round written ahead whose instant is this long gone is dropped (its rows would say they
#: were delivered at the instant).
AHEAD_STALE_S = 1.0
#: Rows waiting for a rate cap the driver keeps between rounds, at most (Arrow bytes).
BACKLOG_KEPT_BYTES = 1 << 30
#: Longest sleep while a round planned ahead waits for its watermark.
WAIT_STEP_S = 0.05
#: How much longer than the time it was away a round waits for its watermark.
WAIT_SLACK_S = 1.0


@dataclass(frozen=True)
class RoundResult:
    """What one round did.

    Attributes:
        round: the round number (the committed one when something was committed).
        watermark: the round's cutoff time.
        delivered: rows written into topic tables.
        per_topic: rows per topic table (topic names in lower case).
        committed: whether progress was committed.
        replayed: whether this round replayed a plan left by a crash.
        seconds: wall time the round took.
        files_read: ``schedule`` files the round's scan read (after data skipping).
        rows_read: rows those files held (before the row filter).
        stages: seconds per stage: ``plan`` (versions, deciding commands), ``scan`` (find
            what is due), ``commands`` (writing their outcomes, when any), ``files`` (the
            topic tables' data files, not yet seen), ``wait`` (a round planned ahead, until
            its watermark), ``topics`` (the topic commits, and Kafka sends), ``commit``
            (progress).
        lateness: how late the delivered rows were (``delivered_ts - deliver_ts``).
        commands: command outcomes the round decided, per result (``cancelled``, ...).
        where: ``driver`` (the round's rows were read and written here), ``executors``
            (by Spark tasks, :mod:`engine.deliver.tasks`) or ``ahead`` (by Spark tasks before
            its instant, :mod:`engine.deliver.ahead`).
        rates: the capped topics after the round (:mod:`engine.deliver.rates`): rows due
            and waiting for their cap, and when they clear at it.
    """

    round: int
    watermark: datetime
    delivered: int
    per_topic: Mapping[str, int]
    committed: bool
    replayed: bool
    seconds: float
    files_read: int = 0
    rows_read: int = 0
    stages: Mapping[str, float] = field(default_factory=dict)
    lateness: Lateness = field(default_factory=Lateness)
    commands: Mapping[str, int] = field(default_factory=dict)
    where: str = "driver"
    rates: Mapping[str, TopicRate] = field(default_factory=dict)


class Delivery:
    """Runs delivery rounds against one lakehouse; keeps the committed progress in memory.

    The engine's delivery loop calls :meth:`run_round` (see :mod:`engine.run.engine`); tests
    call it directly with a fake clock. The constructor only holds what it is
    given; :meth:`open` reads the checkpoint.

    Args:
        spark: a Delta-enabled session.
        cfg: engine configuration.
        layout: table paths.
        clock: the engine clock.
        sinks: builds the topic sinks of a delivery checkpoint (default :class:`Sinks`,
            as ``kafka.sinks`` says).
        fence: called before a round writes anything and before it commits; raises once
            this engine no longer holds the lakehouse
            (:meth:`~engine.lakehouse.state.lease.Lease.check`).
    """

    def __init__(
        self,
        spark: SparkSession,
        cfg: EngineConfig,
        layout: Layout,
        clock: Clock,
        sinks: SinkFactory = Sinks,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.spark = spark
        self.cfg = cfg
        self.fence = fence or unfenced
        self.layout = layout
        self.clock = clock
        self._sink_factory = sinks
        self._sinks: dict[str, SinkSet] = {}
        self.offsets = OffsetLog(layout.delay_offset)
        self.progress = Progress(checkpoint_id="")
        self.pending: Plan | None = None
        self._last_commit = time.monotonic()
        # seconds the last rounds that wrote took to have their topic files written
        self._preps: deque[float] = deque(maxlen=LEAD_ROUNDS)
        self._last_watermark = from_millis(0)  # of the last round, committed or not
        self._stages: dict[str, float] = {}
        self._lap = 0.0
        # schedule's files, followed commit by commit; files every later round would skip
        # are retired at each commit (until the progress goes back, which reloads them).
        self._schedule = LiveFiles(layout.schedule, stats=WINDOW_STATS)
        self._retired = Window(from_millis(0), from_millis(0), -1)
        self._results = ArrowDelta(layout.command_results)
        self._tables = CommandTables.of(layout, self._results)
        self._commands = VersionTracker(layout.commands)
        self._open_commands = True  # unknown until the first round looks
        self._no_commands_until = -1  # the commands table held none up to this version
        self._sent_ids: set[str] = set()  # commands' ids known to be in commitlog
        self._any_removed = True  # until open() looks
        self._opened = False
        self._ahead: Ahead | None = None  # a round written ahead (engine.deliver.ahead)
        # the plan of the last round that ended well: every row of its schedule version due
        # by its watermark is delivered (see quiet())
        self._settled: Plan | None = None
        # (schedule version, commands version, no row due before this): what quiet() found
        self._known_due: tuple[int, int, datetime] | None = None
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._waiting = 0  # rows the last round left waiting for a rate cap
        # those rows, per topic, as the last committed round left them (engine.deliver.rates)
        self._backlogs: dict[str, Backlog] = {}
        self._split: tuple[Candidates, Capped] | None = None  # the round's, once split
        self._read: ReadAhead | None = None  # capped topics' rows read ahead (ahead.py)

    def open(self) -> Delivery:
        """Load the committed progress and an interrupted round's plan; returns ``self``."""
        self._opened = True
        self.progress, self.pending = read_checkpoint(self.spark, self.layout)
        if self.progress.round >= 0 and not any(
            q.stamped_total for q in self.progress.queues.values()
        ):
            self.progress = count_stamped(self.spark, self.layout, self.progress)
        # delta-rs, no Spark job at start: is there any command, any removed row?
        commands = self._tables.commands
        version = commands.latest()
        self._open_commands = version >= 0 and commands.dataset(version).count_rows() > 0
        # No command up to this version: a later one is the first worth a look.
        self._no_commands_until = -1 if self._open_commands else version
        version = self._results.latest()
        removing = ds.field("result").isin(list(REMOVING))
        self._any_removed = (
            version >= 0 and self._results.dataset(version).count_rows(filter=removing) > 0
        )
        return self

    def sinks(self) -> SinkSet:
        """The topic sinks of the current delivery checkpoint."""
        checkpoint = self.progress.checkpoint_id
        assert checkpoint, "the delivery checkpoint is not read yet: open() first"
        if checkpoint not in self._sinks:
            self._sinks[checkpoint] = self._sink_factory(
                self.spark, self.cfg, self.layout, checkpoint
            )
        return self._sinks[checkpoint]

    def close(self) -> None:
        """Close what the sinks hold open (Kafka producers); a later round opens them again."""
        self._drop_ahead()
        if self._read is not None:
            self._read.job.cancel()
            self._read = None
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=False, cancel_futures=True)
            self._ahead_pool = None
        for sinks in self._sinks.values():
            close = getattr(sinks, "close", None)
            try:
                if close is not None:
                    close()
            except Exception as err:  # the other sinks, and the engine's stop, go on
                log.warning("closing the sinks of a delivery checkpoint failed: %s", err)

    def run_round(self, lead_ms: int = 0, until: datetime | None = None) -> RoundResult:
        """Deliver what is due now; replays an interrupted round first.

        Args:
            lead_ms: plan the round this far ahead of the clock (the engine's own loop
                gives :meth:`lead_ms`): its watermark is ``now + lead_ms``. The topic files
                are written first, unseen; the commits that show them wait until the clock
                has reached the watermark. A row is then shown about the commits' time after
                it is due, instead of the scan's and the writes' as well. Never early: no
                topic commit before the watermark. A round with commands to decide, or a
                replay, is not planned ahead. Waits on the round's clock.
            until: the highest watermark this round may take (the delivery query's batch
                end, from Spark's offsets log); never below the last progress.

        Returns:
            What the round did. A round with nothing to deliver and nothing new writes
            nothing, except a progress flush every ``delivery.checkpoint_flush_interval``.
        """
        if not self._opened:
            self.open()  # never a round from the placeholder progress
        self._settled = None
        try:
            result = self._run_round(lead_ms, until)
        except BaseException:
            # A write may have landed even though the call failed (an object store's
            # rename): reload what is durable, so a round number is never used twice.
            self.progress, self.pending = read_checkpoint(self.spark, self.layout)
            self._open_commands = True
            self._last_watermark = from_millis(0)  # its rows may not have been delivered
            self._known_due = None
            self._backlogs = {}
            raise
        if result.committed:
            try:
                self._look_ahead()
            except Exception:  # (an optimisation: the rows go the usual way)
                log.exception("writing a round ahead failed to start")
                self._ahead = None
        return result

    def _run_round(self, lead_ms: int, until: datetime | None = None) -> RoundResult:
        started = time.monotonic()
        self._stages = {}
        self._lap = started
        prev = self.progress
        replayed = self.pending is not None
        now = self.clock.now()
        if now < (self.pending or prev).watermark:
            # The clock stepped back behind a watermark already fixed: delivering now could
            # be early. Wait until it has caught up.
            log.warning("clock %s is behind the watermark; round skipped", now.isoformat())
            skipped = Plan(prev.round, now, -1)
            return self._result(prev.round, skipped, {}, False, False, started, None)
        plan = self.pending or Plan(
            round=prev.round + 1,
            watermark=now,
            schedule_version=self._schedule.latest(),
            commands_version=self._commands.latest(),
            caps=self.cfg.rates(),
        )
        if not self.pending and not self._commands_to_decide(prev, plan):
            # (commands are decided against the watermark: a round with some is not ahead)
            if lead_ms > 0:
                plan = replace(plan, watermark=now + timedelta(milliseconds=lead_ms))
            if self.cfg.max_lead_ms > 0:
                plan = self._at_next_due(plan, now, until)
        if until is not None and not self.pending and plan.watermark > until:
            # (a window never goes back: its rows would be delivered again)
            plan = replace(plan, watermark=max(until, prev.watermark))
        plan, ahead = self._with_ahead(prev, plan)
        plan, read = self._with_read(prev, plan)
        resolution = self._resolve_commands(prev, plan)
        if resolution is not None:
            ahead = None  # (its files cannot show what the commands decide: written again)
        self._time("plan")
        # Rows waiting for a rate cap: read again above their cursor, unless the last round
        # (the committed one) kept them (then only rows due or stamped since are read).
        waiting = cursors(prev.rates)
        kept = {
            t: b
            for t, b in self._backlogs.items()
            if not self.pending and b.round == prev.round and waiting.get(t) == b.cursor
        }
        held = tuple(sorted((t, c) for t, c in waiting.items() if t not in kept))
        window = Window(prev.watermark, plan.watermark, prev.stamp_batch, by_stats=True, held=held)
        whole: frozenset[str] = frozenset()  # files read ahead, every row of them
        if read is not None and resolution is None:
            ra, fresh, whole = read
            kept.update(fresh)
            bounds = (to_micros(ra.after), to_micros(ra.until), ra.batch, tuple(sorted(fresh)))
            window = dataclasses.replace(window, read=bounds)
        reach = dataclasses.replace(window, held=tuple(sorted(waiting.items())))
        if not reach.follows(self._retired):
            self._schedule.reset()  # files retired for a later progress may hold rows
        removed = self._removed(reach, plan, resolution)
        written = None if ahead is None else self._from_ahead(ahead, plan, window, removed)
        if written is None and not (plan.caps or prev.rates):
            # (a capped round is split on the driver: its rows are few by the cap's design)
            written = self._on_executors(plan, window, removed)
        if written is not None:
            found = Candidates(_NO_ROWS, written.summary, written.files, written.rows)
        else:
            store = self._schedule.store
            found = read_candidates(
                self._schedule.dataset(
                    plan.schedule_version,
                    keep=lambda f: window.may_hold(f) and store.arrow_path(f.path) not in whole,
                ),
                window,
                removed,
            )
        # The files no path above read: every row new and not due, counted from statistics.
        counted = counted_summary(self._schedule.files(plan.schedule_version), window)
        if counted:
            found = dataclasses.replace(found, summary=found.summary + counted)
        rates: Mapping[str, TopicRate] = {}
        self._split = None
        if written is None and (plan.caps or prev.rates):
            self._split = _capped(found, plan, prev, kept, removed)
            found, rates = self._split[0], self._split[1].state
        return self._deliver(prev, plan, resolution, found, replayed, started, written, rates)

    # ------------------------------------------------------------- rounds written ahead

    def _look_ahead(self) -> None:
        """After a committed round: start writing ahead the next mass of rows due at one
        instant, if there is one (:mod:`engine.deliver.ahead`)."""
        if self.cfg.rates():
            self._read_ahead()
            return
        sinks = self._delta_sinks()  # (first: the driver mode pays nothing more per round)
        if (
            sinks is None
            or self.pending is not None
            or self.progress.rates
            or self._open_commands
            or self._commands.latest() > self.progress.commands_version  # (one to decide)
        ):
            return
        prev = self.progress
        now = self.clock.now()
        if self._ahead is not None:
            self._ahead_layer(sinks.delta, self._ahead, prev, now)
            return
        # The latest version, up to the last round's batch: rows rescheduled by that round
        # (appended after its version, with its batch) are in; later batches are not.
        version = self._schedule.latest()
        found = mass_due(
            self._schedule.files(version),
            now_us=to_micros(now),
            rows_over=self.cfg.deliver_driver_rows,
        )
        if found is None:
            return
        after, until = from_micros(found[0]), from_micros(found[1])
        number = ahead_round(prev.round, until, now, self.cfg.poll_interval_ms)
        # every row due in (after, until] stamped up to the last round's batch
        window = Window(after, until, _NO_BATCH, batches=(None, prev.stamp_batch))
        job = self._round_job(
            sinks.delta, version, window, number, until, self._removed_after(number, after)
        )
        if job is None:
            return
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="delayq-ahead")
        group = job_group(number)
        self._ahead = Ahead(
            after=after,
            until=until,
            round=number,
            batch=prev.stamp_batch,
            commands_version=self._commands.latest(),
            results_version=self._results.latest(),
            jobs=(self._ahead_pool.submit(deliver_in_group, self.spark, job, group),),
        )
        log.info(
            "writing ahead round %d: %s rows due at %s", number,
            sum(p.rows for p in job.parts), until.isoformat(),
        )  # fmt: skip

    def _read_ahead(self) -> None:
        """After a committed round, with rate caps: start reading ahead the next mass of
        capped topics' rows due at one instant, if there is one (:class:`ReadAhead`)."""
        if (
            self._read is not None
            or self.pending is not None
            or self._open_commands
            or self._commands.latest() > self.progress.commands_version
        ):
            return
        prev, now = self.progress, self.clock.now()
        version = self._schedule.latest()
        found = mass_due(
            self._schedule.files(version),
            now_us=to_micros(now),
            rows_over=self.cfg.deliver_driver_rows,
        )
        if found is None or found[0] < to_micros(prev.watermark):
            return
        caps, held = self.cfg.rates(), list(cursors(prev.rates))
        named = [t for t in caps if t != DEFAULT]
        if caps.get(DEFAULT, 0.0) > 0:  # (every topic but those uncapped, and those held)
            capped = ~lowered_topic().isin([t for t in named if caps[t] <= 0] + held)
        else:
            capped = lowered_topic().isin([t for t in named if caps[t] > 0 and t not in held])
        after, until = from_micros(found[0]), from_micros(found[1])
        band = Window(after, until, _NO_BATCH, batches=(None, prev.stamp_batch))
        parts = self._schedule.parts(version, keep=band.may_hold)
        schema, store = self._schedule.schema(version), self._schedule.store
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="delayq-ahead")
        job = self._ahead_pool.submit(read_rows, parts, schema, store, band.due() & capped)
        self._read = ReadAhead(
            after, until, prev.stamp_batch, self._commands.latest(), self._results.latest(), job
        )
        log.info("reading ahead capped topics' rows due at %s", until.isoformat())

    def _with_read(
        self, prev: Progress, plan: Plan
    ) -> tuple[Plan, tuple[ReadAhead, dict[str, Backlog], frozenset[str]] | None]:
        """The round's plan with rows read ahead in view (as :meth:`_with_ahead`): up to
        their window's start while its end is not in reach, then the round that takes them;
        the read is dropped when its rows may no longer be what the round reads."""
        ra = self._read
        if ra is None or self.pending is not None:
            return plan, None
        job = ra.job
        if (
            self._commands_to_decide(prev, plan)
            or self._open_commands
            or self._commands.latest() != ra.commands_version
            or self._results.latest() != ra.results_version
            or prev.watermark > ra.after
            or (job.done() and (job.cancelled() or job.exception() is not None))
        ):
            self._read = None
            job.cancel()
            return plan, None
        if plan.watermark <= ra.after:
            return plan, None
        if plan.watermark < ra.until:
            return replace(plan, watermark=ra.after), None
        self._read = None
        try:
            fresh, whole = job.result(
                timeout=max(0.0, (ra.until - self.clock.now()).total_seconds())
            )
        except Exception as err:  # (not read in time, or failed: the rows go the usual way)
            job.cancel()
            log.warning("capped topics' rows read ahead not used (%s)", err or type(err).__name__)
            return plan, None
        if not fresh or set(fresh) & set(cursors(prev.rates)):
            return plan, None  # (a topic held since: its rows are read above its cursor)
        return plan, (ra, fresh, whole)

    def _ahead_layer(
        self, topics: DeltaTopicSink, ahead: Ahead, prev: Progress, now: datetime
    ) -> None:
        """Write ahead the rows of a round written ahead that were stamped since, when they
        are many and its instant is not near (a mass stamped in several batches)."""
        if (
            ahead.until - now < timedelta(seconds=SOONEST_S)
            or prev.stamp_batch <= ahead.batch
            or ahead.failed()
        ):
            return
        version = self._schedule.latest()
        window = Window(
            ahead.after, ahead.until, _NO_BATCH, batches=(ahead.batch, prev.stamp_batch)
        )
        parts = self._schedule.parts(version, keep=window.may_hold)
        if sum(p.rows for p in parts) <= self.cfg.deliver_driver_rows:
            return  # (few: the round writes them itself)
        job = self._round_job(
            topics, version, window, ahead.round, ahead.until,
            self._removed_after(ahead.round, ahead.after),
        )  # fmt: skip
        if job is None or self._ahead_pool is None:
            return
        self._ahead = dataclasses.replace(
            ahead,
            batch=prev.stamp_batch,
            jobs=(
                *ahead.jobs,
                self._ahead_pool.submit(deliver_in_group, self.spark, job, ahead.job_group),
            ),
        )

    def _with_ahead(self, prev: Progress, plan: Plan) -> tuple[Plan, Ahead | None]:
        """The round's plan with a round written ahead in view: up to its start at most
        while its instant is not in reach, then the round itself (with the written round's
        number and instant). The written round is dropped when it may no longer hold the
        rows its window will."""
        ahead = self._ahead
        if ahead is None or self.pending is not None:
            return plan, None
        if not self._ahead_holds(prev, plan, ahead):
            log.info("round %d written ahead is dropped; its rows go the usual way", ahead.round)
            self._drop_ahead()
            return plan, None
        if plan.watermark <= ahead.after:
            return plan, None
        if plan.watermark < ahead.until:
            return replace(plan, watermark=ahead.after), None  # up to its start meanwhile
        self._ahead = None
        # Its jobs may still run: wait as long as its rows could still be shown as delivered
        # at its instant, not longer (the rows then go the usual way).
        left = ahead.until + timedelta(seconds=AHEAD_STALE_S) - self.clock.now()
        done, running = futures.wait(ahead.jobs, timeout=max(0.0, left.total_seconds()))
        failed = [j.exception() for j in done if not j.cancelled() and j.exception() is not None]
        if running or failed or ahead.failed():
            why = f"failed ({failed[0]})" if failed else "not written in time"
            log.warning("round %d written ahead %s; its rows go the usual way", ahead.round, why)
            self._ahead = ahead
            self._drop_ahead()  # (its jobs stop: they would hold the cores the rows need now)
            return plan, None
        return replace(plan, round=ahead.round, watermark=ahead.until), ahead

    def _ahead_holds(self, prev: Progress, plan: Plan, ahead: Ahead) -> bool:
        """Whether a round written ahead still holds what its window will (no command since
        or to decide, no round number or progress past it, its instant not long gone)."""
        return not (
            ahead.failed()
            or self._commands_to_decide(prev, plan)
            or prev.round >= ahead.round
            or prev.watermark > ahead.after
            or self._open_commands
            or self._commands.latest() != ahead.commands_version
            or self._results.latest() != ahead.results_version
            or self.clock.now() - ahead.until > timedelta(seconds=AHEAD_STALE_S)
        )

    def _from_ahead(
        self, ahead: Ahead, plan: Plan, window: Window, removed: set[tuple[str, int]]
    ) -> Written | None:
        """The written round, with the rows of its window stamped since (written here);
        ``None`` when a table's layout changed meanwhile (the round then goes as usual)."""
        written = ahead.written()
        sinks = self._delta_sinks()
        if sinks is None:
            return None
        topics = sinks.delta
        if written.mixed:
            return None
        for table in sorted(written.adds):  # (a table changed meanwhile: written again)
            if topics.file_layout(table) != written.layouts[table]:
                return None
        # the window's other rows: due since the last round, or stamped since
        later = dataclasses.replace(window, written=(ahead.after, ahead.batch))
        extra = read_candidates(
            self._schedule.dataset(plan.schedule_version, keep=later.may_hold), later, removed
        )
        tables = topic_tables(to_topic_rows(extra.deliver, ahead.until, plan.round))
        for table, rows in tables.items():
            layout = written.layouts.get(table) or topics.file_layout(table)
            if layout is None:
                return None
            written.adds.setdefault(table, []).extend(write_files(layout, rows))
            written.counts[table] = written.counts.get(table, 0) + rows.num_rows
            written.layouts[table] = layout
        written.summary = merged(written.summary + extra.summary)
        written.files += extra.files
        written.rows += extra.rows
        written.lateness += Lateness.of(extra.deliver["deliver_ts"], ahead.until)
        written.ahead = True
        if self.clock.now() - ahead.until > timedelta(seconds=AHEAD_STALE_S):
            return None  # (its rows would say they were delivered at the instant)
        return written

    def _drop_ahead(self) -> None:
        """Forget the round written ahead, and stop its Spark jobs (its files stay unseen)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not all(j.done() for j in ahead.jobs):
            for job in ahead.jobs:
                job.cancel()
            try:
                self.spark.sparkContext.cancelJobGroup(ahead.job_group)
            except Exception as err:  # (a stopped session: its jobs are gone with it)
                log.warning("could not stop the jobs of round %d: %s", ahead.round, err)

    def _removed_after(self, round_: int, after: datetime) -> set[tuple[str, int]]:
        """Rows rounds before ``round_`` took out of delivery, among those due after
        ``after``."""
        version = self._results.latest() if self._any_removed else -1
        if version < 0:
            return set()
        return removed_marks(self._results.dataset(version), round_, after, REMOVING)

    # ------------------------------------------------------------- rounds by Spark tasks

    def _delta_sinks(self) -> Sinks | None:
        """The sinks, when Spark tasks may write the topic files (``delivery.mode`` is
        ``streaming``, every topic goes to Delta only)."""
        if self.cfg.delivery_mode != "streaming":
            return None
        sinks = self.sinks()
        if not isinstance(sinks, Sinks) or not sinks.delta_only():
            return None
        return sinks

    def _round_job(
        self,
        topics: DeltaTopicSink,
        version: int,
        window: Window,
        round_: int,
        delivered_ts: datetime,
        removed: set[tuple[str, int]],
    ) -> RoundJob | None:
        """What the tasks of a round need; ``None`` when a known topic table takes no files
        written elsewhere."""
        known: dict[str, FileLayout] = {}
        for table in topics.known():
            found = topics.file_layout(table)
            if found is None:
                return None
            known[table] = found
        template = next(iter(known.values()), None) or FileLayout("", _TOPIC_ARROW, ())
        return RoundJob(
            schedule=self.layout.schedule,
            schema=self._schedule.schema(version),
            parts=self._schedule.parts(version, keep=window.may_hold),
            window=window,
            removed=frozenset(removed),
            delivered_ts=delivered_ts,
            round=round_,
            layouts=known,
            topic_path=self.layout.topic,
            template=template,
            settings=carried(self.layout.schedule),
            tasks=self.spark.sparkContext.defaultParallelism,
        )

    def _on_executors(
        self, plan: Plan, window: Window, removed: set[tuple[str, int]]
    ) -> Written | None:
        """A large round's scan and topic files, by Spark tasks (:mod:`engine.deliver.tasks`);
        ``None`` when the round runs on the driver: ``delivery.mode`` is ``driver``, the
        window holds at most ``delivery.driver_round_rows`` rows, a topic goes to Kafka, or
        a topic table takes no files written elsewhere."""
        sinks = self._delta_sinks()
        if sinks is None:
            return None
        parts = self._schedule.parts(plan.schedule_version, keep=window.may_hold)
        if not parts or sum(p.rows for p in parts) <= self.cfg.deliver_driver_rows:
            return None
        topics = sinks.delta
        # (rows are shown at the watermark or later: a round planned ahead commits then)
        delivered_ts = max(self.clock.now(), plan.watermark)
        job = self._round_job(
            topics, plan.schedule_version, window, plan.round, delivered_ts, removed
        )
        if job is None:
            return None
        known = dict(job.layouts)
        written = deliver_on_executors(self.spark, job)
        wrong: set[str] = set()
        for table in sorted(written.guessed):
            actual = topics.file_layout(table)  # (creates the table, empty)
            if actual is None:
                return None
            known[table] = actual
            if actual != written.layouts[table]:
                wrong.add(table)
        if wrong:  # tables whose real layout the tasks did not guess: written again
            again = dataclasses.replace(job, layouts=known, only=frozenset(wrong))
            written.redo(deliver_on_executors(self.spark, again), wrong)
        return written

    def _deliver(
        self,
        prev: Progress,
        plan: Plan,
        resolution: Resolution | None,
        found: Candidates,
        replayed: bool,
        started: float,
        written: Written | None = None,
        rates: Mapping[str, TopicRate] | None = None,
    ) -> RoundResult:
        summary = found.summary
        self._waiting = sum(r.waiting for r in (rates or {}).values())
        self._time("scan")
        high_batch = max([prev.stamp_batch, *(r["max_batch"] for r in summary)])
        due = [r for r in summary if r["_due"] and not r["_removed"]]
        decided = resolution is not None and bool(resolution.results)
        if not due and not decided and not replayed and plan.watermark > self.clock.now():
            # Planned ahead, and nothing to show: progress up to now, with nothing to wait for
            # (never below the last progress, should the clock have stepped back meanwhile:
            # a window going back would deliver its rows again).
            now = max(self.clock.now(), prev.watermark)
            plan = replace(plan, watermark=min(plan.watermark, now))
            # Rows a cap held back were split for the planned watermark: kept, some would be
            # above the one committed (and read again). The next round reads them again.
            self._split = None
        self._last_watermark = plan.watermark  # (nothing was due before it: see lead_ms)
        if not due and not decided and not replayed:
            flush_due = (time.monotonic() - self._last_commit) * 1000 >= (
                self.cfg.checkpoint_flush_ms
            )
            if high_batch == prev.stamp_batch and not flush_due:
                self._settled = plan
                return self._result(prev.round, plan, {}, False, False, started, found, rates=rates)
        self.fence()  # raises once another engine has taken the lakehouse over
        if not replayed:
            # Every round that commits is planned first, put-if-absent: one plan per round
            # number, which any engine that finds it runs again as it is.
            rows = checkpoint_rows(prev, plan, {}, self.clock.now())
            try:
                self.offsets.write(plan.round, rows, planned=True, exclusive=True)
            except FileExistsError as err:
                self.fence()  # if still ours, an engine fenced since planned it: replay it
                raise RetryableError(
                    f"delivery round {plan.round} was planned by an engine fenced since ({err})"
                ) from err
            self.pending = plan
        if resolution is not None and decided:
            self._apply_commands(resolution, plan, high_batch)
            self._time("commands")
        if written is not None:
            per_topic = self._commit_written(written, plan, replayed, started)
            lateness = written.lateness
        else:
            # Rows are shown at the watermark or later (a round planned ahead commits then).
            delivered_ts = max(self.clock.now(), plan.watermark)
            per_topic = self._write_topics(found, plan, replayed, delivered_ts, started)
            lateness = Lateness.of(found.deliver["deliver_ts"], delivered_ts)
        self._time("topics")
        self._commit(prev, plan, summary, high_batch, resolution, rates or {})
        self._keep_backlogs(plan.round)
        self._settled = plan
        self._time("commit")
        return self._result(
            plan.round, plan, per_topic, True, replayed, started, found, lateness, resolution,
            where="driver" if written is None else "ahead" if written.ahead else "executors",
            rates=rates,
        )  # fmt: skip

    def _keep_backlogs(self, round_: int) -> None:
        """After round ``round_`` committed: keep the rows its caps left waiting for the
        next round, up to :data:`BACKLOG_KEPT_BYTES` (beyond, rounds read them again)."""
        split, self._split = self._split, None
        backlogs = split[1].backlogs if split else {}
        if sum(b.rows.nbytes for b in backlogs.values()) > BACKLOG_KEPT_BYTES:
            backlogs = {}
        self._backlogs = {t: replace(b, round=round_) for t, b in backlogs.items()}

    # ------------------------------------------------------------- cancel / reschedule

    def _commands_to_decide(self, prev: Progress, plan: Plan) -> bool:
        """Whether the round may have commands to decide (new ones, or some left open)."""
        new = plan.commands_version > max(prev.commands_version, self._no_commands_until)
        # (a plan written before commands existed pins no version)
        return plan.commands_version >= 0 and (new or self._open_commands or bool(self.pending))

    def _resolve_commands(self, prev: Progress, plan: Plan) -> Resolution | None:
        """Decide the open commands from the round's snapshots (``None``: there are none)."""
        if not self._commands_to_decide(prev, plan):
            return None
        commands = open_commands(self._tables, plan.commands_version, plan.round)
        if not commands:
            self._open_commands = False
            return None
        rows = targets(self._tables, plan.schedule_version, commands)
        removed: set[tuple[str, int]] = set()
        if rows:
            removed = removed_before(self._tables, plan.round, {r.msg_id for r in rows})
        found = {r.msg_id for r in rows}
        unmatched = {c["msg_id"] for c in commands if c["msg_id"] and c["msg_id"] not in found}
        sent: set[str] = set()
        refused: dict[str, str] = {}
        pruned: dict[str, bool] = {}
        if unmatched:
            sent, refused = unstamped(self._tables, unmatched, self._sent_ids)
            self._sent_ids |= sent
            pruned = pruned_ids(self._tables, sent - set(refused), plan.round)
        resolution = resolve(
            commands,
            rows,
            removed,
            (to_micros(prev.watermark), prev.stamp_batch),
            plan.round,
            to_micros(plan.watermark),
            self.clock.now(),
            sent,
            refused,
            pruned,
            cursors(prev.rates),
        )
        self._open_commands = resolution.waiting > 0
        return resolution

    def _removed(
        self, window: Window, plan: Plan, resolution: Resolution | None
    ) -> set[tuple[str, int]]:
        """``(msg_id, revision)`` of candidates a cancel or reschedule took out of delivery."""
        marks = {(m, int(r or 0)) for m, r in (resolution.removed if resolution else [])}
        version = self._results.latest() if self._any_removed else -1
        if version >= 0:
            # Rows removed earlier and due at or before the window's floor were never
            # delivered and are no longer candidates: only later ones can meet this round's.
            marks |= removed_marks(
                self._results.dataset(version), plan.round, window.floor, REMOVING
            )
        return marks

    def _apply_commands(self, resolution: Resolution, plan: Plan, high_batch: int) -> None:
        """Write a round's command outcomes and rescheduled rows (idempotent per round).

        A replayed round skips an append its ``txn`` says landed.
        """
        checkpoint = self.progress.checkpoint_id
        written = _append_once(
            self._results,
            results_table(resolution.results),
            Txn(f"delayq-commands-{checkpoint}", plan.round),
        )
        if not written:
            # A replay: the outcomes that landed stand. A command that waited then (its
            # message not stamped) may be decidable now; the next round looks again.
            self._open_commands = True
        if resolution.removed:
            self._any_removed = True
        if resolution.new_rows:
            moved = rescheduled_rows(
                self._tables,
                plan.schedule_version,
                resolution.new_rows,
                high_batch,
                self.clock.now(),
            )
            _append_once(
                self._tables.schedule, moved, Txn(f"delayq-reschedule-{checkpoint}", plan.round)
            )

    def _write_topics(
        self,
        found: Candidates,
        plan: Plan,
        replayed: bool,
        delivered_ts: datetime,
        started: float,
    ) -> dict[str, int]:
        # Keyed by table: topics differing only in case share one table. One write per
        # table and sink; a replayed round skips the writes its sinks say finished.
        tables = topic_tables(to_topic_rows(found.deliver, delivered_ts, plan.round))
        sinks = self.sinks()

        def stage(name: str) -> list[Callable[[], None]]:
            rows = tables[name]
            return [
                sink.stage(plan.round, name, rows, replayed)
                for sink in sinks.of(name)
                if not (replayed and sink.written(plan.round, name))
            ]

        def commit(commits: list[Callable[[], None]]) -> None:
            for show in commits:  # in the sinks' order
                show()

        # Each write is mostly file latency: overlap them. The data files first, then,
        # once the clock has reached the watermark, the commits that show them.
        with ThreadPoolExecutor(max_workers=self.cfg.topic_writers) as pool:
            staged = list(pool.map(stage, sorted(tables)))
            self._time("files")
            if tables:
                self._preps.append(time.monotonic() - started)
            self._wait_until(plan.watermark)
            self._time("wait")
            list(pool.map(commit, staged))
        return {name: rows.num_rows for name, rows in tables.items()}

    def _commit_written(
        self, written: Written, plan: Plan, replayed: bool, started: float
    ) -> dict[str, int]:
        """Commit the topic files Spark tasks wrote, once the clock has reached the watermark
        (one commit per table, as :meth:`_write_topics`'s; a replay skips the tables its
        ``txn`` shows)."""
        sinks = self.sinks()
        assert isinstance(sinks, Sinks)  # (as _on_executors checked)
        topics = sinks.delta
        tables = sorted(t for t, n in written.counts.items() if n)
        todo = [t for t in tables if not (replayed and topics.written(plan.round, t))]
        self._time("files")
        if tables and not written.ahead:  # (written ahead: no measure of a round's files)
            self._preps.append(time.monotonic() - started)
        self._wait_until(plan.watermark)
        self._time("wait")

        def commit(table: str) -> None:
            adds, rows = written.adds[table], written.counts[table]
            topics.commit_files(plan.round, table, adds, rows, written.layouts[table])

        with ThreadPoolExecutor(max_workers=self.cfg.topic_writers) as pool:
            list(pool.map(commit, todo))
        return {t: written.counts[t] for t in tables}

    def _at_next_due(self, plan: Plan, now: datetime, until: datetime | None) -> Plan:
        """A plan ahead of the clock, at the next row's time when the last round found it
        beyond the plan's watermark but before the next round (a poll interval on, and the
        batch's watermark), and nothing changed since (the same ``schedule`` and
        ``commands`` versions): its rows are then shown at their time, the round waiting for
        it, not up to a poll interval later when the next round would take them. Nothing is
        overdue then, so no row waits longer for the commit."""
        known = self._known_due
        if known is None or (plan.schedule_version, plan.commands_version) != known[:2]:
            return plan
        due = known[2]
        soon = now + timedelta(milliseconds=self.cfg.poll_interval_ms)
        if plan.watermark < due <= soon and (until is None or due <= until):
            return replace(plan, watermark=due)
        return plan

    def quiet(self, batch_end: datetime) -> Quiet | None:
        """What the last round found, for the delivery query's clock source to hold its
        watermark while nothing can fall due (:mod:`engine.deliver.quiet`): ``None`` when the
        round failed, left a plan to replay, or left commands waiting.

        Args:
            batch_end: the watermark of the query's batch that ran the round.

        Example:
            >>> delivery.quiet(until).due_us  # doctest: +SKIP
            1795000000000000
        """
        plan = self._settled
        if plan is None or self.pending is not None or self._open_commands or self._waiting:
            self._known_due = None
            return None
        due = next_due_us(self._schedule.files(plan.schedule_version), to_micros(plan.watermark))
        soonest = _NEVER if due is None else from_micros(due)
        self._known_due = (plan.schedule_version, plan.commands_version, soonest)
        return Quiet(
            batch_end_ms=to_millis(batch_end),
            due_us=due,
            schedule=plan.schedule_version,
            commands=plan.commands_version,
        )

    def lead_ms(self) -> int:
        """How far ahead of the clock the next round may be planned: 1.25 times the median
        time the last rounds that wrote took to have their topic files written, at most
        ``delivery.max_lead`` and 3/4 of ``delivery.poll_interval`` (a longer lead would only
        space the rounds out).

        0 before any such round, and when the last round's watermark (committed or not) is
        older than a poll interval plus that cap: rows may be overdue already (after a long
        round), and a lead would hold them back.

        Example:
            >>> delivery.lead_ms()  # doctest: +SKIP
            40
        """
        if not self._preps or self.cfg.max_lead_ms <= 0:
            return 0
        cap = min(self.cfg.max_lead_ms, self.cfg.poll_interval_ms * 3 // 4)
        stale = timedelta(milliseconds=self.cfg.poll_interval_ms + cap)
        now = self.clock.now()
        last = max((self.pending or self.progress).watermark, self._last_watermark)
        if now - last > stale:
            # A held watermark is not stale while nothing was due before the next row's
            # time, nor is since (asked only here: the versions are a look at storage).
            known = self._known_due
            if known is None or known[:2] != (self._schedule.latest(), self._commands.latest()):
                return 0
            if now - max(last, min(known[2], now)) > stale:
                return 0
        return min(cap, round(1250 * statistics.median(self._preps)))

    def _wait_until(self, when: datetime) -> None:
        """Return once the round's clock has reached ``when`` (at once when it has).

        Raises:
            RetryableError: the clock did not get there in the time it was away, and a
                second more (it was stepped back): the plan stays, and is replayed once the
                clock has caught up.
        """
        left = (when - self.clock.now()).total_seconds()
        give_up = time.monotonic() + left + WAIT_SLACK_S
        while left > 0:
            if time.monotonic() > give_up:
                raise RetryableError(
                    f"the clock went back while round waited for its watermark {when.isoformat()}"
                )
            time.sleep(min(left, WAIT_STEP_S))
            left = (when - self.clock.now()).total_seconds()

    def _commit(
        self,
        prev: Progress,
        plan: Plan,
        summary: list,  # type: ignore[type-arg]
        high_batch: int,
        resolution: Resolution | None,
        rates: Mapping[str, TopicRate],
    ) -> None:
        queues = dict(prev.queues)
        for level in range(self.cfg.levels.max_level + 1):
            queues.setdefault(level, QueueProgress())
        delivered: dict[int, int] = {}
        for r in summary:
            q = queues.get(r["queue_id"], QueueProgress())
            stamped = q.stamped_total + (r["n"] if r["_new"] else 0)
            if not r["_due"] or r["_removed"]:
                queues[r["queue_id"]] = replace(q, stamped_total=stamped)
                continue
            last = _from_ms(r["max_deliver_ms"]) or q.last_deliver_ts
            if last and q.last_deliver_ts:
                last = max(last, q.last_deliver_ts)
            queues[r["queue_id"]] = replace(
                q, delivered_total=q.delivered_total + r["n"], last_deliver_ts=last,
                stamped_total=stamped,
            )  # fmt: skip
            delivered[r["queue_id"]] = delivered.get(r["queue_id"], 0) + r["n"]
        if resolution is not None:
            for queue_id, n in resolution.removed_per_queue.items():
                q = queues.get(queue_id, QueueProgress())
                queues[queue_id] = replace(q, cancelled_total=q.cancelled_total + n)
            if resolution.new_rows:
                q = queues.get(RESCHEDULE_QUEUE, QueueProgress())
                added = len(resolution.new_rows)
                queues[RESCHEDULE_QUEUE] = replace(
                    q,
                    stamped_total=q.stamped_total + added,
                    rescheduled_total=q.rescheduled_total + added,
                )
        progress = replace(
            prev,
            round=plan.round,
            watermark=plan.watermark,
            schedule_version=plan.schedule_version,
            stamp_batch=high_batch,
            queues=queues,
            commands_version=plan.commands_version,
            rates=dict(rates),
        )
        self.fence()
        rows = checkpoint_rows(progress, None, delivered, self.clock.now())
        try:  # put-if-absent: a fenced engine paused past the check above cannot commit
            self.offsets.write(plan.round, rows, exclusive=True)
        except FileExistsError as err:
            self.fence()  # if still ours, an engine fenced since committed the same plan
            raise RetryableError(
                f"delivery round {plan.round} was committed by an engine fenced since ({err})"
            ) from err
        self.progress, self.pending = progress, None
        self._retired = Window(
            progress.watermark, progress.watermark, progress.stamp_batch,
            held=tuple(sorted(cursors(progress.rates).items())),
        )  # fmt: skip
        self._schedule.retire(plan.schedule_version, done=self._retired.passed)
        if plan.round % 100 == 0:
            self.offsets.purge(plan.round - RETAIN_ROUNDS)
        self._last_commit = time.monotonic()

    def _time(self, stage: str) -> None:
        now = time.monotonic()
        self._stages[stage] = now - self._lap
        self._lap = now

    def _result(
        self,
        round_: int,
        plan: Plan,
        per_topic: Mapping[str, int],
        committed: bool,
        replayed: bool,
        started: float,
        found: Candidates | None,
        lateness: Lateness | None = None,
        resolution: Resolution | None = None,
        where: str = "driver",
        rates: Mapping[str, TopicRate] | None = None,
    ) -> RoundResult:
        decided = Counter(r["result"] for r in (resolution.results if resolution else []))
        return RoundResult(
            round=round_,
            watermark=plan.watermark,
            delivered=sum(per_topic.values()),
            per_topic=dict(per_topic),
            committed=committed,
            replayed=replayed,
            seconds=time.monotonic() - started,
            files_read=found.files if found else 0,
            rows_read=found.rows if found else 0,
            stages=dict(self._stages),
            lateness=lateness or Lateness(),
            commands=dict(decided),
            where=where,
            rates=dict(rates if rates is not None else self.progress.rates),
        )


def _capped(
    found: Candidates,
    plan: Plan,
    prev: Progress,
    backlogs: Mapping[str, Backlog],
    removed: set[tuple[str, int]],
) -> tuple[Candidates, Capped]:
    """The round's candidates with its rate caps applied (:mod:`engine.deliver.rates`): the
    rows they hold back taken out (counted as not due), the rows kept from the last round
    that go now put in; and the split (the capped topics' state to commit, what waits)."""
    marks = frozenset(f"{m}\x00{int(r or 0)}" for m, r in removed) if backlogs else frozenset()
    split = cap_rows(
        found.deliver,
        plan.caps,
        prev.rates,
        watermark_us=to_micros(plan.watermark),
        after_us=to_micros(prev.watermark),
        backlogs=backlogs,
        removed=marks,
    )
    if not split.topics:
        return found, split
    topics = set(split.topics)

    def new(rows: pa.Table) -> pa.Array | pa.ChunkedArray:
        return pc.greater(rows["stamp_batch"], prev.stamp_batch)

    def capped_due(entry: Mapping[str, object]) -> bool:
        topic = entry["topic"]
        return bool(entry["_due"]) and not entry["_removed"] and str(topic).lower() in topics

    go, wait = split.taken, split.new_waiting
    summary = (
        [r for r in found.summary if not (r["topic"] is not None and capped_due(r))]
        + summary_of(go, new(go), pa.repeat(False, go.num_rows), due=True)
        + summary_of(wait, new(wait), pa.repeat(False, wait.num_rows), due=False)
    )
    return dataclasses.replace(found, deliver=split.deliver, summary=summary), split


def _append_once(table: ArrowDelta, rows: pa.Table, txn: Txn) -> bool:
    """Append ``rows`` unless ``txn`` (or a later version of its app) is recorded; whether
    it appended."""
    recorded = table.txn_version(txn.app_id)
    if recorded is not None and recorded >= txn.version:
        return False
    table.append(rows, txn=txn)
    return True


def _from_ms(ms: int | None) -> datetime | None:
    """An aware datetime for epoch ms, or ``None`` when Python cannot represent it."""
    try:
        return from_millis(ms) if ms is not None else None
    except OverflowError:
        return None


__all__ = ["Delivery", "RoundResult"]
