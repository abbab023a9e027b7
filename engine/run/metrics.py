"""The engine's figures in Prometheus' text format, on a local HTTP port.

``delayq run`` (and ``jobs/delay_engine.py``) serves ``http://<metrics.host>:<metrics.port>/metrics``
next to the engine (``metrics.enabled``; loopback and any free port by default: set
``metrics.port`` to a fixed one for Prometheus to scrape). Every figure is read when scraped,
from what the engine holds in memory (and the streaming queries' last progress, which the
JVM holds), except three that need a query: the consumer lag and
the earliest pending deliver time (Spark), and the Kafka ingest's lag (its stream checkpoint
against Kafka's end offsets). A scrape that finds them older than
``metrics.refresh_interval`` starts a refresh in the background (in a Spark session of its
own) and shows the last values, so a scrape never waits for Spark and an engine nobody
scrapes runs no query.

| metric | type | labels | what |
|---|---|---|---|
| ``delayq_rounds_total`` | counter | | delivery rounds run (idle ones too) |
| ``delayq_rounds_committed_total`` | counter | | rounds that committed progress |
| ``delayq_round_errors_total`` | counter | | rounds that failed (and were retried) |
| ``delayq_round_stage_seconds_total`` | counter | ``stage`` | time per round stage |
| ``delayq_last_round_seconds`` | gauge | | the last round that delivered rows |
| ``delayq_delivered_total`` | counter | ``topic`` | rows written to topic tables |
| ``delayq_delivery_lateness_seconds`` | histogram | | ``delivered_ts - deliver_ts`` |
| ``delayq_query_last_batch_seconds`` | gauge | ``query`` | a streaming query's last batch |
| ``delayq_query_last_batch_id`` | gauge | ``query`` | its number |
| ``delayq_delivery_batch_lateness_seconds`` | gauge | ``stat`` | newest reporting batch |
| ``delayq_delivery_batch_rows`` | gauge | | rows it delivered |
| ``delayq_pending`` | gauge | ``queue``, ``label`` | rows waiting per level (``timer``: times) |
| ``delayq_watermark_timestamp_seconds`` | gauge | | rows due up to here are delivered |
| ``delayq_next_due_timestamp_seconds`` | gauge | | earliest pending deliver time |
| ``delayq_rate_waiting`` | gauge | ``topic`` | rows due, waiting for the topic's rate cap |
| ``delayq_rate_clears_timestamp_seconds`` | gauge | ``topic`` | when, at the cap, none waits |
| ``delayq_recurring_sent_total`` | counter | | occurrences of recurring schedules sent |
| ``delayq_recurring_skipped_total`` | counter | | missed occurrences skipped (catch-up) |
| ``delayq_stamped_total`` | counter | | rows stamped into ``schedule`` |
| ``delayq_quarantined_total`` | counter | | rows the engine refused |
| ``delayq_commands_total`` | counter | ``result`` | cancel/reschedule outcomes |
| ``delayq_consumer_lag`` | gauge | ``group``, ``topic`` | delivered, not yet committed |
| ``delayq_kafka_ingest_lag`` | gauge | ``kafka_topic`` | in Kafka, not yet in ``commitlog`` |

Counters count since the process started, as Prometheus expects (``rate()`` handles the
restart). Python code gets the same figures as they happen with
:meth:`engine.run.engine.Engine.add_listener`. The ``delayq_query_*`` and
``delayq_delivery_batch_*`` figures are Spark's own progress of the two streaming queries,
``delayq-stamp`` and ``delayq-deliver`` (the latter's observed metrics ``delayq``), as a
``StreamingQueryListener`` hears it: each query's ``lastProgress`` (held by the JVM, no
Spark job) and the figures the newest delivery batch reported (kept in memory).

Example:
    >>> server = MetricsServer(cfg, engine).start()  # doctest: +SKIP
    >>> server.url  # doctest: +SKIP
    'http://127.0.0.1:40577/metrics'
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.core.clock import to_millis
from engine.core.config import EngineConfig
from engine.core.errors import ConfigError
from engine.produce.ingest_lag import ingest_lag

if TYPE_CHECKING:
    from engine.run.engine import Engine

log = logging.getLogger(__name__)


@dataclass
class Queried:
    """The figures that need a query, as last refreshed."""

    lag: list[tuple[str, str, int]] = field(default_factory=list)  # group, topic, rows
    next_due_s: float | None = None
    refreshed: bool = False
    ingest_lag: dict[str, int] = field(default_factory=dict)  # Kafka topic -> records


def query_figures(spark: Any, cfg: EngineConfig) -> Queried:
    """Consumer lag per group and topic, and the earliest pending deliver time.

    Example:
        >>> query_figures(spark, cfg).lag  # doctest: +SKIP
        [('billing', 'orders', 12)]
    """
    from pyspark.sql import functions as F

    from engine.consume.lag import lag
    from engine.control.inspect import pending

    rows = lag(spark, cfg).select("group_name", "topic", "lag").collect()
    earliest = pending(spark, cfg).agg(F.unix_millis(F.min("deliver_ts")).alias("ms")).first()
    ms = earliest["ms"] if earliest is not None else None
    return Queried(
        [(r["group_name"], r["topic"], int(r["lag"] or 0)) for r in rows],
        None if ms is None else ms / 1000,
        True,
        _ingest_lag(cfg),
    )


def _ingest_lag(cfg: EngineConfig) -> dict[str, int]:
    """The Kafka ingest's lag per topic; empty when it never ran here or Kafka cannot be
    reached (then the figure is missing, not zero)."""
    try:
        return ingest_lag(cfg) or {}
    except Exception as err:  # KafkaError, or an unreadable checkpoint: a figure, not a failure
        log.warning("metrics: no Kafka ingest lag (%s: %s)", type(err).__name__, err)
        return {}


def _last_progress(query: Any) -> Any:
    """A streaming query's last progress (``None``: no query, no batch yet, or it ended)."""
    try:
        return query.lastProgress if query is not None else None
    except Exception:  # (the query ended meanwhile)
        return None


class EngineCollector(Collector):
    """Reads the engine's running totals when scraped (see the module's table).

    Args:
        engine: the engine whose figures are shown.
        on_scrape: called at each scrape before reading (the server's refresh check).
    """

    def __init__(self, engine: Engine, on_scrape: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.queried = Queried()
        self._on_scrape = on_scrape

    def _query_progress(self) -> Iterator[Metric]:
        """The streaming queries' last batches and the delivery batches' lateness, from
        Spark's progress of each query."""
        seconds = GaugeMetricFamily(
            "delayq_query_last_batch_seconds",
            "The streaming query's last batch, start to end (its progress' triggerExecution).",
            labels=["query"],
        )
        batch = GaugeMetricFamily(
            "delayq_query_last_batch_id", "The streaming query's last batch.", labels=["query"]
        )
        queries = (getattr(self.engine.stamper, "query", None), self.engine.deliver_query.query)
        for query in queries:
            progress = _last_progress(query)
            if progress is None:
                continue
            name = str(progress.name)
            seconds.add_metric([name], progress.durationMs.get("triggerExecution", 0) / 1000)
            batch.add_metric([name], progress.batchId)
        yield seconds
        yield batch
        figures = self.engine.deliver_query.figures()
        if figures:
            late = GaugeMetricFamily(
                "delayq_delivery_batch_lateness_seconds",
                "How late the rows the newest reporting delivery batch counted were (its "
                "progress' observed metrics: avg, p99 from the buckets, max).",
                labels=["stat"],
            )
            for stat in ("avg", "p99", "max"):
                late.add_metric([stat], figures[f"lateness_{stat}_ms"] / 1000)
            yield late
            yield GaugeMetricFamily(
                "delayq_delivery_batch_rows",
                "Rows the newest reporting delivery batch counted (its observed metrics).",
                value=figures["delivered_rows"],
            )

    def collect(self) -> Iterator[Metric]:
        """The metric families, from one read of the engine's totals."""
        if self._on_scrape is not None:
            self._on_scrape()
        stats, stamping = self.engine.stats, self.engine.stamper.stats
        progress = self.engine.delivery.progress
        levels = self.engine.cfg.levels

        yield _counter("delayq_rounds", "Delivery rounds run.", stats.rounds)
        yield _counter(
            "delayq_rounds_committed", "Rounds that committed progress.", stats.committed
        )
        yield _counter("delayq_round_errors", "Rounds that failed and were retried.", stats.errors)
        yield _labelled(
            "delayq_round_stage_seconds", "Time spent per round stage.", "stage",
            stats.stage_seconds,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "delayq_last_round_seconds",
            "Wall time of the last round that delivered rows.",
            value=stats.last_round_seconds,
        )
        yield _labelled(
            "delayq_delivered", "Rows written to topic tables.", "topic", stats.per_topic
        )
        late = stats.lateness
        histogram = HistogramMetricFamily(
            "delayq_delivery_lateness_seconds",
            "How late rows were delivered: delivered_ts - deliver_ts.",
        )
        histogram.add_metric([], late.cumulative(), sum_value=late.total_s)
        yield histogram
        yield from self._query_progress()
        pending = GaugeMetricFamily(
            "delayq_pending",
            "Rows waiting for delivery, per queue (a level's number, or timer).",
            labels=["queue", "label"],
        )
        for queue_id, q in sorted(progress.queues.items()):
            waiting = q.stamped_total - q.delivered_total - q.cancelled_total
            name = "timer" if queue_id < 0 else str(queue_id)
            pending.add_metric([name, levels.label(queue_id)], max(waiting, 0))
        yield pending
        yield GaugeMetricFamily(
            "delayq_watermark_timestamp_seconds",
            "Rows due up to this time are delivered (Unix seconds).",
            value=to_millis(progress.watermark) / 1000,
        )
        held = GaugeMetricFamily(
            "delayq_rate_waiting",
            "Rows due and waiting for their topic's delivery rate cap (delivery.max_rate).",
            labels=["topic"],
        )
        clears = GaugeMetricFamily(
            "delayq_rate_clears_timestamp_seconds",
            "When, at the topic's rate cap, the rows waiting will all be delivered (Unix s).",
            labels=["topic"],
        )
        for topic, rate in sorted(progress.rates.items()):
            held.add_metric([topic], rate.waiting)
            until = rate.clears_us()
            if until is not None:
                clears.add_metric([topic], until / 1e6)
        yield held
        yield clears
        queried = self.queried
        if queried.next_due_s is not None:
            yield GaugeMetricFamily(
                "delayq_next_due_timestamp_seconds",
                "The earliest deliver time of a pending row (Unix seconds).",
                value=queried.next_due_s,
            )
        recurring = self.engine.recurring
        yield _counter(
            "delayq_recurring_sent", "Occurrences of recurring schedules sent.", recurring.sent
        )
        yield _counter(
            "delayq_recurring_skipped",
            "Occurrences missed while no engine ran and skipped by their catch-up policy.",
            recurring.skipped,
        )
        yield _counter("delayq_stamped", "Rows stamped into schedule.", stamping.scheduled)
        yield _counter("delayq_quarantined", "Rows the engine refused.", stamping.quarantined)
        yield _labelled(
            "delayq_commands", "Cancel and reschedule outcomes.", "result", stats.commands
        )
        lag = GaugeMetricFamily(
            "delayq_consumer_lag",
            "Rows delivered to a topic and not yet committed by a group.",
            labels=["group", "topic"],
        )
        for group, topic, n in queried.lag:
            lag.add_metric([group, topic], n)
        yield lag
        behind = GaugeMetricFamily(
            "delayq_kafka_ingest_lag",
            "Kafka records not yet stored in commitlog by the ingest job, per Kafka topic.",
            labels=["kafka_topic"],
        )
        for kafka_topic, records in sorted(queried.ingest_lag.items()):
            behind.add_metric([kafka_topic], records)
        yield behind


class MetricsServer:
    """Serves :class:`EngineCollector` over HTTP; refreshes the queried figures when a
    scrape finds them stale.

    Nothing is opened until :meth:`start`.

    Args:
        cfg: ``metrics.host``, ``metrics.port`` and ``metrics.refresh_ms``.
        engine: the engine to show.
        session: a Spark session for the queries (``None``: no queried figures).
        clock: a monotonic clock in seconds (injected by tests).
    """

    def __init__(
        self,
        cfg: EngineConfig,
        engine: Engine,
        session: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.session = session
        self.collector = EngineCollector(engine, self._maybe_refresh)
        self._clock = clock
        self._server: Any = None
        self._refreshed_at: float | None = None
        self._refreshing = threading.Lock()

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def start(self) -> MetricsServer:
        """Listen; returns ``self``.

        Raises:
            ConfigError: the address cannot be listened on.
        """
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        try:
            self._server, _ = start_http_server(
                self.cfg.metrics_port, addr=self.cfg.metrics_host, registry=registry
            )
        except OSError as err:
            raise ConfigError(
                "metrics.port",
                f"{self.cfg.metrics_host}:{self.cfg.metrics_port}",
                f"cannot listen there ({err.strerror or err}): choose another metrics.port "
                "(0: any free one) or set metrics.enabled=false",
            ) from None
        return self

    def refresh(self) -> None:
        """Run the queries now, in the calling thread."""
        with self._refreshing:
            if self.session is None:
                return
            self._refreshed_at = self._clock()
            try:
                self.collector.queried = query_figures(self.session, self.cfg)
            except Exception:  # the figures go stale; the engine carries on
                log.warning("metrics: the consumer lag query failed", exc_info=True)

    def _maybe_refresh(self) -> None:
        stale = (
            self._refreshed_at is None
            or self._clock() - self._refreshed_at >= self.cfg.metrics_refresh_ms / 1000
        )
        if self.session is not None and stale and not self._refreshing.locked():
            threading.Thread(target=self.refresh, name="delayq-metrics", daemon=True).start()

    def stop(self) -> None:
        """Stop answering; waits for a refresh in progress (its Spark must not stop under it)."""
        with self._refreshing:
            self.session = None  # no refresh starts from now on
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, text, value=value)


def _labelled(name: str, text: str, label: str, values: Mapping[str, float]) -> Metric:
    """A counter family with one sample per key of ``values``."""
    family = CounterMetricFamily(name, text, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


__all__ = ["EngineCollector", "MetricsServer", "Queried", "query_figures"]
