"""The lakehouse in an S3 bucket of a real S3 server (S3Proxy): the engine, producers and a
consumer, with Spark's and the engine's own commits racing, and a crash mid-round."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.cli import main
from engine.consume.consumer import Consumer
from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.core.errors import SetupError
from engine.lakehouse.delta.tables import ensure_tables
from engine.lakehouse.storage.layout import layout
from engine.lakehouse.storage.location import store_for
from engine.lakehouse.storage.s3 import S3Store
from engine.produce.send import Message, send_df, send_many
from engine.run.engine import Engine
from jobs.tools.objectstore import Server
from tests.support.crash import Crash, crash_after_writes
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows
from tests.support.objectstore import s3_cfg

pytestmark = pytest.mark.integration


@pytest.fixture
def cfg(make_cfg: Any, s3: Server) -> EngineConfig:
    return s3_cfg(make_cfg, s3)


def test_a_crash_between_the_topic_writes_and_the_round_commit_replays_once(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    messages = [Message(("orders", "audit")[i % 2], f"b{i}", delay_level=i % 4) for i in range(16)]
    ids = send_many(spark, cfg, messages, clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None, sinks=crash_after_writes()).open()
    clock.advance(seconds=1)
    with pytest.raises(Crash):
        engine.step()
    written = delivered_rows(spark, cfg)
    assert written, "the topic writes happened before the crash"
    clock.advance(seconds=5)
    restarted = Engine(spark, cfg, clock, out=lambda _: None).open()  # replays the round
    assert sorted(r["msg_id"] for r in delivered_rows(spark, cfg)) == sorted(
        r["msg_id"] for r in written
    )
    restarted.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)
    assert all(r["topic"] in ("orders", "audit") for r in delivered_rows(spark, cfg))


def test_spark_and_driver_side_producers_commit_together_and_lose_nothing(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spark's commits (``send_df``, through the conditional-PUT LogStore) race the
    producers' own commits to ``commitlog``: versions taken by the other are retried, none
    is overwritten, and every message is delivered once. The first driver-side commit is
    held once it has chosen its version, until a Spark commit has taken that version."""
    ensure_tables(spark, cfg)
    chosen = threading.Event()  # a driver-side commit chose its version, and waits
    taken = threading.Event()  # a Spark commit has been made since
    tries: list[tuple[str, bool]] = []  # the driver side's commits: version file, made
    create = S3Store.create

    def held_create(store: S3Store, path: str, data: bytes, *, durable: bool = True) -> bool:
        if "/commitlog/_delta_log/" not in path or not path.endswith(".json"):
            return create(store, path, data, durable=durable)
        if not chosen.is_set():
            chosen.set()
            taken.wait(120)
        made = create(store, path, data, durable=durable)
        tries.append((path, made))
        return made

    monkeypatch.setattr(S3Store, "create", held_create)
    ids: list[str] = []
    lock = threading.Lock()

    def driver_side(worker: int) -> None:
        for batch in range(4):
            sent = send_many(
                spark, cfg, [Message("orders", f"d{worker}-{batch}-{i}") for i in range(5)], clock
            )
            with lock:
                ids.extend(sent)

    threads = [threading.Thread(target=driver_side, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    frames = spark.range(30).select(
        F.lit("orders").alias("topic"),
        F.concat(F.lit("s"), F.col("id").cast("string")).alias("body"),
        F.concat(F.lit("S"), F.col("id").cast("string")).alias("msg_id"),
    )
    try:
        assert chosen.wait(120), "no driver-side commit"
        for part in range(3):  # three Spark commits while the threads commit
            send_df(spark, cfg, frames.where(F.col("id") % 3 == part), clock)
            taken.set()
    finally:
        taken.set()
        for t in threads:
            t.join()
    # the held commit lost its version to Spark's commit, and took a later one
    (lost, made), *_ = tries
    assert not made, tries[:3]
    (theirs, *_) = (store_for(lost).read(lost) or b"").decode().splitlines()
    assert json.loads(theirs)["commitInfo"]["engineInfo"].startswith("Apache-Spark"), theirs
    assert sum(made for _, made in tries) == 8, "each driver-side commit made once, after its races"
    ids += [f"S{i}" for i in range(30)]
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    for _ in range(3):
        clock.advance(seconds=1)
        engine.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)
    history = spark.sql(f"DESCRIBE HISTORY delta.`{layout(cfg).commitlog}`").collect()
    assert len({h["version"] for h in history}) == 1 + 8 + 3, "every commit kept its version"


def test_a_consumer_reads_and_commits_on_the_bucket_and_status_counts_it(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = send_many(spark, cfg, [Message("orders", f"c{i}") for i in range(6)], clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    clock.advance(seconds=1)
    engine.step()
    got: list[str] = []
    with Consumer(spark, cfg, "billing", ["orders"], clock=clock) as consumer:
        batch = consumer.poll(max_messages=4, timeout=0)
        got += [m.msg_id for m in batch]
        consumer.ack()
        consumer.commit()
    with Consumer(spark, cfg, "billing", ["orders"], clock=clock) as consumer:  # a restart
        batch = consumer.poll(timeout=0)
        got += [m.msg_id for m in batch]
        consumer.ack()
        consumer.commit()
    assert sorted(got) == sorted(ids), "each message handed out once across the restart"
    engine.stop()
    capsys.readouterr()
    # `delayq status` with configuration only: the path, the catalog, the levels
    status = main(["status", "--set", f"lakehouse.path={cfg.lakehouse}", "--set",
                   "sql.catalog=memory", "--set", "levels.delays=1s 2s 3s", "--set",
                   f"lakehouse.database={cfg.database}"])  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "sent        6" in printed and "to stamp    0" in printed, printed
    assert "engine      none running (the last: host" in printed and "stopped)" in printed


def test_a_missing_bucket_or_refused_credentials_fail_at_start_naming_them(
    spark: SparkSession, make_cfg: Any, s3: Server
) -> None:
    missing = s3_cfg(make_cfg, s3, lakehouse="s3a://no-such-bucket-here/lh")
    with pytest.raises(SetupError, match="no bucket no-such-bucket-here"):
        ensure_tables(spark, missing)
    refused = s3_cfg(make_cfg, s3, s3_secret_key="not-the-secret")
    with pytest.raises(SetupError, match="credentials were refused"):
        ensure_tables(spark, refused)


def test_a_server_that_ignores_conditional_writes_is_refused_at_start(
    spark: SparkSession, make_cfg: Any, s3: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server (or a gateway before it) that drops ``If-None-Match`` would let two writers
    both commit one version: the start-up probe finds out."""
    import obstore

    from engine.lakehouse.storage import s3 as s3_store

    real_put = obstore.put

    def unconditional(store: Any, path: str, data: Any, **options: Any) -> Any:
        options.pop("mode", None)  # what such a server does with the precondition
        return real_put(store, path, data, **options)

    monkeypatch.setattr(s3_store.obstore, "put", unconditional)
    with pytest.raises(SetupError, match="does not honour conditional writes"):
        ensure_tables(spark, s3_cfg(make_cfg, s3))
