"""Where each table lives in a lakehouse, creating the tables, and naming them in SQL.

Layout under the lakehouse root::

    commitlog/          every message sent
    schedule/           stamped messages, partitioned by queue_id
    quarantine/         messages refused by the engine, with the reason
    delay_offset/       the delivery checkpoint (per-queue progress)
    commands/           cancel and reschedule commands from users
    command_results/    what each command did
    consumer_log/       consumer groups' commits (progress, failed messages)
    topics/<topic>/     one table per real topic
    _checkpoints/       Spark streaming checkpoints

Each topic table is registered as ``<database>.<topic>`` (lower case) and the engine's
own tables as ``<database>.commitlog`` etc., so that any session built with
:func:`engine.session.build_spark` can run ``SELECT * FROM delayq.orders``. Any other
Delta-enabled session can read a table by path: ``SELECT * FROM delta.`<root>/topics/orders```.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql.types import StructType

from engine.config import EngineConfig
from engine.errors import InvalidMessageError, SetupError
from engine.fs import hadoop_path, jvm
from engine.views import register_views
from schemas import (
    COMMAND_RESULTS,
    COMMANDS,
    COMMITLOG,
    CONSUMER_LOG,
    QUARANTINE,
    SCHEDULE,
    TOPIC,
    column_names,
)

#: Topic names: a SQL identifier, so that the topic's table can be named in SQL.
TOPIC_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
_TOPIC = re.compile(TOPIC_PATTERN)
#: The engine's own tables share the database; topics may not take their names.
_ENGINE_TABLES = ("commitlog", "schedule", "quarantine", "commands", "command_results")
#: Tables made on first use; registered by name when present.
_OPTIONAL_TABLES = ("consumer_log",)
#: A consumer group's retry and dead-letter topics (RocketMQ's %RETRY%<group>, %DLQ%<group>).
RETRY_PREFIX = "retry_"
DLQ_PREFIX = "dlq_"
#: (Spark application, lakehouse) pairs whose tables are known to exist and be current.
_ENSURED: set[tuple[str, str]] = set()
RESERVED_TOPICS = frozenset(
    {*_ENGINE_TABLES, *_OPTIONAL_TABLES, "delay_offset", "pending", "due_forecast", "consumer_lag"}
)


@dataclass(frozen=True)
class Layout:
    """Paths of every table in one lakehouse."""

    root: str

    @property
    def commitlog(self) -> str:
        """Path of the ``commitlog`` table."""
        return f"{self.root}/commitlog"

    @property
    def schedule(self) -> str:
        """Path of the ``schedule`` table."""
        return f"{self.root}/schedule"

    @property
    def quarantine(self) -> str:
        """Path of the ``quarantine`` table."""
        return f"{self.root}/quarantine"

    @property
    def delay_offset(self) -> str:
        """Path of the delivery checkpoint table."""
        return f"{self.root}/delay_offset"

    @property
    def commands(self) -> str:
        """Path of the ``commands`` table (cancel / reschedule)."""
        return f"{self.root}/commands"

    @property
    def command_results(self) -> str:
        """Path of the ``command_results`` table."""
        return f"{self.root}/command_results"

    @property
    def consumer_log(self) -> str:
        """Path of the ``consumer_log`` table (consumer groups' commits)."""
        return f"{self.root}/consumer_log"

    @property
    def topics(self) -> str:
        """Folder holding one table per topic."""
        return f"{self.root}/topics"

    def topic(self, topic: str) -> str:
        """Path of one topic's table."""
        return f"{self.topics}/{topic_table_name(topic)}"

    def checkpoint(self, query: str) -> str:
        """Spark checkpoint folder of a streaming query."""
        return f"{self.root}/_checkpoints/{query}"


def layout(cfg: EngineConfig) -> Layout:
    """The layout of the lakehouse ``cfg`` points at."""
    return Layout(cfg.lakehouse_path)


def check_topic(topic: object, internal: bool = False) -> str:
    """Return ``topic`` if it is a valid topic name, else raise naming it.

    Args:
        topic: the name to check.
        internal: allow the engine's own group topics (``retry_<group>``, ``dlq_<group>``).

    Raises:
        InvalidMessageError: when the name is missing, not an identifier, or reserved.
    """
    if not isinstance(topic, str) or not topic:
        raise InvalidMessageError("topic", topic, "a topic is required")
    if not _TOPIC.match(topic):
        raise InvalidMessageError(
            "topic", topic, "must be letters, digits and _ (not starting with a digit), <= 128"
        )
    if topic.lower() in RESERVED_TOPICS:
        raise InvalidMessageError("topic", topic, "is the name of an engine table")
    if not internal and topic.lower().startswith((RETRY_PREFIX, DLQ_PREFIX)):
        raise InvalidMessageError(
            "topic", topic, f"{RETRY_PREFIX}* and {DLQ_PREFIX}* are consumer groups' topics"
        )
    return topic


def retry_topic(group: str) -> str:
    """The retry topic of consumer group ``group`` (RocketMQ's ``%RETRY%<group>``)."""
    return f"{RETRY_PREFIX}{group.lower()}"


def dlq_topic(group: str) -> str:
    """The dead-letter topic of consumer group ``group`` (RocketMQ's ``%DLQ%<group>``)."""
    return f"{DLQ_PREFIX}{group.lower()}"


def ensure_topic_table(spark: SparkSession, cfg: EngineConfig, topic: str) -> str:
    """Create topic ``topic``'s table, empty, if it does not exist yet; return its path.

    Delivery creates topic tables as it first writes them; a streaming consumer needs
    its tables before that.
    """
    path = layout(cfg).topic(topic)
    _create(spark, path, TOPIC, None, migrate=False)
    return path


def topic_table_name(topic: str) -> str:
    """The table name of a topic: its name in lower case (SQL names ignore case)."""
    return topic.lower()


def _create(
    spark: SparkSession, path: str, schema: StructType, partition: str | None, migrate: bool
) -> None:
    if DeltaTable.isDeltaTable(spark, path):
        _add_missing_columns(spark, path, schema, migrate)
        return
    builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
    if partition:
        builder = builder.partitionedBy(partition)
    try:
        builder.execute()
    except Exception:
        # Another process may have created it between the check and the commit.
        if not DeltaTable.isDeltaTable(spark, path):
            raise


def _add_missing_columns(spark: SparkSession, path: str, schema: StructType, migrate: bool) -> None:
    """Bring a lakehouse made by an older version up to date: add new (nullable) columns.

    Only the engine migrates, at start, before its streams read the tables; a producer
    that finds an old table fails with a clear message instead.
    """
    present = set(spark.read.format("delta").load(path).columns)
    missing = [f for f in schema.fields if f.name not in present]
    if missing and not migrate:
        names = ", ".join(f.name for f in missing)
        raise SetupError(
            f"{path} was made by an older version (no {names}): start the engine once "
            "(make run, or jobs/delay_engine.py) to upgrade the lakehouse"
        )
    if missing:
        columns = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in missing)
        spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS ({columns})")


def ensure_tables(spark: SparkSession, cfg: EngineConfig, migrate: bool = True) -> Layout:
    """Create the engine's tables if missing (safe to call again) and return the layout.

    Args:
        spark: a Delta-enabled session.
        cfg: the lakehouse to use.
        migrate: add columns that tables made by an older version lack (the engine does,
            at start); if false, such a table raises :class:`~engine.errors.SetupError`.
    """
    lay = layout(cfg)
    ensured = (spark.sparkContext.applicationId, lay.root)
    if ensured in _ENSURED:
        return lay  # this application has checked (and created) them already
    _create(spark, lay.commitlog, COMMITLOG, None, migrate)
    _create(spark, lay.schedule, SCHEDULE, "queue_id", migrate)
    _create(spark, lay.quarantine, QUARANTINE, None, migrate)
    _create(spark, lay.commands, COMMANDS, None, migrate)
    _create(spark, lay.command_results, COMMAND_RESULTS, None, migrate)
    _ENSURED.add(ensured)
    return lay


def ensure_consumer_log(spark: SparkSession, cfg: EngineConfig) -> str:
    """Create the ``consumer_log`` table if missing; return its path."""
    path = layout(cfg).consumer_log
    _create(spark, path, CONSUMER_LOG, None, migrate=False)
    return path


def latest_version(spark: SparkSession, path: str) -> int:
    """The latest committed version of a Delta table (asks Delta: a few hundred ms)."""
    row = DeltaTable.forPath(spark, path).history(1).select("version").first()
    return int(row[0]) if row else -1


class VersionTracker:
    """Follows the latest version of a Delta table cheaply.

    Asks Delta once, then looks for the next commit files (``_delta_log/<v+1>.json``):
    versions are consecutive, so a few ``exists`` calls (about a millisecond each on a
    local disk) replace a history query per round.
    """

    def __init__(self, spark: SparkSession, path: str) -> None:
        self._log, self._fs = hadoop_path(spark, f"{path}/_delta_log")
        self._path = jvm(spark).org.apache.hadoop.fs.Path
        self.version = latest_version(spark, path)

    def latest(self) -> int:
        """The latest version now."""
        while self._fs.exists(self._path(self._log, f"{self.version + 1:020d}.json")):
            self.version += 1
        return self.version


def list_files(spark: SparkSession, folder: str, suffix: str = "") -> list[str]:
    """Names of the visible files in ``folder`` ending with ``suffix`` (any filesystem)."""
    path, fs = hadoop_path(spark, folder)
    if not fs.exists(path):
        return []
    return sorted(
        name
        for status in fs.listStatus(path)
        if status.isFile()
        and (name := status.getPath().getName()).endswith(suffix)
        and not name.startswith((".", "_"))
    )


def list_topics(spark: SparkSession, cfg: EngineConfig) -> list[str]:
    """Names of the topic tables in the lakehouse (lower case, sorted).

    A table counts once its first commit is in its log (its folder appears a moment before).
    """
    path, fs = hadoop_path(spark, layout(cfg).topics)
    if not fs.exists(path):
        return []
    hadoop = jvm(spark).org.apache.hadoop.fs.Path
    names = []
    for status in fs.listStatus(path):
        commits = hadoop(status.getPath(), "_delta_log/*.json")
        if status.isDirectory() and fs.globStatus(commits):
            names.append(status.getPath().getName())
    return sorted(names)


def register_table(spark: SparkSession, cfg: EngineConfig, name: str, path: str) -> None:
    """Make the Delta table at ``path`` queryable as ``<database>.<name>``."""
    if not spark.catalog.databaseExists(cfg.database):
        spark.sql(f"CREATE DATABASE IF NOT EXISTS `{cfg.database}`")
    spark.sql(f"CREATE TABLE IF NOT EXISTS `{cfg.database}`.`{name}` USING delta LOCATION '{path}'")


def register_topic_tables(spark: SparkSession, cfg: EngineConfig) -> list[str]:
    """Register every existing topic table and the engine's tables by name.

    Call again to pick up topics created since (``engine.refresh_tables(spark)``).

    Returns:
        The topic table names registered.
    """
    lay = layout(cfg)
    present = []
    for name in _ENGINE_TABLES + _OPTIONAL_TABLES:
        path = getattr(lay, name)
        if DeltaTable.isDeltaTable(spark, path):
            register_table(spark, cfg, name, path)
            present.append(name)
    # The views need current tables: a lakehouse made by an older version gets them once
    # the engine has started (and upgraded it).
    current = set(_ENGINE_TABLES) <= set(present) and set(column_names(SCHEDULE)) <= set(
        spark.read.format("delta").load(lay.schedule).columns
    )
    if list_files(spark, lay.delay_offset, ".json"):
        register_views(spark, cfg.database, lay.delay_offset, pending=current)
    topics = list_topics(spark, cfg)
    for name in topics:
        register_table(spark, cfg, name, f"{lay.topics}/{name}")
    if "consumer_log" in present:
        from engine.consumer import register_lag_view

        register_lag_view(spark, cfg)
    return topics
