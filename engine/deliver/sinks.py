"""Where a delivery round writes a topic's due rows: the sink protocol and the Delta sink.

Resume contract (what a crash and a replay do): a round records its plan before its first
write, then stages each topic table's write (:meth:`TopicSink.stage`), makes the calls that
show the rows at its watermark, then commits its progress. A
round replayed after a crash has the same plan and computes exactly the same rows; for each
table it first asks :meth:`TopicSink.written` and skips a write that finished. So a sink
whose ``written`` never misses a finished write delivers exactly once (Delta: the commit
records the round as its ``txn`` version and carries the round's tag); one that may miss it
delivers at least once (Kafka without transactions, see :mod:`engine.deliver.kafka_sink`;
with ``kafka.exactly_once`` the round's records and a marker commit in one Kafka
transaction, and ``written`` reads the marker).

``kafka.sinks.<topic>`` chooses per topic table: ``delta`` (the default), ``kafka`` or ``both``.

Example:
    >>> sinks = Sinks(spark, cfg, lay, checkpoint_id="9f2c")  # doctest: +SKIP
    >>> [type(s).__name__ for s in sinks.of("orders")]  # doctest: +SKIP
    ['DeltaTopicSink']
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pyarrow as pa
from pyspark.sql import SparkSession

from engine.core.config import EngineConfig
from engine.deliver.kafka_sink import KafkaTopicSink, TransactionalKafkaSink
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.delta.log_append import FileLayout
from engine.lakehouse.delta.tables import ensure_topic_table
from engine.lakehouse.storage.layout import Layout
from schemas import TOPIC, column_names

#: Commits of a topic table a replayed round looks through for its own.
HISTORY_LOOKBACK = 1000


class TopicSink(Protocol):
    """Writes one round's rows of one topic table; says whether a round's write finished.

    The rules a sink keeps, on which exactly-once and never-early rest:

    * **Never early.** :meth:`stage` may run before the round's watermark (the running engine
      plans ahead) and must do only what no reader can see; the call it returns shows the
      rows, and the round makes it at or after the watermark. A sink that cannot prepare
      anything unseen (Kafka: a record is read once sent) does its whole write in that call.
    * **Resume.** A round is replayed with the same rows after a crash. On replay (only) the
      round asks :meth:`written` first and skips a sink that says the round's write finished;
      so a write must leave a durable record of the round that :meth:`written` finds (the
      Delta sink: the ``txn`` its commit records; Kafka: a marker), recorded in the same
      commit as the rows or after them, never before.
    """

    def written(self, round_: int, table: str) -> bool:
        """Whether round ``round_`` finished its write of ``table`` (asked on replay only)."""
        ...

    def stage(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> Callable[[], None]:
        """Do now what no reader sees; return the call that shows the rows (made at or
        after the round's watermark)."""
        ...

    def write(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> None:
        """Write the round's rows of ``table`` (topic-table columns): :meth:`stage`, then
        the call it returns."""
        ...


class SinkSet(Protocol):
    """The sinks of each topic table."""

    def of(self, table: str) -> Sequence[TopicSink]:
        """The sinks ``table``'s rows go to, in write order."""
        ...


class DeltaTopicSink:
    """The topic's Delta table, exactly once.

    Each commit records ``txnAppId = delayq-deliver-<checkpoint>`` with the round as its
    version, and ``userMetadata = delayq round <k> checkpoint <id>``. A replayed round's write
    finished when the table's ``txn`` version reached the round, or (for writes made before
    the ``txn`` was recorded on every commit) when its recent history holds the tag. Commits
    go through delta-rs; a table that does not exist yet is created first (by delta-rs too).
    """

    def __init__(
        self, spark: SparkSession, cfg: EngineConfig, layout: Layout, checkpoint_id: str
    ) -> None:
        self.spark = spark
        self.cfg = cfg
        self.layout = layout
        self.checkpoint_id = checkpoint_id
        self._tables: dict[str, ArrowDelta] = {}
        self._exist: set[str] = set()  # tables known to exist (created, or seen)
        self._lock = threading.Lock()

    @property
    def app_id(self) -> str:
        """``txnAppId`` of this checkpoint's topic writes."""
        return f"delayq-deliver-{self.checkpoint_id}"

    def tag(self, round_: int) -> str:
        """The ``userMetadata`` of a round's topic commits."""
        return f"delayq round {round_} checkpoint {self.checkpoint_id}"

    def _table(self, table: str) -> ArrowDelta:
        with self._lock:
            if table not in self._tables:
                self._tables[table] = ArrowDelta(self.layout.topic(table))
            return self._tables[table]

    def written(self, round_: int, table: str) -> bool:
        """Whether the table's ``txn`` version or recent history shows the round's write."""
        delta = self._table(table)
        done = delta.txn_version(self.app_id)
        if done is not None and done >= round_:
            return True
        return delta.committed_with(self.tag(round_), HISTORY_LOOKBACK)

    def write(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> None:
        """Append the rows in one commit that records the round."""
        self.stage(round_, table, rows, replayed)()

    def stage(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> Callable[[], None]:
        """Write the round's data files now (invisible); the returned function commits them.

        A table that does not exist yet is created here: empty, it shows no row early.
        """
        delta = self._ensure(table)
        return delta.stage(rows, txn=Txn(self.app_id, round_), metadata=self.tag(round_))

    def _ensure(self, table: str) -> ArrowDelta:
        delta = self._table(table)
        if table not in self._exist:
            if delta.latest() < 0:
                ensure_topic_table(self.spark, self.cfg, table)
            self._exist.add(table)
        return delta

    def known(self) -> list[str]:
        """The topic tables this sink has written or seen."""
        with self._lock:
            return sorted(self._exist)

    def file_layout(self, table: str) -> FileLayout | None:
        """How Spark tasks write ``table``'s files for :meth:`commit_files` (the table is
        created first when it does not exist); ``None`` when it takes appends only through
        the driver.

        Example:
            >>> sink.file_layout("orders").path  # doctest: +SKIP
            '/lake/topics/orders'
        """
        return self._ensure(table).file_layout(column_names(TOPIC))

    def commit_files(
        self, round_: int, table: str, adds: list[dict[str, Any]], rows: int, layout: FileLayout
    ) -> None:
        """Commit files Spark tasks wrote for the round (one commit that records the round,
        as :meth:`stage`'s does)."""
        self._ensure(table).commit_files(
            adds, rows, layout, txn=Txn(self.app_id, round_), metadata=self.tag(round_)
        )


class Sinks:
    """The configured sinks of every topic table, for one delivery checkpoint.

    Args:
        spark: the engine's session.
        cfg: ``kafka.sinks`` and the Kafka settings.
        layout: table paths.
        checkpoint_id: the delivery checkpoint the writes belong to.
    """

    def __init__(
        self, spark: SparkSession, cfg: EngineConfig, layout: Layout, checkpoint_id: str
    ) -> None:
        self.cfg = cfg
        self.delta = DeltaTopicSink(spark, cfg, layout, checkpoint_id)
        kafka = TransactionalKafkaSink if cfg.kafka_exactly_once else KafkaTopicSink
        self.kafka: TopicSink = kafka(spark, cfg, layout, checkpoint_id)

    def close(self) -> None:
        """Close the Kafka producers (the Delta sink holds nothing to close)."""
        close = getattr(self.kafka, "close", None)
        if close is not None:
            close()

    def delta_only(self) -> bool:
        """Whether every topic table goes to Delta only (``kafka.sinks`` names none)."""
        return all(chosen == "delta" for chosen in self.cfg.kafka_sinks.values())

    def of(self, table: str) -> Sequence[TopicSink]:
        """Kafka first, then Delta, as ``kafka.sinks.<table>`` says."""
        chosen = self.cfg.sink(table)
        delta: list[TopicSink] = [self.delta] if chosen in ("delta", "both") else []
        kafka: list[TopicSink] = [self.kafka] if chosen in ("kafka", "both") else []
        return kafka + delta


#: Builds the sinks of a delivery checkpoint: ``Sinks`` unless the engine is given another.
SinkFactory = Callable[[SparkSession, EngineConfig, Layout, str], SinkSet]
