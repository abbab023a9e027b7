"""Run the engine: the stamping and delivery stages, with progress and status.

Both run in one Spark application:

* ``delayq-stamp``: follows ``commitlog``'s Delta log and stamps each batch of new files into
  ``schedule`` / ``quarantine``, looking for new commits every ``stamp.interval``: a driver
  thread (:class:`~engine.stamp.stamper.Stamper`, ``stamp.mode = driver``), or a Structured
  Streaming query of that name (:class:`~engine.stamp.query.StampQuery`,
  ``stamp.mode = streaming``), which a thread of the same name starts and watches;
* ``delayq-deliver``: one delivery round (:meth:`Delivery.run_round`) every
  ``delivery.poll_interval`` (a driver thread, or with ``delivery.mode = streaming`` the
  Structured Streaming query of that name, :class:`~engine.deliver.query.DeliverQuery`;
  at once when a round took longer), planned a little ahead of
  the clock (up to ``delivery.max_lead``: the topic files are written before the round's
  watermark, and committed once it is reached); after each round the engine
  names new topic tables in the SQL catalog (:class:`~engine.lakehouse.catalog.names.Catalog`).
  A round's exactly-once state is its own (the delayOffset checkpoint): the query's
  offsets log only plans each round's watermark, and the thread needs neither.

Example:
    >>> engine = Engine(spark, cfg).open()       # doctest: +SKIP
    >>> engine.run(until_idle=True)              # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from engine.control.status import RowCounts, Status, read_status
from engine.core.clock import Clock, SystemClock
from engine.core.config import EngineConfig
from engine.core.errors import (
    DelayQError,
    DeliveryError,
    FencedError,
    RetryableError,
    StampError,
    one_line,
)
from engine.deliver.lateness import Lateness
from engine.deliver.query import Delivered, DeliverQuery
from engine.deliver.repair import check_checkpoints, correct_deliver_timestamps
from engine.deliver.round import Delivery, RoundResult
from engine.deliver.sinks import SinkFactory, Sinks
from engine.lakehouse.catalog.names import Catalog
from engine.lakehouse.delta.delta_log import Txn, check_tables_keep_txn
from engine.lakehouse.delta.tables import ensure_tables
from engine.lakehouse.state.lease import Heartbeat, Lease
from engine.lakehouse.storage.layout import layout
from engine.produce.send import send_arrow
from engine.recur.fire import Firing
from engine.recur.requests import ScheduleRequests, requests_table
from engine.run.failures import is_transient, retry_or_stop
from engine.run.upkeep import Upkeep
from engine.stamp.query import StampQuery
from engine.stamp.stamper import Stamper

log = logging.getLogger("delayq")

STAMP_QUERY = "delayq-stamp"
DELIVER_QUERY = "delayq-deliver"
#: The thread that stamps and delivers on the driver while Spark starts the queries.
FIRST_THREAD = "delayq-first"
ERROR_BACKOFF_S = 10.0  # RocketMQ waits 10 s after a failed delivery attempt
MAX_FAILED_ROUNDS = 30  # about 5 minutes of failures in a row stops the engine
IDLE_CHECK_S = 1.0  # how often --until-idle asks the tables whether anything is pending
#: Spark's status while a trigger asks the source for its latest offset: no batch runs yet.
ASKING_SOURCE = "Getting offsets from"
STOP_WAIT_S = 60.0  # longest stop() waits for a delivery round or stamping batch in progress
RECURRING_INTERVAL_S = 1.0  # how often recurring schedules are looked at (engine.recur.fire)


@dataclass
class DeliveryStats:
    """Running totals of the delivery stage since the process started.

    ``recent`` keeps the last rounds' results (timings, rows and files read) for
    monitoring and the benchmark; the other totals feed :mod:`engine.run.metrics`.
    """

    recent: deque[RoundResult] = field(default_factory=lambda: deque(maxlen=10_000))
    rounds: int = 0
    committed: int = 0
    delivered: int = 0
    errors: int = 0
    failing: int = 0
    last_error: str = ""
    last_round_seconds: float = 0.0
    per_topic: dict[str, int] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    commands: dict[str, int] = field(default_factory=dict)
    lateness: Lateness = field(default_factory=Lateness)

    def record(self, result: RoundResult) -> None:
        """Add one round's figures."""
        self.failing = 0
        self.rounds += 1
        self.committed += result.committed
        self.recent.append(result)
        self.delivered += result.delivered
        if result.delivered:
            self.last_round_seconds = result.seconds
        _add(self.per_topic, result.per_topic)
        _add(self.stage_seconds, result.stages)
        _add(self.commands, result.commands)
        self.lateness = self.lateness + result.lateness


def _add(totals: dict[str, Any], more: Mapping[str, Any]) -> None:
    for name, value in more.items():
        totals[name] = totals.get(name, 0) + value


#: Called with each round's result, in the delivery thread (see :meth:`Engine.add_listener`).
RoundListener = Callable[[RoundResult], None]


class Engine:
    """The delayed-delivery engine over one lakehouse.

    The constructor only holds what it is given; :meth:`open` creates and migrates the
    tables, checks the checkpoints, replays an interrupted round and corrects deliver times.
    :meth:`run`, :meth:`start` and :meth:`step` open the engine if it is not open yet.

    Args:
        spark: a Delta-enabled session (:func:`engine.lakehouse.catalog.session.build_spark`).
        cfg: engine configuration.
        clock: the engine clock; the system clock by default.
        out: where progress lines go.
        sinks: builds the topic sinks of a delivery checkpoint (default: as ``kafka.sinks``
            says).
    """

    def __init__(
        self,
        spark: SparkSession,
        cfg: EngineConfig,
        clock: Clock | None = None,
        out: Callable[[str], None] = print,
        sinks: SinkFactory = Sinks,
    ) -> None:
        self.spark = spark
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.out = out
        self.layout = layout(cfg)
        # The lease is about real time between processes: the system clock, always.
        self.lease = Lease(layout(cfg).root, SystemClock(), cfg.lease_timeout_ms)
        self.stamper = self._stamping(self.lease.check)
        self._sinks = sinks
        self.delivery = Delivery(spark, cfg, self.layout, self.clock, sinks, fence=self.lease.check)
        self.catalog = Catalog(spark, cfg)
        self.deliver_query = DeliverQuery(
            spark, cfg, self.layout, self._deliver_until, self._watermark
        )
        self.stats = DeliveryStats()
        self.recurring = Firing(
            cfg,
            self.clock,
            send=self._send_recurring,
            published=self.catalog.after_publish,
        )
        self.requests = ScheduleRequests(
            cfg, self.clock, fence=self.lease.check, applied=self.catalog.after_requests
        )
        self._recurring: Upkeep | None = None  # fires recurring schedules while started
        self._requests_error = ""  # why schedule requests could not be applied, last said
        self._row_counts = RowCounts()  # status(): each table's log followed from call to call
        self._listeners: list[RoundListener] = []
        self._loop: threading.Thread | None = None
        self._stamp_loop: threading.Thread | None = None
        self._first: threading.Thread | None = None  # the first batches, while queries start
        self._loop_error: BaseException | None = None
        self._stopping = threading.Event()
        self._round = threading.Lock()  # held while a delivery round runs
        self._heartbeat: Heartbeat | None = None
        self._opened = False

    # ----------------------------------------------------------------- start-up

    def open(self) -> Engine:
        """Create or upgrade the tables, check the checkpoints, recover; returns ``self``.

        Raises:
            CheckpointError: when a checkpoint is missing but the tables it guards are not
                empty (starting would stamp or deliver everything again).
            SetupError: a table the engine writes lets Delta forget its ``txn`` records
                (``delta.setTransactionRetentionDuration``), naming it and the property.
        """
        if self._opened:
            return self
        self.hold()
        ensure_tables(self.spark, self.cfg)
        requests_table(self.cfg)  # (SQL users insert their schedule changes there)
        check_tables_keep_txn(self.cfg)
        self.delivery.open()
        check_checkpoints(
            self.spark,
            self.cfg,
            self.layout,
            self.delivery.progress,
            self.delivery.pending,
            self.stamper.has_state(),
        )
        self.catalog.open()
        self._recover()
        self._opened = True
        return self

    def hold(self, stop: threading.Event | None = None, keep: bool = False) -> None:
        """Take the lakehouse's lease unless this engine holds it (one engine per lakehouse).

        Args:
            stop: with ``lease.standby``, give up waiting once this is set (Ctrl-C).
            keep: renew the lease in the background from now on (until :meth:`stop`), as a
                running engine does; without it, each :meth:`step` renews it.

        Raises:
            LakehouseHeldError: another engine holds the lakehouse; the message names it
                (host, pid, since when). With ``lease.standby`` this waits instead.
        """
        if not self.lease.held:
            self.lease.acquire(standby=self.cfg.lease_standby, stop=stop)
            if self._opened:
                # Held again after a stop: another engine may have run meanwhile, so what
                # this one knew (progress, the next batch) is read again.
                self._reload()
        if keep and self._heartbeat is None and self.lease.held:
            self._heartbeat = Heartbeat(self.lease, self._fenced).start()

    def _stamping(self, fence: Callable[[], None]) -> Stamper | StampQuery:
        """The stamping stage ``stamp.mode`` names: a driver thread's batches, or the
        Structured Streaming query ``delayq-stamp``."""
        if self.cfg.stamp_mode == "streaming":
            return StampQuery(self.spark, self.cfg, self.layout, self.clock, fence=fence)
        return Stamper(self.spark, self.cfg, self.layout, self.clock, fence=fence)

    def _reload(self) -> None:
        fence = self.lease.check
        if self._round.acquire(timeout=STOP_WAIT_S):  # never mid-round (a stale loop's)
            try:
                self.delivery.close()
            finally:
                self._round.release()
        self.stamper = self._stamping(fence)
        self.delivery = Delivery(
            self.spark, self.cfg, self.layout, self.clock, self._sinks, fence=fence
        )
        self.recurring.reset()  # (another engine may have fired schedules meanwhile)
        self.requests.reset()
        self._opened = False
        self.open()

    def _recover(self) -> None:
        if self.delivery.pending is not None:
            plan = self.delivery.pending
            self.out(
                f"replaying interrupted delivery round {plan.round} (watermark {plan.watermark})"
            )
            try:
                result = self._deliver()
            except RetryableError as err:  # e.g. a listing that missed the newest commit
                log.warning(
                    "replaying round %d: %s; the delivery stage tries again", plan.round, err
                )
            else:
                self.out(f"round {result.round} replayed: {result.delivered} rows written")
        # A plan still pending (its replay waits for the clock) has fixed a later watermark.
        floor = (self.delivery.pending or self.delivery.progress).watermark
        corrected = correct_deliver_timestamps(
            self.spark, self.cfg, self.layout, self.clock.now(), floor
        )
        if corrected:
            self.out(
                f"{corrected} scheduled rows were due later than their level now allows "
                "(level table shortened or clock moved): they are due now"
            )

    # ----------------------------------------------------------------- stepping

    def stamp_available(self) -> int:
        """Stamp everything in ``commitlog`` now; returns how many rows were stamped."""
        self.open()
        self.hold()
        self._renew()
        return self.stamper.run_available()

    def step(self) -> RoundResult:
        """Fire recurring schedules, stamp what is available, then run one delivery round;
        for tests and notebooks."""
        self.open()
        self._schedules()
        self.stamp_available()
        return self._deliver()

    def _schedules(self) -> None:
        """Apply the schedule changes asked for in SQL, then fire recurring schedules (also
        when the requests cannot be applied now: they wait, firing does not)."""
        try:
            self.requests.apply()
            self._requests_error = ""
        except FencedError:
            raise
        except Exception as err:
            said = f"{type(err).__name__}: {err}"
            if said != self._requests_error:  # (once until it changes: it is retried each second)
                log.warning("schedule requests not applied now (%s)", said)
            self._requests_error = said
        self.recurring.run()

    def _send_recurring(self, rows: pa.Table, txn: Txn) -> None:
        """Recurring schedules' messages into ``commitlog``, one commit (a fenced engine
        sends nothing)."""
        self.lease.check()
        send_arrow(self.spark, self.cfg, rows, self.clock, txn=txn)

    def _renew(self) -> None:
        """Without the background renewal (stepping by hand), renew at each step."""
        if self._heartbeat is None:
            self.lease.renew()

    def _watermark(self) -> datetime:
        """The watermark delivery has reached (a pending round's, if one waits)."""
        return (self.delivery.pending or self.delivery.progress).watermark

    def _deliver_until(self, until: datetime) -> Delivered:
        """One round of the delivery query's batch, capped at its watermark: how late its
        rows were, and what it found (the query holds its watermark while nothing can be
        due)."""
        with self._round:
            if self._stopping.is_set():
                return Delivered(None)
            result = self._deliver(ahead=True, until=until)
            try:
                return Delivered(self.delivery.quiet(until), result.lateness)
            except Exception:  # (an optimisation: without a record, the next trigger runs)
                log.warning("could not tell when the next row falls due", exc_info=True)
                return Delivered(None, result.lateness)

    def _deliver(self, ahead: bool = False, until: datetime | None = None) -> RoundResult:
        result = self.delivery.run_round(self.delivery.lead_ms() if ahead else 0, until=until)
        # Outside the round's exactly-once section: name the tables it made.
        delta = [t for t in result.per_topic if self.cfg.sink(t) != "kafka"]
        self.catalog.after_round(delta, result.committed)
        self.stats.record(result)
        for listener in list(self._listeners):
            try:
                listener(result)
            except Exception:  # a listener's bug must not stop delivery
                log.exception("round listener %r failed", listener)
        return result

    def add_listener(self, listener: RoundListener) -> None:
        """Call ``listener(result)`` after every delivery round (as Spark's
        ``StreamingQueryListener.onQueryProgress`` does), in the delivery thread: keep it
        quick. An exception it raises is logged and ignored.

        Example:
            >>> engine.add_listener(lambda r: print(r.round, r.delivered, r.lateness.n))
            ... # doctest: +SKIP
        """
        self._listeners.append(listener)

    def remove_listener(self, listener: RoundListener) -> None:
        """Stop calling ``listener``."""
        self._listeners.remove(listener)

    # ----------------------------------------------------------------- background

    def _stamping_loop(self) -> None:
        stamper = self.stamper
        if isinstance(stamper, StampQuery):
            self._stamping_query(stamper)
            return
        interval = self.cfg.stamp_interval_ms / 1000
        failing = 0
        try:
            while not self._stopping.is_set():
                try:
                    if stamper.run_batch() is not None:
                        failing = 0
                        continue  # more may be waiting: look again at once
                    failing = 0
                except DelayQError as err:
                    if not isinstance(err, RetryableError):
                        raise
                    failing = self._stamping_failed(err, failing)
                except Exception as err:  # storage failures: the plan makes a retry safe
                    if self._stopping.is_set():
                        return  # interrupted by stop(): the plan is run again at restart
                    retry_or_stop(err)  # (a mistake or a bug is the same every time: it stops)
                    failing = self._stamping_failed(err, failing)
                self._stopping.wait(interval)
        except BaseException as err:  # terminal: run() (check_queries) reports it
            log.error("the stamping stage stopped: %s", err, exc_info=err)
            self._loop_error = err
            self._stop_renewing()

    def _stamping_query(self, stamping: StampQuery) -> None:
        """Run the ``delayq-stamp`` query until stopping (see :meth:`_supervise`)."""
        failing = 0
        batches = 0

        def watch(query: StreamingQuery) -> None:
            nonlocal failing, batches
            if not stamping.stats.looks and query.lastProgress is not None:
                stamping.stats.looks = 1  # a first trigger done (asked until then only)
            if stamping.stats.batches > batches:
                batches, failing = stamping.stats.batches, 0

        def failed(err: BaseException) -> None:
            nonlocal failing
            failing = self._stamping_failed(err, failing)

        self._supervise(stamping.start, stamping.failure, stamping.stop, failed, watch)

    def _delivery_query(self) -> None:
        """Run the ``delayq-deliver`` query until stopping (see :meth:`_supervise`)."""
        query = self.deliver_query
        self._supervise(query.start, query.failure, query.stop, self._retry_later)

    def _supervise(
        self,
        start: Callable[[], StreamingQuery],
        failure: Callable[[], BaseException | None],
        stop: Callable[[], None],
        failed: Callable[[BaseException], None],
        watch: Callable[[StreamingQuery], None] | None = None,
    ) -> None:
        """Run a stage's streaming query until the engine stops; after a failure that can
        pass, ``failed`` waits (or gives up, raising) and the query starts again: its
        offsets log makes the rerun of its last batch cover the same range. Any other
        failure ends the stage, and :meth:`check_queries` reports it."""
        try:
            while not self._stopping.is_set():
                try:
                    query = start()
                    while query.isActive and not self._stopping.wait(0.1):
                        if watch is not None:
                            watch(query)
                    if self._stopping.is_set():
                        _settle(query)
                        return
                    err = failure()
                    if err is None:
                        raise DelayQError(f"the streaming query {query.name} stopped on its own")
                except Exception as caught:  # starting or watching it failed
                    if self._stopping.is_set():
                        return
                    err = caught
                retry_or_stop(err)  # (a mistake or a bug is the same every time: it stops)
                failed(err)
        except BaseException as err:  # terminal: run() (check_queries) reports it
            log.error("the %s stage stopped: %s", threading.current_thread().name, err,
                      exc_info=err)  # fmt: skip
            self._loop_error = err
            self._stop_renewing()
        finally:
            try:
                stop()
            except Exception:  # the stage's own error (if any) is the one to report
                log.warning("stopping a streaming query failed", exc_info=True)

    def _stop_renewing(self) -> None:
        """A stage died: let the lease run out, so that a standby may take over."""
        heartbeat = self._heartbeat
        if heartbeat is not None:
            heartbeat.stop()

    def _stamping_failed(self, err: BaseException, failing: int) -> int:
        failing += 1
        if failing >= MAX_FAILED_ROUNDS:
            last = one_line(err)
            raise StampError(f"{failing} stamping batches failed in a row; last: {last}")
        log.error("stamping batch failed; retrying in %.0f s", ERROR_BACKOFF_S, exc_info=err)
        self._stopping.wait(ERROR_BACKOFF_S)
        return failing

    def _delivery_loop(self) -> None:
        if self.cfg.delivery_mode == "streaming":
            self._delivery_query()
            return
        interval = self.cfg.poll_interval_ms / 1000
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                self._tick()
                self._stopping.wait(max(0.0, started + interval - time.monotonic()))
        except BaseException as err:  # terminal: run() (check_queries) reports it
            log.error("the delivery stage stopped: %s", err, exc_info=err)
            self._loop_error = err
            self._stop_renewing()

    def _tick(self) -> None:
        if self._stopping.is_set():
            return
        try:
            with self._round:
                if self._stopping.is_set():
                    return
                self._deliver(ahead=True)  # real time here: a round may be planned ahead
        except DelayQError as err:
            if not isinstance(err, RetryableError):
                raise  # terminal: ends the delivery loop, and run() reports it
            self._retry_later(err)
        except Exception as err:  # Spark/storage failures: the plan makes a retry safe
            if self._stopping.is_set():
                return  # interrupted by stop(): the plan (if any) is replayed at restart
            retry_or_stop(err)  # (a mistake or a bug is the same every time: it stops)
            self._retry_later(err)

    def _retry_later(self, err: BaseException) -> None:
        self.stats.errors += 1
        self.stats.failing += 1
        self.stats.last_error = one_line(err)
        if self.stats.failing >= MAX_FAILED_ROUNDS:
            # The same failure for minutes is not transient: stop and say so.
            failed = f"{self.stats.failing} delivery rounds failed in a row"
            raise DeliveryError(f"{failed}; last: {self.stats.last_error}") from err
        log.error("delivery round failed; retrying in %.0f s", ERROR_BACKOFF_S, exc_info=err)
        self._stopping.wait(ERROR_BACKOFF_S)

    def start(self) -> None:
        """Start the stamping and delivery stages in the background."""
        if any(t is not None and t.is_alive() for t in (self._loop, self._stamp_loop, self._first)):
            raise RuntimeError("the engine is running: stop() it before starting it again")
        self.hold(keep=True)  # renewing from now: opening may take longer than the lease
        self.open()
        self._stopping.clear()
        self._loop_error = None
        try:
            first = self._plan_first()
        except BaseException:
            self.stop()  # (the heartbeat runs: release the lease, as a failed start must)
            raise
        self._stamp_loop = threading.Thread(
            target=self._stamping_loop, name=STAMP_QUERY, daemon=True
        )
        self._stamp_loop.start()
        self._loop = threading.Thread(target=self._delivery_loop, name=DELIVER_QUERY, daemon=True)
        self._loop.start()
        if first:
            self._first = threading.Thread(
                target=self._first_batches, name=FIRST_THREAD, daemon=True
            )
            self._first.start()
        self._recurring = Upkeep(
            self._schedules, RECURRING_INTERVAL_S, "delayq-recurring", "firing schedules"
        ).start()

    def _plan_first(self) -> bool:
        """Claim the stamping query's first batch for :meth:`_first_batches`; whether one was.

        Raises:
            CheckpointError: the stamping log holds another range for that batch.
        """
        if not isinstance(self.stamper, StampQuery):
            return False
        before = self.lease.before
        if before is not None and before.may_still_run():
            # A stalled engine's query may yet plan that batch in Spark's log (its batches
            # are fenced, its plans are not): only the query plans, as Spark's log says.
            return False
        try:
            return bool(self.stamper.plan_first())
        except Exception as err:
            if not is_transient(err):
                raise
            log.warning("planning a first stamping batch on the driver: %s", err)
            return False  # (the query plans it, and retries what fails again)

    def _first_batches(self) -> None:
        """While Spark starts the queries (seconds): stamp the batch claimed for the stamping
        query's first (:meth:`StampQuery.plan_first`) and run a delivery round, on the driver,
        so what was sent before a start is delivered that much sooner. A failure here is the
        queries' to meet again: their first batches run the same work."""
        assert isinstance(self.stamper, StampQuery)
        if self._stopping.is_set():
            return
        try:
            if not self.stamper.stamp_first():
                return  # the query stamped them first
        except Exception as err:
            log.warning("stamping before the query started: %s (the query stamps it)", err)
            return
        if self.cfg.delivery_mode != "streaming":
            return  # (the driver thread's rounds run from the start)
        with self._round:
            if self._stopping.is_set():
                return
            try:
                self._deliver()
            except Exception as err:
                log.warning("a delivery round before the query started: %s (it runs them)", err)

    def _fenced(self, err: FencedError) -> None:
        """Another engine took the lakehouse over: stop both stages, report the error."""
        log.error("%s", err)
        self._loop_error = err
        self._stopping.set()

    def stop(self) -> None:
        """Stop the delivery and stamping stages; a round or batch in progress finishes first,
        within ``STOP_WAIT_S`` (one cut short, or by the process dying, is run again at the
        next start)."""
        self._stopping.set()
        if self._recurring is not None:
            self._recurring.stop(STOP_WAIT_S)
            self._recurring = None
        if self._round.acquire(timeout=STOP_WAIT_S):  # no new round starts once stopping
            self._round.release()
        for attr in ("_first", "_loop", "_stamp_loop"):
            thread = getattr(self, attr)
            if thread is not None:
                thread.join(timeout=STOP_WAIT_S)
                if not thread.is_alive():
                    setattr(self, attr, None)
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._loop is None and self._first is None:
            self.delivery.close()  # its Kafka producers: no round runs
        if self._loop is None and self._stamp_loop is None and self._first is None:
            self.lease.release()  # nothing runs: the next engine may take over at once

    def warm(self) -> bool:
        """Whether the stamping stage has looked at ``commitlog`` and the delivery stage has
        done a first round: from then on what is sent is stamped and delivered on time."""
        return self.stamper.warm() and self.stats.rounds > 0

    def wait_until_warm(
        self, timeout_s: float = 120.0, stop: threading.Event | None = None
    ) -> None:
        """Wait until the stamping stage has looked at ``commitlog`` and the delivery stage has
        done a first round.

        The first batches of a fresh JVM take several seconds. Returns early once ``stop`` is
        set.
        """
        stop = stop or threading.Event()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.warm():
            self.check_queries()
            if stop.wait(0.2):
                return

    def check_queries(self) -> None:
        """Raise if the stamping or the delivery stage has stopped with an error.

        Raises:
            DelayQError: a stage's terminal error (e.g. rounds failing for minutes), as it
                was raised.
        """
        if self._loop_error is not None:
            raise self._loop_error

    # ----------------------------------------------------------------- status

    def status(self) -> Status:
        """What is sent, pending per level, delivered and quarantined, right now."""
        self.open()
        return read_status(
            self.spark, self.cfg, self.layout, self.delivery.progress, self._row_counts
        )

    def progress_line(self) -> str:
        """The status as one line, with the delivery stage's error count if any."""
        line = self.status().line(self.cfg.levels.label)
        if self.stats.last_round_seconds:
            line += f" | last round {self.stats.last_round_seconds:.1f}s"
        figures = self.deliver_query.figures() if self.cfg.delivery_mode == "streaming" else None
        if figures:
            line += (f" | {DELIVER_QUERY} batch: {int(figures['delivered_rows']):,} rows, "
                     f"p99 {figures['lateness_p99_ms']:.0f} ms late")  # fmt: skip
        if self.stats.errors:
            line += f" | errors {self.stats.errors} (last: {self.stats.last_error})"
        return line

    def run(
        self,
        until_idle: bool = False,
        max_seconds: float | None = None,
        when_warm: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
    ) -> Status:
        """Run until stopped (``stop`` set, or Ctrl-C), or until nothing is pending.

        Prints a progress line every ``delivery.progress_interval``.

        Args:
            until_idle: stop once every message sent is delivered or quarantined (recurring
                schedules' occurrences count once sent, about 10 s before they are due).
            max_seconds: stop after this long whatever is pending.
            when_warm: called once stamping and delivery have each done a first batch (the first
                batches of a fresh JVM take several seconds), e.g. to send a demo set.
            stop: stop cleanly once this is set (:class:`~engine.run.signals.StopSignals` sets
                it on Ctrl-C or SIGTERM).

        Returns:
            The status when the run ended.
        """
        stop = stop or threading.Event()
        interval = self.cfg.progress_interval_ms / 1000
        self.hold(stop, keep=True)
        if stop.is_set():
            return self.status()  # stopped while standing by
        launched = time.monotonic()
        self.start()
        try:
            if when_warm is not None:
                self.wait_until_warm(stop=stop)
                if not stop.is_set():
                    when_warm()
            started = time.monotonic()
            next_line = started
            next_idle_check = started
            warm = False
            while True:
                if stop.is_set():
                    raise KeyboardInterrupt  # handled below, like a Ctrl-C without handlers
                self.check_queries()
                now = time.monotonic()
                if not warm and self.warm():
                    warm = True
                    self.out(f"delayq: stamping and delivering ({now - launched:.1f} s to warm up)")
                if now >= next_line:
                    self.out(f"[{self.clock.now():%H:%M:%S}] {self.progress_line()}")
                    next_line = now + interval
                if until_idle and now >= next_idle_check:
                    if self.recurring.caught_up() and self.status().idle:
                        break
                    next_idle_check = now + IDLE_CHECK_S
                if max_seconds is not None and now - started > max_seconds:
                    self.out(f"stopping after --max-seconds {max_seconds:g}")
                    break
                stop.wait(min(0.5, interval))
        except KeyboardInterrupt:
            self.out("interrupted: stopping cleanly (finishing the delivery round in progress)")
        finally:
            self.stop()
        final = self.status()
        self.out(f"[{self.clock.now():%H:%M:%S}] {final.line(self.cfg.levels.label)}")
        return final


def _settle(query: StreamingQuery, wait_s: float = STOP_WAIT_S) -> None:
    """Let a stopping query's batch in progress finish (at most ``wait_s``) before the query
    is stopped, as the driver threads finish theirs: a delivery round names the tables it
    made and a stamping batch commits both tables, instead of being interrupted (and run
    again at the next start). New batches do nothing once the engine is stopping."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            status = query.status
            if not query.isActive or not status["isTriggerActive"]:
                return
            if str(status["message"]).startswith(ASKING_SOURCE):
                return  # asking the source for new data (an idle stamping look may wait)
        except Exception:  # (the query ended meanwhile)
            return
        time.sleep(0.05)
