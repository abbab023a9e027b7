"""Kafka in and out against a real broker (started here from .kafka/lib, `make kafka-jars`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from pyspark.sql import SparkSession

from engine.core.clock import FakeClock, to_millis
from engine.core.config import EngineConfig
from engine.core.errors import IngestError
from engine.lakehouse.catalog.session import REPO_ROOT
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.delta_log import Txn, list_topics
from engine.lakehouse.delta.tables import ensure_tables
from engine.lakehouse.storage.layout import layout
from engine.lakehouse.storage.location import store_for
from engine.produce.ingest_lag import ingest_lag, offset_app_id
from engine.produce.kafka_client import DelayedProducer
from engine.produce.kafka_ingest import KafkaIngest, start_ingest
from engine.produce.kafka_records import KAFKA_RECORD, parse_records
from engine.produce.send import Message, send_many
from engine.run.engine import Engine
from engine.run.metrics import query_figures
from jobs.tools.broker import Broker, BrokerError, start
from jobs.tools.objectstore import Server
from tests.support.crash import Crash, crash_after_writes
from tests.support.crash_points import on_disk, said
from tests.support.kafka import consume, free_port, ingest, kafka_broker, kafka_cfg, produce, rows
from tests.support.lakehouse import START
from tests.support.objectstore import s3_cfg
from tests.support.process import PROPS, VENV_BIN, engine_args
from tests.support.process import start as start_process
from tests.support.readme import docstring_block, plain_env, run_shell

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A real single-node broker for this module, on free ports."""
    yield from kafka_broker(tmp_path_factory)


def h(**headers: str) -> list[tuple[str, bytes]]:
    return [(k, v.encode()) for k, v in headers.items()]


def test_ingest_reads_every_header_form_and_quarantines_bad_headers(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock
) -> None:
    mapped, unmapped = f"in_{uuid.uuid4().hex[:6]}", f"raw_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(
        make_cfg, kafka, kafka_ingest_topics=(mapped, unmapped), kafka_topic_map={mapped: "audit"}
    )
    at = to_millis(START) + 5000
    produce(kafka, mapped, [
        (b"k1", b"level", h(DELAY="2", REAL_TOPIC="orders", KEYS="a b", TAGS="t", color="red")),
        (None, b"at", h(TIMER_DELIVER_MS=str(at))),
        (None, b"sec", h(TIMER_DELAY_SEC="3")),
        (None, b"ms", h(TIMER_DELAY_MS="1500", REAL_TOPIC="orders")),
        (None, b"now", []),
        (None, b"bad level", h(DELAY="soon")),
        (None, b"two", h(DELAY="1", TIMER_DELAY_SEC="3")),
        (None, b"negative", h(TIMER_DELAY_SEC="-1")),
        # A producer's retry: the same UNIQ_KEY twice is delivered once.
        (None, b"dup1", h(UNIQ_KEY="order-7", REAL_TOPIC="orders")),
        (None, b"dup2", h(UNIQ_KEY="order-7", REAL_TOPIC="orders")),
    ])  # fmt: skip
    produce(kafka, unmapped, [(None, b"nowhere", h(DELAY="1"))])
    ingest(spark, cfg, clock)

    stored = {r["body"].decode(): r for r in rows(spark, layout(cfg).commitlog)}
    assert sorted(stored) == ["at", "dup1", "dup2", "level", "ms", "now", "sec"]
    assert stored["dup1"]["msg_id"] == stored["dup2"]["msg_id"] == "order-7"
    assert "UNIQ_KEY" not in stored["dup1"]["properties"]
    level = stored["level"]
    assert (level["topic"], level["delay_level"], level["at_ms"]) == ("orders", 2, None)
    assert level["keys"] == ["k1", "a", "b"] and level["tags"] == "t"
    assert level["properties"]["color"] == "red" and level["properties"]["KAFKA_TOPIC"] == mapped
    now = to_millis(START)
    assert (stored["at"]["topic"], stored["at"]["at_ms"]) == ("audit", at)
    assert stored["sec"]["at_ms"] == now + 3000 and stored["ms"]["at_ms"] == now + 1500
    assert stored["ms"]["topic"] == "orders"
    assert stored["now"]["delay_level"] is None and stored["now"]["at_ms"] is None

    reasons = {r["body"].decode(): r["reason"] for r in rows(spark, layout(cfg).quarantine)}
    assert reasons == {
        "bad level": "header DELAY='soon' is not a level",
        "two": "give only one of the headers DELAY, TIMER_DELIVER_MS, TIMER_DELAY_SEC, "
        "TIMER_DELAY_MS",
        "negative": "header TIMER_DELAY_SEC='-1' is not whole seconds >= 0 within "
        "messages.max_delay=2592000s",
        "nowhere": f"no REAL_TOPIC header and no kafka.topic_map entry for topic '{unmapped}'",
    }

    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    engine.step()
    clock.advance(seconds=2)
    engine.step()  # level 2 (2 s) and the 1.5 s timer are due, the 3 s and 5 s ones not
    delivered = {r["body"].decode() for t in list_topics(cfg)
                 for r in rows(spark, layout(cfg).topic(t))}  # fmt: skip
    assert delivered == {"now", "level", "ms", "dup1"}
    refused = {r["body"].decode(): r["reason"] for r in rows(spark, layout(cfg).quarantine)}
    assert refused["dup2"].startswith("duplicate: msg_id order-7 was already stored at")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_ingest_restarts_where_the_stored_records_end(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock, s3: Server, where: str
) -> None:
    topic = f"in_{uuid.uuid4().hex[:6]}"
    settings: dict[str, Any] = {
        "kafka_ingest_topics": (topic,),
        "kafka_topic_map": {topic: "orders"},
    }
    cfg = (
        kafka_cfg(make_cfg, kafka, **settings)
        if where == "local"
        else s3_cfg(lambda **more: kafka_cfg(make_cfg, kafka, **settings, **more), s3)
    )
    produce(kafka, topic, [(None, f"m{i}".encode(), []) for i in range(5)])
    ingest(spark, cfg, clock)
    produce(kafka, topic, [(None, f"n{i}".encode(), []) for i in range(3)])
    ingest(spark, cfg, clock)
    ingest(spark, cfg, clock)  # nothing new
    stored = rows(spark, layout(cfg).commitlog)
    bodies = sorted(r["body"].decode() for r in stored)
    assert bodies == sorted([f"m{i}" for i in range(5)] + [f"n{i}" for i in range(3)])
    assert len({r["msg_id"] for r in stored}) == 8
    # where it is in Kafka is in commitlog's log, beside the records it stored
    assert ArrowDelta(layout(cfg).commitlog).txn_version(offset_app_id(topic, 0)) == 8


@pytest.mark.parametrize("dies", ["before commitlog", "after both"])
def test_a_batch_read_again_after_a_crash_is_stored_once(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock, dies: str
) -> None:
    topic = f"in_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(make_cfg, kafka, kafka_ingest_topics=(topic,))
    produce(kafka, topic, [(None, b"good1", h(REAL_TOPIC="orders")),
                           (None, b"bad1", h(REAL_TOPIC="orders", DELAY="x"))])  # fmt: skip
    running = KafkaIngest(spark, cfg, clock)
    running.open()
    commitlog_append = running.commitlog.append

    def crash(rows: Any, **kwargs: Any) -> None:
        if dies == "after both":
            commitlog_append(rows, **kwargs)
        raise Crash("killed")

    running.commitlog.append = crash  # type: ignore[method-assign]
    with pytest.raises(Crash):
        while not running.batches:
            running.step()
    running.close()
    # the quarantine commit landed; the restart reads the batch again, with a record more
    produce(kafka, topic, [(None, b"good2", h(REAL_TOPIC="orders")),
                           (None, b"bad2", h(REAL_TOPIC="orders", DELAY="y"))])  # fmt: skip
    ingest(spark, cfg, clock)
    ingest(spark, cfg, clock)
    good = sorted(r["body"] for r in rows(spark, layout(cfg).commitlog))
    bad = sorted(r["body"] for r in rows(spark, layout(cfg).quarantine))
    assert (good, bad) == ([b"good1", b"good2"], [b"bad1", b"bad2"])


def test_records_gone_from_kafka_before_they_were_stored_stop_the_ingest_with_a_clear_error(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock
) -> None:
    topic = f"in_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(make_cfg, kafka, kafka_ingest_topics=(topic,))
    produce(kafka, topic, [(None, f"m{i}".encode(), h(REAL_TOPIC="orders")) for i in range(3)])
    ingest(spark, cfg, clock)
    produce(kafka, topic, [(None, f"n{i}".encode(), h(REAL_TOPIC="orders")) for i in range(3)])
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    admin.delete_records({TopicPartition(topic, 0): 5})  # retention took offsets 3 and 4
    admin.close()
    query = start_ingest(spark, cfg, clock, available_now=True)
    with pytest.raises(IngestError) as failed:
        query.awaitTermination(120)
    assert query.exception() is failed.value
    assert f"no longer holds the records of {topic}-0 at offset 3" in str(failed.value)
    assert "--skip-lost-records" in str(failed.value)
    # told to, it goes on from the first record Kafka has
    start_ingest(spark, cfg, clock, available_now=True, skip_lost=True).awaitTermination(120)
    stored = sorted(r["body"] for r in rows(spark, layout(cfg).commitlog))
    assert stored == [b"m0", b"m1", b"m2", b"n2"]


def test_starting_at_latest_then_restarting_reads_what_came_while_stopped(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock
) -> None:
    topic = f"in_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(make_cfg, kafka, kafka_ingest_topics=(topic,), kafka_starting_offsets="latest")
    produce(kafka, topic, [(None, b"before", h(REAL_TOPIC="orders"))])
    ingest(spark, cfg, clock)  # starts at the end: nothing stored
    produce(kafka, topic, [(None, b"while stopped", h(REAL_TOPIC="orders"))])
    ingest(spark, cfg, clock)
    assert [r["body"] for r in rows(spark, layout(cfg).commitlog)] == [b"while stopped"]


def test_ingest_starts_where_the_spark_stream_of_earlier_versions_stopped(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock
) -> None:
    topic = f"in_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(make_cfg, kafka, kafka_ingest_topics=(topic,))
    sent = [(None, f"m{i}".encode(), h(REAL_TOPIC="orders")) for i in range(7)]
    sent[3] = (None, b"bad", h(REAL_TOPIC="orders", DELAY="x"))
    produce(kafka, topic, sent)
    # the checkpoint a Spark stream left: batch 0 (offsets 0-2) recorded, then batch 1
    # (3-4) appended to commitlog under its txn (m4; the test leaves the row out), and the
    # stream killed before its quarantine append (bad) and commits/1
    folder = layout(cfg).checkpoint("kafka_ingest")
    store = store_for(folder)
    store.create(f"{folder}/metadata", b'{"id":"9f2c"}\n')
    store.create(f"{folder}/offsets/0", f'v1\n{{}}\n{{"{topic}":{{"0":3}}}}\n'.encode())
    store.create(f"{folder}/commits/0", b'v1\n{"nextBatchWatermarkMs":0}\n')
    store.create(f"{folder}/offsets/1", f'v1\n{{}}\n{{"{topic}":{{"0":5}}}}\n'.encode())
    ensure_tables(spark, cfg, migrate=False)
    empty = parse_records(KAFKA_RECORD.empty_table(), cfg, clock.now()).drop_columns(["reason"])
    ArrowDelta(layout(cfg).commitlog).append(empty, txn=Txn("delayq-kafka-ingest-9f2c", 1))
    ingest(spark, cfg, clock)
    assert sorted(r["body"] for r in rows(spark, layout(cfg).commitlog)) == [b"m5", b"m6"]
    assert [r["body"] for r in rows(spark, layout(cfg).quarantine)] == [b"bad"]


def test_batches_across_partitions_crash_and_restart_store_every_record_once(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock
) -> None:
    topic = f"in_{uuid.uuid4().hex[:6]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    admin.close()
    cfg = kafka_cfg(make_cfg, kafka, kafka_ingest_topics=(topic,), kafka_max_offsets=7)
    sent = [(f"k{i % 5}".encode(), f"m{i}".encode(), h(REAL_TOPIC="orders")) for i in range(40)]
    sent += [(b"k1", b"bad", h(REAL_TOPIC="orders", DELAY="x"))]
    produce(kafka, topic, sent)  # type: ignore[arg-type]
    running = KafkaIngest(spark, cfg, clock)
    running.open()
    append, calls = running.commitlog.append, []

    def dies_on_the_third(rows: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise Crash("killed")
        append(rows, **kwargs)

    running.commitlog.append = dies_on_the_third  # type: ignore[method-assign]
    with pytest.raises(Crash):
        while True:
            running.step()
    running.close()
    ingest(spark, cfg, clock)
    good = sorted(r["body"] for r in rows(spark, layout(cfg).commitlog))
    assert good == sorted(f"m{i}".encode() for i in range(40))
    assert [r["body"] for r in rows(spark, layout(cfg).quarantine)] == [b"bad"]
    consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers)
    ends = consumer.end_offsets([TopicPartition(topic, p) for p in range(3)])
    consumer.close()
    commitlog = ArrowDelta(layout(cfg).commitlog)
    assert {
        p.partition: commitlog.txn_version(offset_app_id(topic, p.partition)) for p in ends
    } == {p.partition: end for p, end in ends.items()}


def test_delivery_to_kafka_and_delta_for_the_same_topic(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock
) -> None:
    both, only = f"both_{uuid.uuid4().hex[:6]}", f"only_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(make_cfg, kafka, kafka_sinks={both: "both", only: "kafka"})
    ids = send_many(spark, cfg, [
        Message(both, "b1", keys=["order-1"], tags="paid", properties={"p": "v"}, delay_level=1),
        Message(both, "b2", delay_level=1),
        Message(only, "o1", delay_level=1),
    ], clock)  # fmt: skip

    crashing = Engine(spark, cfg, clock, out=lambda _: None, sinks=crash_after_writes()).open()
    clock.advance(seconds=1)
    with pytest.raises(Crash):
        crashing.step()
    Engine(spark, cfg, clock, out=lambda _: None).step()  # replays the round

    records = consume(kafka, both, 2)
    assert sorted(r.value for r in records) == [b"b1", b"b2"], "no copy from the replay"
    first = next(r for r in records if r.value == b"b1")
    headers = {k: v.decode() for k, v in first.headers}
    assert first.key == b"order-1" and headers["TAGS"] == "paid" and headers["p"] == "v"
    assert headers["DELAYQ_MSG_ID"] == ids[0]
    assert int(headers["DELAYQ_DELIVER_TS"]) == to_millis(START) + 1000
    assert [r.value for r in consume(kafka, only, 1)] == [b"o1"]
    delta = sorted(r["body"] for r in rows(spark, layout(cfg).topic(both)))
    assert delta == [b"b1", b"b2"]
    assert only not in list_topics(cfg), "a kafka-only topic has no Delta table"


def test_exactly_once_to_kafka_for_read_committed_readers(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock
) -> None:
    from kafka import KafkaProducer

    topic = f"eos_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(make_cfg, kafka, kafka_sinks={topic: "kafka"}, kafka_exactly_once=True)
    sent = send_many(spark, cfg, [Message(topic, f"m{i}", delay_level=1) for i in range(5)], clock)
    # The round's transaction commits, then the engine dies before committing the round.
    crashing = Engine(spark, cfg, clock, out=lambda _: None, sinks=crash_after_writes()).open()
    clock.advance(seconds=1)
    with pytest.raises(Crash):
        crashing.step()
    Engine(spark, cfg, clock, out=lambda _: None).step()  # the replay finds the round's marker
    # A round dies inside its transaction (its records sent, no commit): what the engine's
    # producer leaves is made here by a producer with its transactional.id. The next engine
    # aborts it and writes the round again.
    sent += send_many(spark, cfg, [Message(topic, f"n{i}", delay_level=1) for i in range(5)], clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    dying = KafkaProducer(
        bootstrap_servers=kafka.bootstrap_servers,
        transactional_id=f"delayq-{engine.delivery.progress.checkpoint_id}-{topic}",
    )
    dying.init_transactions()
    dying.begin_transaction()
    for i in range(5):
        dying.send(topic, value=f"n{i}".encode())
    dying.flush()  # sent, never committed: the process died here
    clock.advance(seconds=1)
    engine.step()

    committed = consume(kafka, topic, 10, isolation_level="read_committed")
    assert sorted(r.value for r in committed) == sorted(
        [f"m{i}".encode() for i in range(5)] + [f"n{i}".encode() for i in range(5)]
    ), "each record once for a read_committed reader"
    ids = [dict(r.headers)["DELAYQ_MSG_ID"].decode() for r in committed]
    assert sorted(ids) == sorted(sent)
    everything = consume(kafka, topic, 15)
    assert len(everything) == 15, "a read_uncommitted reader also sees the aborted attempt"


def test_an_engine_killed_after_a_rounds_kafka_transaction_sends_nothing_again(
    spark: SparkSession, make_cfg: Any, kafka: Broker, tmp_path: Path
) -> None:
    """``delayq run`` with ``kafka.exactly_once`` killed with SIGKILL (its JVM and producers
    too) once a round's Kafka transaction committed and before the round's progress; the
    engine run again replays the round, finds its marker and sends nothing again: each
    record once for a ``read_committed`` reader."""
    topic = f"eos_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(make_cfg, kafka, kafka_sinks={topic: "kafka"}, kafka_exactly_once=True)
    sent = send_many(spark, cfg, [Message(topic, f"m{i}", delay_level=1) for i in range(10)])
    kafka_args = {
        "kafka.bootstrap_servers": kafka.bootstrap_servers,
        f"kafka.sinks.{topic}": "kafka",
        "kafka.exactly_once": "true",
    }
    settings = engine_args(cfg, *(a for k, v in kafka_args.items() for a in ("--set", f"{k}={v}")))
    until = ["--show", "0", "--until-idle", "--max-seconds", "90"]
    log = tmp_path / "killed.log"
    killing = [sys.executable, "-m", "tests.support.killing_engine", "kafka-committed", "1"]
    proc = start_process([*killing, *settings, *until], log)
    try:
        code = proc.wait(240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == -signal.SIGKILL, log.read_text()[-3000:]
    point, where = said(log.read_text())
    assert (point, where["table"]) == ("kafka-committed", topic)
    lay = layout(cfg)
    assert on_disk(lay).pending == int(where["round"])  # planned, its progress not written
    shown = consume(kafka, topic, 1, isolation_level="read_committed")
    assert shown, "the round's transaction committed before the kill"
    sent += send_many(spark, cfg, [Message(topic, f"n{i}", delay_level=1) for i in range(5)])
    # the restart, here: it replays the killed round first, then delivers the rest
    status = Engine(spark, cfg, out=lambda _: None).run(until_idle=True, max_seconds=90)
    assert status.idle, status
    committed = consume(kafka, topic, len(sent), isolation_level="read_committed")
    ids = [dict(r.headers)["DELAYQ_MSG_ID"].decode() for r in committed]
    assert sorted(ids) == sorted(sent), "each record once for a read_committed reader"


def test_kafka_python_helper_round_trip(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock
) -> None:
    source, target = f"in_{uuid.uuid4().hex[:6]}", f"out_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(make_cfg, kafka, kafka_ingest_topics=(source,), kafka_sinks={target: "kafka"})
    with DelayedProducer(kafka.bootstrap_servers) as producer:
        producer.send(source, "hello", key="k", topic=target, delay="2s", tags="greeting")
        producer.send(source, "at once", topic=target)
    ingest(spark, cfg, clock)
    engine = Engine(spark, cfg, clock, out=lambda _: None).open()
    engine.step()
    assert [r.value for r in consume(kafka, target, 1)] == [b"at once"]
    clock.advance(seconds=1)
    engine.step()
    assert len(consume(kafka, target, 1)) == 1, "not early"
    clock.advance(seconds=1)
    engine.step()
    records = consume(kafka, target, 2)
    assert [r.value for r in records] == [b"at once", b"hello"]
    assert records[1].key == b"k"
    assert dict(records[1].headers)["TAGS"] == b"greeting"


def test_a_broker_that_cannot_start_shows_its_log(kafka: Broker, tmp_path: Path) -> None:
    with pytest.raises(BrokerError) as err:
        start(tmp_path / "second", kafka.port, free_port(), timeout=60,
              lib=REPO_ROOT / ".kafka" / "lib")  # fmt: skip
    message = str(err.value)
    assert "Address already in use" in message and "broker.log" in message


def test_ingest_job_killed_with_sigkill_then_restarted_stores_every_record_once(
    spark: SparkSession, make_cfg: Any, kafka: Broker, tmp_path: Path
) -> None:
    topic = f"in_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(make_cfg, kafka)
    size = 5_000
    records: list[tuple[bytes | None, bytes, list[Any]]] = [
        (None, b"bad", h(DELAY="x", REAL_TOPIC="orders"))
    ]
    records += [(None, f"m{i}".encode(), h(REAL_TOPIC="orders", DELAY="1")) for i in range(size)]
    produce(kafka, topic, records)
    settings = {
        "lakehouse.path": cfg.lakehouse,
        "kafka.bootstrap_servers": kafka.bootstrap_servers,
        "kafka.ingest_topics": topic,
        "kafka.max_offsets_per_trigger": "250",
        "spark.log_level": "ERROR",
        "spark.conf.spark.ui.enabled": "false",
    }
    args = [arg for k, v in settings.items() for arg in ("--set", f"{k}={v}")]
    job = [str(VENV_BIN / "spark-submit"), "--properties-file", str(PROPS),
           "jobs/kafka_ingest.py", *args]  # fmt: skip
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    # kill -9 once some batches are stored, with most of them still to read
    commitlog = ArrowDelta(layout(cfg).commitlog)
    with subprocess.Popen(
        job, cwd=REPO_ROOT, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ) as running:  # fmt: skip
        deadline = time.monotonic() + 240
        while (commitlog.txn_version(offset_app_id(topic, 0)) or 0) < 500:
            assert running.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(running.pid, signal.SIGKILL)
    assert (commitlog.txn_version(offset_app_id(topic, 0)) or 0) < size
    # the restart: jobs/kafka_ingest.py's docstring line, as written in a plain shell, with the
    # same settings in the configuration file it reads ($DELAYQ_CONF)
    conf = tmp_path / "engine.toml"
    conf.write_text("".join(f'{k} = "{v}"\n' for k, v in settings.items() if "conf" not in k))
    block = docstring_block(REPO_ROOT / "jobs" / "kafka_ingest.py")
    assert block is not None and block.code.rstrip().endswith("--available-now"), block
    printed = run_shell(block, plain_env(tmp_path, conf), REPO_ROOT, "jobs/kafka_ingest.py")
    assert "records stored" in printed
    stored = [r["body"] for r in rows(spark, layout(cfg).commitlog)]
    assert len(stored) == size and set(stored) == {f"m{i}".encode() for i in range(size)}
    assert [r["reason"] for r in rows(spark, layout(cfg).quarantine)] == [
        "header DELAY='x' is not a level"
    ]


def test_kafka_config_errors_name_the_key(make_cfg: Any) -> None:
    from engine.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kafka\.ingest_topics"):
        EngineConfig.from_mapping({"kafka.ingest_topics": " "})
    with pytest.raises(ConfigError, match=r"kafka\.topic_map"):
        make_cfg(kafka_ingest_topics=("in",), kafka_topic_map={"in": "dlq_x"})
    with pytest.raises(ConfigError, match=r"kafka\.topic_map"):
        make_cfg(kafka_topic_map={"typo": "orders"})
    with pytest.raises(ConfigError, match=r"kafka\.sinks\.retry_g"):
        make_cfg(kafka_sinks={"retry_g": "kafka"})
    with pytest.raises(ConfigError, match="loop back"):
        make_cfg(kafka_ingest_topics=("orders",), kafka_sinks={"orders": "both"})


def test_ingest_lag_counts_records_in_kafka_not_yet_stored(
    spark: SparkSession, make_cfg: Any, kafka: Broker, clock: FakeClock
) -> None:
    topic = f"in_{uuid.uuid4().hex[:6]}"
    cfg = kafka_cfg(
        make_cfg, kafka, kafka_ingest_topics=(topic,), kafka_topic_map={topic: "orders"}
    )
    assert ingest_lag(cfg) is None  # the ingest never ran on this lakehouse
    produce(kafka, topic, [(None, f"m{i}".encode(), []) for i in range(5)])
    ingest(spark, cfg, clock)
    assert ingest_lag(cfg) == {topic: 0}
    produce(kafka, topic, [(None, f"n{i}".encode(), []) for i in range(3)])
    assert ingest_lag(cfg) == {topic: 3}
    # the engine's metrics show it (refreshed with the other queried figures)
    assert query_figures(spark, cfg).ingest_lag == {topic: 3}
    ingest(spark, cfg, clock)
    assert ingest_lag(cfg) == {topic: 0}
