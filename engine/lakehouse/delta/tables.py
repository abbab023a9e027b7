"""Creating the engine's tables, and bringing a lakehouse made by an older version up to date.

Every table is created with its schema from :mod:`schemas`. Creation tolerates another
process creating the same table at the same moment. Only the engine migrates (adds new
nullable columns), at start; a producer that finds an old table fails with a clear message.

Example:
    >>> lay = ensure_tables(spark, cfg)  # doctest: +SKIP
    >>> ensure_topic_table(spark, cfg, "orders")  # doctest: +SKIP
    '/lake/topics/orders'
"""

from __future__ import annotations

import logging
import time

from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

from engine.core.config import EngineConfig
from engine.core.errors import SetupError
from engine.lakehouse.delta.arrow_delta import columns, create_table
from engine.lakehouse.delta.delta_log import table_exists
from engine.lakehouse.storage.layout import Layout, layout
from engine.lakehouse.storage.location import store_for
from schemas import COMMAND_RESULTS, COMMANDS, COMMITLOG, CONSUMER_LOG, QUARANTINE, SCHEDULE, TOPIC

log = logging.getLogger(__name__)
#: Tries to create a table while other processes race to create it too.
CREATE_ATTEMPTS = 8
#: (Spark application, lakehouse) pairs whose tables are known to exist and be current.
_ENSURED: set[tuple[str, str]] = set()


def ensure_topic_table(spark: SparkSession, cfg: EngineConfig, topic: str) -> str:
    """Create topic ``topic``'s table, empty, if it does not exist yet; return its path.

    Delivery creates topic tables as it first writes them (a round meeting 100 new topics
    makes 100 tables: with delta-rs, no Spark job); a streaming consumer needs its tables
    before that.
    """
    path = layout(cfg).topic(topic)
    if not create_table(path, to_arrow_schema(TOPIC, timezone="UTC")):
        _add_missing_columns(spark, path, TOPIC, migrate=False)
    return path


def _create(
    spark: SparkSession, path: str, schema: StructType, partition: str | None, migrate: bool
) -> None:
    """Create the table unless it exists; tolerate other processes creating it at once.

    Engines, producers and consumers may all start on a new lakehouse at the same moment.
    A creation that loses the race fails in one of several ways (a Delta conflict, "location
    is not empty and also not a Delta table" while the other has written its log folder but
    not its first commit, "table not found" while it looked); it waits, looks again, and
    finds the other's table. An error that outlasts the tries is raised.
    """
    for attempt in range(1, CREATE_ATTEMPTS + 1):
        if table_exists(path):
            break
        builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
        if partition:
            builder = builder.partitionedBy(partition)
        try:
            builder.execute()
        except Exception as err:
            if table_exists(path):
                break  # another process made it first
            if attempt == CREATE_ATTEMPTS:
                raise
            log.info("creating %s failed (%s); another process may be creating it", path, err)
            time.sleep(0.25 * attempt)  # look again
    _add_missing_columns(spark, path, schema, migrate)


def _add_missing_columns(spark: SparkSession, path: str, schema: StructType, migrate: bool) -> None:
    """Bring a lakehouse made by an older version up to date: add new (nullable) columns.

    Only the engine migrates, at start, before its streams read the tables; a producer
    that finds an old table fails with a clear message instead.
    """
    present = set(columns(path))
    missing = [f for f in schema.fields if f.name not in present]
    if missing and not migrate:
        names = ", ".join(f.name for f in missing)
        raise SetupError(
            f"{path} was made by an older version (no {names}): start the engine once "
            "(make run, or jobs/delay_engine.py) to upgrade the lakehouse"
        )
    if missing:
        added = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in missing)
        spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS ({added})")


def ensure_tables(spark: SparkSession, cfg: EngineConfig, migrate: bool = True) -> Layout:
    """Create the engine's tables if missing (safe to call again) and return the layout.

    Args:
        spark: a Delta-enabled session.
        cfg: the lakehouse to use.
        migrate: add columns that tables made by an older version lack (the engine does,
            at start); if false, such a table raises :class:`~engine.core.errors.SetupError`.
    """
    lay = layout(cfg)
    ensured = (spark.sparkContext.applicationId, lay.root)
    if ensured in _ENSURED:
        return lay  # this application has checked (and created) them already
    store_for(lay.root).check(lay.root)
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
