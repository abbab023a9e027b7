"""Kafka out: deliver a topic's due messages to a Kafka topic of the same name.

A :class:`~engine.deliver.sinks.TopicSink`, chosen per topic with
``kafka.sinks.<topic> = "kafka"`` (Kafka only) or ``"both"`` (Kafka and the Delta topic
table). The delivery round sends from the driver's JVM (``delayq.kafka.ArrowRecordSender``,
built by ``make jars`` from ``build/jvm``): the round's rows go there as an Arrow stream and out
through one long-lived idempotent producer with ``acks=all``, so a write retried inside the
producer is not duplicated, and no Spark job runs per round (Spark's Kafka writer shipped the
rows inside its tasks: most of a round's CPU at tens of thousands of records). Across
a crash the guarantee is **at-least-once**: a round replayed after a crash skips the Kafka
topics it had finished (a marker file per round and topic, written after the broker
acknowledged), but a crash between the acknowledgement and the marker writes that round's
rows to Kafka again. Each record carries ``DELAYQ_MSG_ID`` so consumers can drop repeats;
the Delta topic table stays exactly-once.

Example:
    >>> KafkaTopicSink(spark, cfg, lay, "9f2c").write(7, "orders", rows, False)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession

from engine.core.arrow_lists import entry_rows, grouped, take_or_null
from engine.core.config import EngineConfig
from engine.core.kafka_headers import HEADER_DELIVER_TS, HEADER_MSG_ID, HEADER_TAGS
from engine.lakehouse.storage.fs import java_map, jvm
from engine.lakehouse.storage.layout import Layout
from engine.lakehouse.storage.location import store_for

log = logging.getLogger(__name__)

#: Bounds on how long one write may block on an unreachable broker (Kafka's defaults are
#: 60 s and 120 s); the round then fails and is retried with back-off.
PRODUCER_TIMEOUTS = {
    "max.block.ms": "20000",
    "request.timeout.ms": "20000",  # + linger.ms must stay within delivery.timeout.ms
    "delivery.timeout.ms": "30000",
}
#: A round sends its records at once: batches of 1 MiB (Kafka's default is 16 KiB) more than
#: halved the time a round of 100,000 records took to reach the broker. 256 KiB keeps most
#: of that while 256 partitions' batches fit the 64 MiB buffer (a full buffer blocks sends).
PRODUCER_BATCHING = {
    "batch.size": "262144",
    "linger.ms": "5",
    "buffer.memory": "67108864",
}

_HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def kafka_records(rows: pa.Table, kafka_topic: str) -> pa.Table:
    """Topic-table rows as Kafka records: ``topic, key, value, headers``.

    The key is the message's first key; the headers are ``DELAYQ_MSG_ID``,
    ``DELAYQ_DELIVER_TS`` (ms since the epoch), ``TAGS`` when the message has tags, then
    its properties (a property without a value is ``""``).

    Example:
        >>> from datetime import UTC, datetime
        >>> rows = pa.table({"msg_id": ["A1"], "keys": [["order-7"]], "tags": [None],
        ...     "properties": pa.array([[("p", "v")]], pa.map_(pa.string(), pa.string())),
        ...     "body": [b"hi"], "deliver_ts": [datetime(2026, 1, 1, tzinfo=UTC)]})
        >>> record = kafka_records(rows, "orders").to_pylist()[0]
        >>> record["key"], [h["key"] for h in record["headers"]]
        (b'order-7', ['DELAYQ_MSG_ID', 'DELAYQ_DELIVER_TS', 'p'])
        >>> record["headers"][1]["value"]
        b'1767225600000'
    """
    rows = rows.combine_chunks()
    n = rows.num_rows

    def column(name: str) -> pa.Array:
        found = rows[name]
        return found.chunk(0) if found.num_chunks else pa.array([], found.type)

    everyone = np.arange(n, dtype=np.int64)
    millis = pc.divide(pc.cast(column("deliver_ts"), pa.int64()), 1000)
    tagged = np.flatnonzero(np.asarray(pc.is_valid(column("tags")).to_numpy(zero_copy_only=False)))
    maps = column("properties")
    properties = pa.ListArray.from_arrays(maps.offsets, maps.values, mask=maps.is_null())
    entries = pc.list_flatten(properties)
    names, values = (entries.flatten() if len(entries) else
                     (pa.array([], pa.string()), pa.array([], pa.string())))  # fmt: skip
    fixed = [
        (everyone, pa.array([HEADER_MSG_ID] * n, pa.string()), column("msg_id")),
        (everyone, pa.array([HEADER_DELIVER_TS] * n, pa.string()), pc.cast(millis, pa.string())),
        (tagged, pa.array([HEADER_TAGS] * len(tagged), pa.string()),
         column("tags").take(pa.array(tagged, pa.int64()))),
        (entry_rows(properties), names, pc.fill_null(values, "")),
    ]  # fmt: skip
    offsets, order = grouped(n, np.concatenate([part[0] for part in fixed]))
    header_keys = pa.concat_arrays([part[1] for part in fixed]).take(order)
    header_values = pa.concat_arrays([pc.cast(part[2], pa.string()) for part in fixed]).take(order)
    headers = pa.ListArray.from_arrays(
        offsets,
        pa.StructArray.from_arrays(
            [header_keys, pc.cast(header_values, pa.binary())], names=["key", "value"]
        ),
        type=_HEADERS,
    )
    keys = column("keys")
    key_rows = entry_rows(keys)
    first_rows, first = np.unique(key_rows, return_index=True)
    key = np.full(n, -1, dtype=np.int64)
    key[first_rows] = first
    first_key = take_or_null(pc.list_flatten(keys), key)
    return pa.table(
        {
            "topic": pa.array([kafka_topic] * n, pa.string()),
            "key": pc.cast(first_key, pa.binary()),
            "value": column("body"),
            "headers": headers,
        }
    )


def producer_settings(cfg: EngineConfig, **more: str) -> dict[str, str]:
    """An idempotent producer's settings (``acks=all``), with the bounds and batching above.

    Example:
        >>> producer_settings(EngineConfig())["enable.idempotence"]
        'true'
    """
    return {
        "bootstrap.servers": cfg.kafka_bootstrap,
        "acks": "all",
        "enable.idempotence": "true",
        **PRODUCER_TIMEOUTS,
        **PRODUCER_BATCHING,
        **more,
    }


class _JvmSender:
    """The driver JVM's sender (``delayq.kafka.ArrowRecordSender``): records go there as an
    Arrow stream in a temporary file (no copy through the Python-JVM bridge)."""

    def __init__(self, spark: SparkSession, settings: dict[str, str]) -> None:
        self._sender = jvm(spark).delayq.kafka.ArrowRecordSender(java_map(spark, settings))

    def open(self) -> None:
        """Make the producer now (a transactional one aborts what an earlier one left)."""
        self._sender.open()

    def close(self) -> None:
        """Close the producer (its network thread stops; a later send makes a new one)."""
        self._sender.close()

    def send(self, topic: str, rows: pa.Table, marker: tuple[bytes, bytes] | None) -> None:
        """Send the records (and, in the same transaction, the marker) and wait for all."""
        records = kafka_records(rows, topic).select(["key", "value", "headers"])
        handle, path = tempfile.mkstemp(prefix="delayq-kafka-", suffix=".arrows")
        try:
            with os.fdopen(handle, "wb") as out, pa.ipc.new_stream(out, records.schema) as ipc:
                ipc.write_table(records)
            if marker is None:
                self._sender.send(topic, path)
            else:
                key, value = marker
                self._sender.sendTransaction(
                    topic, path, MARKERS_TOPIC, bytearray(key), bytearray(value)
                )
        finally:
            os.remove(path)


class _SentWhenShown:
    """A Kafka sink's :meth:`stage`: nothing can be prepared unseen (a record is read once
    sent), so the returned call does the whole write."""

    def write(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> None:
        raise NotImplementedError

    def stage(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> Callable[[], None]:
        """The write, deferred to the call the round makes at its watermark."""
        return functools.partial(self.write, round_, table, rows, replayed)


class KafkaTopicSink(_SentWhenShown):
    """A Kafka topic named like the topic table, at least once across crashes.

    A marker file per round and topic, written after the broker acknowledged the round's
    records, tells a replay that the write finished.
    """

    def __init__(
        self, spark: SparkSession, cfg: EngineConfig, layout: Layout, checkpoint_id: str
    ) -> None:
        self.spark = spark
        self.cfg = cfg
        # Per delivery checkpoint: a new checkpoint starts its rounds again from 0.
        self.markers = f"{layout.checkpoint('kafka_sink')}/{checkpoint_id}"
        self._sender: _JvmSender | None = None
        self._lock = threading.Lock()  # the topic writers share one producer

    def written(self, round_: int, table: str) -> bool:
        """Whether round ``round_`` finished its write to Kafka topic ``table``."""
        location = f"{self.markers}/{round_:020d}-{table}"
        return store_for(location).exists(location)

    def close(self) -> None:
        """Close the producer, if one was made."""
        with self._lock:
            sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def write(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> None:
        """Write a round's rows of one topic to Kafka, then mark the write done.

        Only the round in progress can be replayed, so the topic's older markers are removed.
        """
        with self._lock:
            if self._sender is None:
                self._sender = _JvmSender(self.spark, producer_settings(self.cfg))
            sender = self._sender
        sender.send(table, rows, marker=None)
        store = store_for(self.markers)
        name = f"{round_:020d}-{table}"
        store.write(f"{self.markers}/{name}", b"")
        for old in store.names(self.markers):
            if old.endswith(f"-{table}") and old < name:
                store.delete(f"{self.markers}/{old}")


#: The compacted Kafka topic where a transactional sink records, in each round's own
#: transaction, the last round written to each topic (key ``<checkpoint>/<topic>``).
MARKERS_TOPIC = "delayq_rounds"
#: Longest a replay waits to read the markers to their end (an open transaction of a
#: producer it could not fence holds read_committed readers back).
MARKERS_READ_S = 20.0


class TransactionalKafkaSink(_SentWhenShown):
    """A Kafka topic named like the topic table, exactly once for ``read_committed`` readers
    (``kafka.exactly_once = true``).

    Each round's records of a topic go out in one Kafka transaction (from the driver's JVM,
    ``transactional.id = delayq-<checkpoint>-<topic>``) together with a marker record in
    :data:`MARKERS_TOPIC` naming the round, so the records and the marker commit together or
    not at all. A replay reads the markers (``read_committed``) and skips a topic whose marker
    reached the round; starting the producers first aborts any transaction a crashed engine
    left open, and fences a paused one (its commit fails). Consumers that read with
    ``isolation.level=read_committed`` see each record once; ``read_uncommitted`` ones may also
    see an aborted attempt.
    """

    def __init__(
        self, spark: SparkSession, cfg: EngineConfig, layout: Layout, checkpoint_id: str
    ) -> None:
        self.spark = spark
        self.cfg = cfg
        self.checkpoint_id = checkpoint_id
        self._senders: dict[str, _JvmSender] = {}
        self._done: dict[str, int] | None = None
        self._lock = threading.Lock()  # the producers
        self._done_lock = threading.Lock()  # the markers read, and what was written since

    def _key(self, table: str) -> str:
        return f"{self.checkpoint_id}/{table}"

    def _sender(self, table: str) -> _JvmSender:
        with self._lock:
            if table not in self._senders:
                if not self._senders:
                    ensure_markers_topic(self.cfg.kafka_bootstrap)
                settings = producer_settings(
                    self.cfg, **{"transactional.id": f"delayq-{self.checkpoint_id}-{table}"}
                )
                sender = _JvmSender(self.spark, settings)
                sender.open()  # aborts what an earlier producer left open, fences it
                self._senders[table] = sender
            return self._senders[table]

    def close(self) -> None:
        """Close every producer made (a later write makes and opens new ones)."""
        with self._done_lock, self._lock:
            senders, self._senders, self._done = list(self._senders.values()), {}, None
        for sender in senders:
            try:
                sender.close()
            except Exception as err:  # closing the others matters more
                log.warning("closing a Kafka producer failed: %s", err)

    def _kafka_tables(self) -> list[str]:
        return sorted(t for t, sink in self.cfg.kafka_sinks.items() if sink in ("kafka", "both"))

    def written(self, round_: int, table: str) -> bool:
        """Whether round ``round_``'s transaction to ``table`` committed (its marker).

        The markers are read once (and again after a failed write): first every topic's
        producer is opened, which completes or aborts a transaction an earlier producer of
        its ``transactional.id`` left (a commit that timed out may still land), so the read
        sees every transaction that will ever commit.
        """
        with self._done_lock:
            if self._done is None:
                for name in self._kafka_tables():
                    self._sender(name).open()  # a producer dropped after a failure: anew
                self._done = read_markers(self.cfg.kafka_bootstrap, MARKERS_READ_S)
            return self._done.get(self._key(table), -1) >= round_

    def write(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> None:
        """Send the round's records of ``table`` and its marker in one transaction.

        After a failure the markers are read again before the next write is trusted: the
        transaction may have committed though its commit call failed (a timeout).
        """
        marker = (self._key(table).encode("utf-8"), str(round_).encode("ascii"))
        try:
            self._sender(table).send(table, rows, marker)
        except BaseException:
            with self._done_lock:
                self._done = None
            raise
        with self._done_lock:
            if self._done is not None:
                self._done[self._key(table)] = round_


def ensure_markers_topic(bootstrap: str) -> None:
    """Create :data:`MARKERS_TOPIC` (compacted: the last marker per key is kept) unless it
    exists."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        if MARKERS_TOPIC in admin.list_topics():
            return
        topic = NewTopic(MARKERS_TOPIC, 1, 1, topic_configs={"cleanup.policy": "compact"})
        with contextlib.suppress(TopicAlreadyExistsError):
            admin.create_topics([topic])
    finally:
        admin.close()


def read_markers(bootstrap: str, timeout_s: float) -> dict[str, int]:
    """The last round recorded per ``<checkpoint>/<topic>`` in :data:`MARKERS_TOPIC`, read
    with ``read_committed`` to its end; empty when the topic does not exist yet.

    Raises:
        TimeoutError: the end was not reached in ``timeout_s`` (an open transaction).
    """
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
        group_id=None,
    )
    try:
        partitions = consumer.partitions_for_topic(MARKERS_TOPIC)
        if not partitions:
            return {}
        assigned = [TopicPartition(MARKERS_TOPIC, p) for p in sorted(partitions)]
        consumer.assign(assigned)
        consumer.seek_to_beginning(*assigned)
        ends = consumer.end_offsets(assigned)
        found: dict[str, int] = {}
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in assigned):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{MARKERS_TOPIC}: not read to its end in {timeout_s:g} s")
            for batch in consumer.poll(timeout_ms=500).values():
                for record in batch:
                    key = record.key.decode("utf-8")
                    found[key] = max(found.get(key, -1), int(record.value))
        return found
    finally:
        consumer.close()
