"""What a ``delayq-deliver`` batch reports to Spark's progress: the rows its rounds delivered
and their lateness, once each, even when a batch cannot report (Spark stubbed: no JVM)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa

from engine.core.config import EngineConfig
from engine.deliver.lateness import LATENESS_BOUNDS, Lateness
from engine.deliver.query import FIGURES_PROPERTY, Delivered, DeliverQuery, figures
from engine.lakehouse.storage.layout import layout

NOON = datetime(2026, 11, 29, 12, tzinfo=UTC)


class _Context:
    """A SparkContext's job properties and running jobs."""

    def __init__(self) -> None:
        self.properties: dict[str, str | None] = {}
        self.running: list[int] = []
        self.jobs: list[dict[str, float]] = []  # the figures each report job read
        self.fail = False

    def statusTracker(self) -> Any:
        return self

    def getActiveJobsIds(self) -> list[int]:
        return self.running

    def setLocalProperty(self, key: str, value: str | None) -> None:
        self.properties[key] = value


class _Frame:
    def __init__(self, context: _Context) -> None:
        self.context = context

    def collect(self) -> list[Any]:
        if self.context.fail:
            raise RuntimeError("Python worker failed to connect back")
        self.context.jobs.append(json.loads(self.context.properties[FIGURES_PROPERTY] or ""))
        return []


def _late(*ms: int) -> Lateness:
    due = pa.array([NOON - timedelta(milliseconds=m) for m in ms], pa.timestamp("us", "UTC"))
    return Lateness.of(due, NOON)


def _query(tmp_path: Path, rounds: list[Lateness]) -> tuple[DeliverQuery, _Context]:
    context = _Context()
    spark: Any = type("Spark", (), {"sparkContext": context})()
    cfg = EngineConfig(lakehouse=str(tmp_path))
    lay = layout(cfg)
    query = DeliverQuery(spark, cfg, lay, lambda _wm: Delivered(None, rounds.pop(0)), lambda: NOON)
    query.checkpoint = str(tmp_path / "checkpoint")
    query.report_every_s = 0.0  # (test_a_batch_reports_at_most_once_a_second: the default)
    return query, context


def _batch(query: DeliverQuery, context: _Context, monkeypatch: Any) -> None:
    monkeypatch.setattr("engine.deliver.query.batch_watermark", lambda _cp, _id: NOON)
    query._run(_Frame(context), 0)  # type: ignore[arg-type]


def test_rounds_a_batch_could_not_report_come_summed_with_the_next_that_reports(
    tmp_path: Path, monkeypatch: Any
) -> None:
    query, context = _query(tmp_path, [_late(100, 300), Lateness(), _late(40), _late(2_000)])
    context.running = [7]  # a round written ahead: this batch's report would wait behind it
    _batch(query, context, monkeypatch)
    assert context.jobs == [] and query.figures() is None
    context.running = []
    _batch(query, context, monkeypatch)  # delivered nothing itself: reports the first round
    _batch(query, context, monkeypatch)
    assert [j["delivered_rows"] for j in context.jobs] == [2, 1]
    assert context.jobs[0]["lateness_max_ms"] == 300.0
    assert context.jobs[0]["lateness_avg_ms"] == 200.0
    assert context.properties[FIGURES_PROPERTY] is None, "the property outlives the report"

    context.fail = True  # a report that fails: the batch goes on, reporting stops
    _batch(query, context, monkeypatch)
    assert len(context.jobs) == 2 and query.figures() == figures(_late(40))


def test_the_p99_comes_from_the_buckets_and_never_passes_the_latest_row() -> None:
    late = _late(*([10] * 98 + [400, 450]))
    assert late.max_s == 0.45 and late.n == 100
    assert 0.25 <= late.quantile(0.99) <= 0.45
    assert _late(30).quantile(0.99) == 0.03  # one row: capped at it, not at its bucket's 0.05
    assert Lateness().quantile(0.99) == 0.0
    assert len(late.counts) == len(LATENESS_BOUNDS) + 1


def test_a_batch_reports_at_most_once_a_second_the_rounds_between_summed(
    tmp_path: Path, monkeypatch: Any
) -> None:
    query, context = _query(tmp_path, [_late(10), _late(20), _late(30)])
    query.report_every_s = 60.0
    for _ in range(3):
        _batch(query, context, monkeypatch)
    assert [j["delivered_rows"] for j in context.jobs] == [1]
    query.report_every_s, query._next_report = 60.0, 0.0  # a minute later
    query._unreported += Lateness()  # (nothing new: the two rounds waiting are reported)
    query._report(_Frame(context))  # type: ignore[arg-type]
    assert [j["delivered_rows"] for j in context.jobs] == [1, 2]
    assert context.jobs[1]["lateness_max_ms"] == 30.0
