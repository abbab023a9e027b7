"""Prometheus metrics of a running engine, scraped over HTTP and checked against the tables."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import engine.run.metrics as metrics_module
from engine.consume.consumer import Consumer
from engine.consume.lag import lag
from engine.control.commands import cancel
from engine.control.inspect import pending
from engine.core.clock import FakeClock, to_millis
from engine.core.config import EngineConfig
from engine.deliver.lateness import LATENESS_BOUNDS
from engine.deliver.round import RoundResult
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from engine.run.metrics import MetricsServer
from schemas import COMMITLOG
from tests.support.lakehouse import START, delivered_rows, quiet_engine
from tests.support.scrape import scrape

pytestmark = pytest.mark.integration


def test_scraped_metrics_match_the_tables(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (no Kafka here: the ingest lag would wait 5 s for the default broker; test_kafka.py)
    monkeypatch.setattr(metrics_module, "_ingest_lag", lambda _cfg: {})
    lay = layout(cfg)
    ids = send_many(
        spark,
        cfg,
        [Message("orders", f"o{i}", delay_level=1) for i in range(3)]
        + [Message("billing", f"b{i}", delay_level=2) for i in range(2)]
        + [Message("orders", "later", delay="1h"), Message("orders", "dropped", delay_level=3)],
        clock,
    )
    # A row another writer put in commitlog without a topic: quarantined by the engine.
    bad = {c: None for c in COMMITLOG.fieldNames()} | {"msg_id": "NO-TOPIC", "body": b"x"}
    spark.createDataFrame([bad], COMMITLOG).write.format("delta").mode("append").save(lay.commitlog)
    engine = quiet_engine(spark, cfg, clock)
    rounds: list[RoundResult] = []
    engine.add_listener(rounds.append)
    engine.step()
    cancel(spark, cfg, ids[-1], wait=0, clock=clock)
    clock.advance(millis=1500)  # the 1 s level is due, 0.5 s late
    engine.step()
    clock.set(START + timedelta(seconds=2))  # and the 2 s level, on time
    engine.step()
    audit = Consumer(spark, cfg, "audit", ["orders"], clock=clock)
    audit.ack(*audit.poll(max_messages=2, timeout=0))
    audit.commit()

    server = MetricsServer(cfg, engine, spark.newSession()).start()
    try:
        server.refresh()
        got = scrape(server.url)
    finally:
        server.stop()

    delivered = delivered_rows(spark, cfg)
    assert sorted(r["msg_id"] for r in delivered) == sorted(ids[:5])
    for topic in ("orders", "billing"):
        rows = sum(1 for r in delivered if r["topic"] == topic)
        assert got[("delayq_delivered_total", (("topic", topic),))] == rows
    assert got[("delayq_rounds_total", ())] == len(rounds) == 3
    assert sum(r.delivered for r in rounds) == 5, "the listener saw every round"

    # The lateness histogram counts the topic rows by delivered_ts - deliver_ts.
    late_s = [
        (r["delivered_ts"] - r["deliver_ts"]).total_seconds()  # type: ignore[operator]
        for r in delivered
    ]
    assert sorted(late_s) == [0, 0, 0.5, 0.5, 0.5]
    for bound in LATENESS_BOUNDS:
        le = (("le", f"{bound:g}"),)
        expected = sum(1 for s in late_s if s <= bound)
        assert got[("delayq_delivery_lateness_seconds_bucket", le)] == expected, bound
    assert got[("delayq_delivery_lateness_seconds_count", ())] == 5
    assert got[("delayq_delivery_lateness_seconds_sum", ())] == pytest.approx(1.5)

    status = engine.status()
    pending_now = {
        dict(labels)["queue"]: v for (name, labels), v in got.items() if name == "delayq_pending"
    }
    assert {q: v for q, v in pending_now.items() if v} == {"timer": 1}
    assert sum(pending_now.values()) == sum(status.pending.values()) == 1
    assert got[("delayq_quarantined_total", ())] == 1
    quarantined = spark.read.format("delta").load(lay.quarantine)
    assert quarantined.where(F.col("msg_id") == "NO-TOPIC").count() == 1
    assert (
        got[("delayq_stamped_total", ())] == spark.read.format("delta").load(lay.schedule).count()
    )
    assert got[("delayq_commands_total", (("result", "cancelled"),))] == 1
    watermark = engine.delivery.progress.watermark
    assert watermark == START + timedelta(seconds=2)
    assert got[("delayq_watermark_timestamp_seconds", ())] == to_millis(watermark) / 1000

    # The queried figures: consumer lag per group and topic, and the next deliver time.
    lags = {(r["group_name"], r["topic"]): r["lag"] for r in lag(spark, cfg).collect()}
    assert lags == {("audit", "orders"): 1}
    assert got[("delayq_consumer_lag", (("group", "audit"), ("topic", "orders")))] == 1
    next_due = pending(spark, cfg).agg(F.unix_millis(F.min("deliver_ts"))).first()[0]  # type: ignore[index]
    assert next_due == to_millis(START + timedelta(hours=1))
    assert got[("delayq_next_due_timestamp_seconds", ())] == next_due / 1000


def test_a_listener_that_fails_does_not_stop_delivery(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    send_many(spark, cfg, [Message("orders", "x", delay_level=1)], clock)
    engine = quiet_engine(spark, cfg, clock)

    def broken(_result: RoundResult) -> None:
        raise RuntimeError("a bug in the listener")

    engine.add_listener(broken)
    engine.step()
    clock.advance(seconds=1)
    assert engine.step().delivered == 1


def test_a_taken_metrics_port_fails_at_start_naming_it(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    engine = quiet_engine(spark, cfg, clock)
    first = MetricsServer(cfg, engine).start()
    try:
        port = int(first.url.split(":")[2].split("/")[0])
        taken = cfg.with_overrides(metrics_port=port)
        with pytest.raises(Exception, match=rf"metrics\.port.*127\.0\.0\.1:{port}"):
            MetricsServer(taken, engine).start()
    finally:
        first.stop()
