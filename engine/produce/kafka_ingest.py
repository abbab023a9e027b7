"""Kafka in: read Kafka topics into ``commitlog``, exactly once, bad records quarantined.

A Kafka consumer in the driver's JVM (``delayq.kafka.ArrowRecordReader``, built by ``make
jars`` from ``build/jvm``) reads ``kafka.ingest_topics`` and hands each batch of records to
Python as an Arrow stream (key, value, topic, partition, offset, timestamp, headers), with no
Spark job. :func:`engine.produce.kafka_records.parse_records` shapes them and they are
appended to ``commitlog`` (the records with bad headers to ``quarantine``, with the reason)
as the producers' sends are: Parquet plus one Delta log entry.

Where the ingest is in Kafka is kept in the same commits, not in Kafka or a checkpoint: each
append records, for every partition of its batch, Delta's ``txnAppId``/``txnVersion`` =
(:func:`offset_app_id`, the next offset to read). A commit stores its records and moves the
offsets at once, so the ingest starts again, after a stop or a crash, exactly where the
stored records end. ``quarantine`` is written first and records its own offsets;
``commitlog`` is committed for every batch (with no rows when all were bad), so its offsets
are where to start, and a batch read again after a crash between the two commits skips the
records already quarantined. A record's ``msg_id`` is its ``UNIQ_KEY`` header or else
derived from its Kafka topic, partition, offset and timestamp, and a record sent twice with
the same ``UNIQ_KEY`` is delivered once (stamping drops the second copy, see
:mod:`engine.stamp.dedup`). Header names are in :mod:`engine.core.kafka_headers`.

Partitions without recorded offsets start at ``kafka.starting_offsets``, or where the Spark
stream of earlier versions (``_checkpoints/kafka_ingest``) had stored up to; partitions added
to a topic later start at their earliest offset.

Example:
    >>> query = start_ingest(spark, cfg)  # doctest: +SKIP
    >>> query.awaitTermination()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession

from engine.core.clock import Clock, SystemClock
from engine.core.config import EngineConfig
from engine.core.errors import DelayQError, IngestError
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.delta.tables import ensure_tables
from engine.lakehouse.storage.fs import java_map, jvm
from engine.lakehouse.storage.layout import layout
from engine.produce.ingest_lag import INGEST_CHECKPOINT, offset_app_id, stream_positions
from engine.produce.kafka_records import KAFKA_RECORD, parse_records

log = logging.getLogger(__name__)

#: A partition: (Kafka topic, partition number).
Partition = tuple[str, int]

#: The consumer's settings beside ``bootstrap.servers``: larger fetches than Kafka's
#: defaults (1 MiB per partition, 500 records per poll) for a backlog.
CONSUMER_SETTINGS = {
    "client.id": "delayq-kafka-ingest",
    # a recorded position outside what Kafka holds fails the poll, as Spark's source does
    # with failOnDataLoss: never a silent jump over records not stored
    "auto.offset.reset": "none",
    # records of aborted Kafka transactions are not messages
    "isolation.level": "read_committed",
    "max.poll.records": "20000",
    "max.partition.fetch.bytes": "8388608",
    "fetch.max.bytes": "67108864",
    "receive.buffer.bytes": "1048576",
}
#: How long a poll waits for the first record, then for more (fewer, larger commits).
POLL_MS = 500
LINGER_MS = 100
#: How often the topics are asked for partitions added since.
PARTITIONS_EVERY_S = 10.0
_EARLIEST, _LATEST = -2, -1


@dataclass
class Positions:
    """The next offset of each partition that ``commitlog`` and ``quarantine`` have stored
    up to (a partition not in a map: nothing recorded there)."""

    commitlog: dict[Partition, int] = field(default_factory=dict)
    quarantine: dict[Partition, int] = field(default_factory=dict)

    @classmethod
    def recorded(
        cls, commitlog: ArrowDelta, quarantine: ArrowDelta, partitions: Iterable[Partition]
    ) -> Positions:
        """Read the recorded offsets of ``partitions`` from both tables' logs.

        Example:
            >>> Positions.recorded(commitlog, quarantine, [("in", 0)])  # doctest: +SKIP
            Positions(commitlog={('in', 0): 120}, quarantine={})
        """
        found = cls()
        for table, into in ((commitlog, found.commitlog), (quarantine, found.quarantine)):
            for part in partitions:
                version = table.txn_version(offset_app_id(*part))
                if version is not None:
                    into[part] = version
        return found


def _offsets_txn(nexts: dict[Partition, int]) -> Txn:
    txns = [Txn(offset_app_id(*part), nxt) for part, nxt in sorted(nexts.items())]
    return Txn(txns[0].app_id, txns[0].version, also=tuple(txns[1:]))


def _not_stored(
    rows: pa.Table, stored: dict[Partition, int], firsts: dict[Partition, int]
) -> pa.Table:
    """The rows at or after the stored offset of their partition (``firsts``: the batch's
    first offset of each partition; only partitions that start below ``stored`` are
    filtered, a batch read again after a crash)."""
    again = {p: n for p, n in stored.items() if firsts.get(p, n) < n}
    if not again or not rows.num_rows:
        return rows
    drop = None
    topics, parts, offsets = rows["kafka_topic"], rows["kafka_partition"], rows["kafka_offset"]
    for (topic, partition), nxt in again.items():
        here = pc.and_(
            pc.and_(pc.equal(topics, topic), pc.equal(parts, partition)), pc.less(offsets, nxt)
        )
        drop = here if drop is None else pc.or_(drop, here)
    return rows.filter(pc.invert(drop))


def write_batch(
    commitlog: ArrowDelta,
    quarantine: ArrowDelta,
    cfg: EngineConfig,
    records: pa.Table,
    positions: Positions,
    now: datetime,
) -> tuple[int, int]:
    """Store a batch of Kafka records (:data:`KAFKA_RECORD`); return (stored, quarantined).

    Records below the offsets in ``positions`` are stored already and skipped (a batch read
    again after a crash); ``positions`` moves to the end of the batch.

    Example:
        >>> lay = layout(cfg)  # doctest: +SKIP
        >>> tables = ArrowDelta(lay.commitlog), ArrowDelta(lay.quarantine)  # doctest: +SKIP
        >>> write_batch(*tables, cfg, records, Positions(), clock.now())  # doctest: +SKIP
        (1000, 2)
    """
    if not records.num_rows:
        return 0, 0
    where = pa.table(
        {
            "kafka_topic": records["topic"],
            "kafka_partition": records["partition"],
            "kafka_offset": records["offset"],
        }
    )
    ends = where.group_by(["kafka_topic", "kafka_partition"]).aggregate(
        [("kafka_offset", "min"), ("kafka_offset", "max")]
    )
    parts = list(
        zip(ends["kafka_topic"].to_pylist(), ends["kafka_partition"].to_pylist(), strict=True)
    )
    firsts = dict(zip(parts, ends["kafka_offset_min"].to_pylist(), strict=True))
    nexts = {p: o + 1 for p, o in zip(parts, ends["kafka_offset_max"].to_pylist(), strict=True)}
    rows = parse_records(records, cfg, now)
    for name in where.column_names:
        rows = rows.append_column(name, where[name])
    refused = pc.is_valid(rows["reason"])

    bad = _not_stored(rows.filter(refused), positions.quarantine, firsts)
    if bad.num_rows:
        quarantined = bad.drop_columns(where.column_names)
        quarantined = quarantined.append_column(
            "stamp_batch", pa.nulls(bad.num_rows, pa.int64())
        ).append_column(
            "quarantined_ts", pa.array([now] * bad.num_rows, pa.timestamp("us", tz="UTC"))
        )
        moved = {p: n for p, n in nexts.items() if n > positions.quarantine.get(p, -1)}
        quarantine.append(quarantined, txn=_offsets_txn(moved), metadata=None)
        positions.quarantine.update(moved)

    # commitlog records every batch's offsets, even one of bad records only: they are
    # where the ingest starts again.
    moved = {p: n for p, n in nexts.items() if n > positions.commitlog.get(p, -1)}
    good = _not_stored(rows.filter(pc.invert(refused)), positions.commitlog, firsts)
    if moved:
        first = min(moved.items())
        commitlog.append(
            good.drop_columns(["reason", *where.column_names]),
            txn=_offsets_txn(moved),
            metadata=f"delayq kafka ingest {first[0][0]}:{first[0][1]}@{first[1]}",
        )
        positions.commitlog.update(moved)
    return good.num_rows, bad.num_rows


def _read_stream(path: str) -> pa.Table:
    """An Arrow stream file as a table of :data:`KAFKA_RECORD` (read into memory: the file
    is written over by the next poll)."""
    with pa.OSFile(path, "rb") as source:
        table = pa.ipc.open_stream(source).read_all()
    return pa.Table.from_arrays(
        [table[name].cast(KAFKA_RECORD.field(name).type) for name in KAFKA_RECORD.names],
        schema=KAFKA_RECORD,
    )


class KafkaIngest:
    """The ingest loop: a reader in the driver's JVM, the records stored batch by batch.

    Args:
        spark: a session with ``make jars``'s class path (the reader and kafka-clients).
        cfg: brokers, topics, topic map, starting offsets, batch size.
        clock: ``store_ts`` of the stored records.
        out: where a line per stored batch goes.
        skip_lost: where Kafka no longer holds a partition's recorded position, go on from
            its first record instead of failing (the records in between are lost).
    """

    def __init__(
        self,
        spark: SparkSession,
        cfg: EngineConfig,
        clock: Clock | None = None,
        out: Callable[[str], None] | None = None,
        *,
        skip_lost: bool = False,
    ) -> None:
        self.spark = spark
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.out = out
        self.skip_lost = skip_lost
        lay = layout(cfg)
        self.commitlog = ArrowDelta(lay.commitlog)
        self.quarantine = ArrowDelta(lay.quarantine)
        self.positions = Positions()
        self.batches = 0
        self._reader: Any = None
        self._assigned: set[Partition] = set()
        self._partitions_at = 0.0
        self._folder = ""

    def open(self) -> None:
        """Make the tables if missing, the reader, and start each partition where the
        tables say it stopped."""
        ensure_tables(self.spark, self.cfg, migrate=False)  # only the engine migrates
        settings = {"bootstrap.servers": self.cfg.kafka_bootstrap, **CONSUMER_SETTINGS}
        if self.skip_lost:
            settings["auto.offset.reset"] = "earliest"
        reader = jvm(self.spark).delayq.kafka.ArrowRecordReader
        self._reader = reader(java_map(self.spark, settings))
        self._folder = tempfile.mkdtemp(prefix="delayq-ingest-")
        try:
            self.assign(first=True)
        except BaseException:
            self.close()
            raise

    def assign(self, *, first: bool = False) -> None:
        """Read the partitions not read yet (all of them at first, later the added ones)."""
        self._partitions_at = time.monotonic()
        found = [
            (topic, int(p))
            for topic in self.cfg.kafka_ingest_topics
            for p in self._reader.partitions(topic, 10_000)
        ]
        new = [part for part in found if part not in self._assigned]
        if not new:
            return
        recorded = Positions.recorded(self.commitlog, self.quarantine, new)
        self.positions.commitlog.update(recorded.commitlog)
        self.positions.quarantine.update(recorded.quarantine)
        old = (
            stream_positions(
                layout(self.cfg).checkpoint(INGEST_CHECKPOINT), self.commitlog, self.quarantine
            )
            if any(part not in self.positions.commitlog for part in new)
            else None
        )
        # "latest" only for a topic nothing was ever stored from (not for partitions or
        # topics added while the ingest was stopped)
        known = {t for t, _ in [*self.positions.commitlog, *(old.start if old else ())]}
        latest = first and self.cfg.kafka_starting_offsets == "latest"
        at_end = []
        for part in new:
            offset = self.positions.commitlog.get(part)
            if offset is None and old is not None and part in old.start:
                # read again from the stream's last recorded batch; each table skips
                # what it holds beyond it
                offset = old.start[part]
                self.positions.commitlog[part] = old.commitlog.get(part, offset)
                self.positions.quarantine.setdefault(part, old.quarantine.get(part, offset))
            if offset is None:  # nothing stored: the configured start, or a new partition's
                offset = _LATEST if latest and part[0] not in known else _EARLIEST
            self._reader.seek(part[0], part[1], str(offset))
            self._assigned.add(part)
            if offset == _LATEST:
                at_end.append(part)
        if at_end:
            # "latest" is where the ingest first started, not where a restart is: recorded
            # now, so that records sent while it is stopped are read after a restart.
            nexts = {part: int(self._reader.position(*part)) for part in at_end}
            empty = parse_records(KAFKA_RECORD.empty_table(), self.cfg, self.clock.now())
            self.commitlog.append(
                empty.drop_columns(["reason"]),
                txn=_offsets_txn(nexts),
                metadata="delayq kafka ingest starts at the end of the partitions",
            )
            self.positions.commitlog.update(nexts)
        log.info("kafka ingest reads %s", ", ".join(f"{t}:{p}" for t, p in sorted(new)))

    def end_offsets(self) -> dict[Partition, int]:
        """The end offset in Kafka of each partition read."""
        ends = self._reader.endOffsets()
        return {(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1])): int(v) for k, v in ends.items()}

    def caught_up(self, ends: dict[Partition, int]) -> bool:
        """Whether every partition is read up to ``ends``."""
        return all(self._reader.position(t, p) >= end for (t, p), end in ends.items())

    def step(self, timeout_ms: int = POLL_MS) -> tuple[int, int]:
        """Read one batch (waiting up to ``timeout_ms`` for it) and store it; return (stored,
        quarantined)."""
        if time.monotonic() - self._partitions_at > PARTITIONS_EVERY_S or not self._assigned:
            try:
                self.assign()
            except Exception as err:  # a broker unreachable for a while: asked again later
                if "TimeoutException" not in str(err):
                    raise
                log.warning("kafka ingest: the topics' partitions could not be read: %s", err)
        path = os.path.join(self._folder, "batch.arrows")
        try:
            read = self._reader.poll(timeout_ms, LINGER_MS, self.cfg.kafka_max_offsets, path)
        except Exception as err:  # py4j's, carrying the Java exception's text
            found = re.search(r"OffsetOutOfRangeException: ([^\n]*)", str(err))
            if found is None:
                raise
            where = re.search(r"offset=(\d+).* partition (\S+)", found.group(1))
            at = f"{where.group(2)} at offset {where.group(1)}" if where else found.group(1)
            raise IngestError(
                f"kafka ingest: Kafka no longer holds the records of {at}, where commitlog "
                "recorded the ingest stopped: they were removed (retention) or the topic was "
                "made again before they were stored. Nothing was skipped; to go on from the "
                "first record Kafka has, run jobs/kafka_ingest.py once with --skip-lost-records"
            ) from None
        if not read:
            return 0, 0
        records = _read_stream(path)
        stored, bad = write_batch(
            self.commitlog, self.quarantine, self.cfg, records, self.positions, self.clock.now()
        )
        self.batches += 1
        if self.out is not None and (stored or bad):
            self.out(f"batch {self.batches}: {stored} records stored, {bad} quarantined")
        return stored, bad

    def close(self) -> None:
        """Close the reader (its connections to the brokers)."""
        try:
            if self._reader is not None:
                reader, self._reader = self._reader, None
                reader.close()
        finally:
            if self._folder:
                shutil.rmtree(self._folder, ignore_errors=True)


class IngestQuery:
    """A running ingest, in a thread of its own; stopped as a streaming query is.

    Example:
        >>> query = start_ingest(spark, cfg)  # doctest: +SKIP
        >>> query.stop()  # doctest: +SKIP
    """

    def __init__(self, ingest: KafkaIngest, *, available_now: bool) -> None:
        self.ingest = ingest
        self.available_now = available_now
        self._stop = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="delayq-kafka-ingest", daemon=True)

    def start(self) -> IngestQuery:
        """Open the reader here (errors raise now), then read in the thread."""
        self.ingest.open()
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            ends = self.ingest.end_offsets() if self.available_now else None
            while not self._stop.is_set():
                self.ingest.step()
                if ends is not None and self.ingest.caught_up(ends):
                    break
        except DelayQError as err:  # a user's problem: the message says what to do
            log.error("%s", err)
            self._failed = err
        except BaseException as err:  # kept for exception(); the caller decides
            log.exception("kafka ingest failed")
            self._failed = err
        finally:
            try:
                self.ingest.close()
            except Exception as err:
                log.exception("kafka ingest: closing the reader failed")
                if self._failed is None:
                    self._failed = err

    @property
    def isActive(self) -> bool:
        """Whether it is still reading."""
        return self._thread.is_alive()

    def awaitTermination(self, timeout: float | None = None) -> bool:
        """Wait until it stops (``available_now``: once caught up); ``True`` once stopped.

        Raises:
            BaseException: what stopped it, as a streaming query's ``awaitTermination``
                raises its failure.
        """
        self._thread.join(timeout)
        if self._failed is not None:
            raise self._failed
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop after the batch being stored, and close the reader."""
        self._stop.set()
        self._thread.join()

    def exception(self) -> BaseException | None:
        """What stopped it, if it failed."""
        return self._failed


def start_ingest(
    spark: SparkSession,
    cfg: EngineConfig,
    clock: Clock | None = None,
    *,
    available_now: bool = False,
    out: Callable[[str], None] | None = None,
    skip_lost: bool = False,
) -> IngestQuery:
    """Start reading ``cfg.kafka_ingest_topics`` into ``commitlog``.

    Args:
        spark: a session with ``make jars``'s class path (the reader and the Kafka client).
        cfg: brokers, topics, topic map, starting offsets.
        clock: ``store_ts`` of the stored records.
        available_now: read what is there now, then stop (tests, catch-up runs).
        out: where a line per batch goes (stored and quarantined counts).
        skip_lost: go on from a partition's first record where Kafka no longer holds the
            recorded position (see :class:`KafkaIngest`); without it, the ingest fails with
            :class:`~engine.core.errors.IngestError`.

    Returns:
        The running ingest (``stop()``, ``awaitTermination()``, ``isActive``,
        ``exception()``).
    """
    ingest = KafkaIngest(spark, cfg, clock, out, skip_lost=skip_lost)
    return IngestQuery(ingest, available_now=available_now).start()
