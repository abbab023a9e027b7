"""Names in the SQL catalog: every registration of a table or view happens here.

Each topic table is registered as ``<database>.<topic>`` (lower case) and the engine's own
tables as ``<database>.commitlog`` etc., so that a session can run
``SELECT * FROM delayq.orders``. Any other Delta-enabled session can read a table by path:
``SELECT * FROM delta.`<root>/topics/orders```.

Registration happens at well-defined points, never inside a delivery round:

* :func:`register_all` when a reader's session starts
  (:func:`engine.lakehouse.catalog.session.build_spark`);
* :class:`Catalog` for the engine, after a round that created a topic table or the first
  committed round (the checkpoint views need the checkpoint's first file).

Example:
    >>> register_all(spark, cfg)  # doctest: +SKIP
    ['notifications', 'orders']
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from delta.tables import DeltaTable
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.core.config import EngineConfig
from engine.core.errors import SetupError
from engine.core.topics import ENGINE_TABLES, OPTIONAL_TABLES
from engine.lakehouse.catalog.views import (
    checkpoint_views,
    delay_offset_query,
    history_query,
    lag_sql,
    request_results_query,
    schedules_query,
)
from engine.lakehouse.delta.delta_log import list_topics, table_exists
from engine.lakehouse.storage.fs import list_files
from engine.lakehouse.storage.layout import layout
from schemas import SCHEDULE, column_names

log = logging.getLogger(__name__)

#: The view of every message's events (a topic of that name takes the name instead).
HISTORY_VIEW = "history"

#: One registration at a time in a process: two sessions naming the same view at once would
#: both find it missing, and the second ``CREATE VIEW`` would fail with "already exists".
REGISTERING = threading.RLock()

_F = TypeVar("_F", bound=Callable[..., Any])


def _one_at_a_time(function: _F) -> _F:
    @functools.wraps(function)
    def registering(*args: Any, **kwargs: Any) -> Any:
        with REGISTERING:
            return function(*args, **kwargs)

    return cast(_F, registering)


def ensure_database(spark: SparkSession, cfg: EngineConfig) -> None:
    """Create ``cfg.database`` in the session's catalog if it is missing."""
    if not spark.catalog.databaseExists(cfg.database):
        spark.sql(f"CREATE DATABASE IF NOT EXISTS `{cfg.database}`")


@_one_at_a_time
def register_table(spark: SparkSession, cfg: EngineConfig, name: str, path: str) -> None:
    """Make the Delta table at ``path`` queryable as ``<database>.<name>``.

    A name a persistent catalog keeps for a location that no longer exists (the lakehouse
    was moved) is pointed at ``path``: only the catalog entry is replaced. A topic table
    named ``history`` replaces the ``history`` view (the view is then not made).

    Raises:
        SetupError: when the name belongs to something else: a table at another existing
            location (another lakehouse using this database), a managed table, a view.
    """
    ensure_database(spark, cfg)
    database = cfg.database
    registered = _entry(spark, database, name)
    if registered is not None:
        location, kind = registered
        if kind == "VIEW" and name == HISTORY_VIEW:
            spark.sql(f"DROP VIEW `{database}`.`{name}`")
        elif location is not None and _same_place(location, path):
            return
        elif kind == "EXTERNAL" and location is not None and not _still_there(location):
            spark.sql(f"DROP TABLE `{database}`.`{name}`")  # the entry only: it is external
        else:
            where = f" at {location}" if location else ""
            raise SetupError(
                f"{database}.{name} already names a {kind.lower()} table{where}, not this "
                f"lakehouse's {path}: set lakehouse.database to a database of its own"
            )
    spark.sql(f"CREATE TABLE IF NOT EXISTS `{database}`.`{name}` USING delta LOCATION '{path}'")


def _entry(spark: SparkSession, database: str, name: str) -> tuple[str | None, str] | None:
    """(local path or URI, ``EXTERNAL``/``MANAGED``/``VIEW``) of ``database.name`` in the
    catalog, ``None`` if absent."""
    catalog = spark._jsparkSession.sharedState().externalCatalog()
    if not catalog.tableExists(database, name):
        return None
    table = catalog.getTable(database, name)
    kind = str(table.tableType().name())
    uri = table.storage().locationUri()
    if uri.isEmpty():
        return None, kind
    uri = uri.get()
    local = uri.getScheme() in (None, "file")
    return str(uri.getPath() if local else uri.toString()), kind


def _still_there(location: str) -> bool:
    """Whether a Delta table still holds ``location`` (one on a store delayq does not read,
    such as HDFS, counts as gone, as a missing folder does)."""
    try:
        return table_exists(location)
    except SetupError:
        return False


def _same_place(location: str, path: str) -> bool:
    return location.rstrip("/") == path.removeprefix("file:").rstrip("/")


@_one_at_a_time
def put_view(spark: SparkSession, database: str, name: str, query: str) -> None:
    """Name ``query`` as the view ``database.name``; readers never find the name missing.

    A view that already has this query is left as it is (no catalog write). One with
    another query is altered in place: ``CREATE OR REPLACE VIEW`` drops the view and
    creates it again, and a query by a reader in between (or by a view over this one)
    fails with "table or view not found".

    Raises:
        SetupError: when the name belongs to a table.

    Example:
        >>> put_view(spark, "delayq", "late", "SELECT 1 AS one")  # doctest: +SKIP
    """
    catalog = spark._jsparkSession.sharedState().externalCatalog()
    if not catalog.tableExists(database, name):
        try:
            spark.sql(f"CREATE VIEW `{database}`.`{name}` AS {query}")
            return
        except AnalysisException as err:  # made meanwhile by another process (one metastore)
            if not catalog.tableExists(database, name):
                raise
            log.debug("%s.%s was created meanwhile: %s", database, name, err)
    table = catalog.getTable(database, name)
    kind = str(table.tableType().name())
    if kind != "VIEW":
        raise SetupError(
            f"{database}.{name} already names a {kind.lower()} table, not delayq's view: set "
            "lakehouse.database to a database of its own"
        )
    text = table.viewText()
    if text.isDefined() and str(text.get()).strip() == query.strip():
        return
    spark.sql(f"ALTER VIEW `{database}`.`{name}` AS {query}")


@_one_at_a_time
def register_views(spark: SparkSession, cfg: EngineConfig, pending: bool = True) -> None:
    """Name ``delay_offset``, and with ``pending`` also ``pending`` and ``due_forecast``
    (they need ``schedule`` and ``command_results``)."""
    ensure_database(spark, cfg)
    put_view(spark, cfg.database, "delay_offset", delay_offset_query(layout(cfg).delay_offset))
    for name, query in checkpoint_views(cfg.database).items() if pending else ():
        put_view(spark, cfg.database, name, query)


@_one_at_a_time
def register_history_view(spark: SparkSession, cfg: EngineConfig, topics: Iterable[str]) -> None:
    """Name ``<database>.history`` over the engine's tables and ``topics``
    (the engine's tables must be registered); not made when a topic is named ``history``."""
    names = sorted(set(topics))
    if HISTORY_VIEW in names:
        log.warning(
            "a topic is named %s: no %s.%s view (delayq history and inspect.history work)",
            HISTORY_VIEW,
            cfg.database,
            HISTORY_VIEW,
        )
        return
    ensure_database(spark, cfg)
    put_view(spark, cfg.database, HISTORY_VIEW, history_query(cfg.database, names))


@_one_at_a_time
def register_schedules_view(spark: SparkSession, cfg: EngineConfig) -> bool:
    """Name ``<database>.schedules`` once the engine has published the schedules' next
    occurrences (the ``recurring`` table must be registered); whether it did."""
    folder = layout(cfg).recurring_next
    if not list_files(folder, ".json"):
        return False
    ensure_database(spark, cfg)
    put_view(spark, cfg.database, "schedules", schedules_query(cfg.database, folder))
    return True


@_one_at_a_time
def register_request_results_view(spark: SparkSession, cfg: EngineConfig) -> bool:
    """Name ``<database>.schedule_request_results`` once the engine has decided a request
    made in SQL (:mod:`engine.recur.requests`); whether it did."""
    folder = layout(cfg).checkpoint("schedule-requests")
    if not list_files(folder, ".json"):
        return False
    ensure_database(spark, cfg)
    put_view(spark, cfg.database, "schedule_request_results", request_results_query(folder))
    return True


def lag_tables(spark: SparkSession, cfg: EngineConfig) -> dict[str, str] | None:
    """Topic table name -> path, for the tables some consumer group has committed a
    position in (``None`` when no group ever committed)."""
    lay = layout(cfg)
    if not table_exists(lay.consumer_log):
        return None
    present = set(list_topics(cfg))
    log = spark.read.format("delta").load(lay.consumer_log)
    names = [
        r[0] for r in log.where(F.col("kind") == "offset").select("topic").distinct().collect()
    ]
    return {n: lay.topic(n) for n in names if n in present}


@_one_at_a_time
def register_lag_view(spark: SparkSession, cfg: EngineConfig) -> None:
    """Name ``<database>.consumer_lag`` over the groups known now."""
    tables = lag_tables(spark, cfg)
    if tables is None:
        return
    ensure_database(spark, cfg)
    put_view(spark, cfg.database, "consumer_lag", lag_sql(layout(cfg).consumer_log, tables))


def register_all(spark: SparkSession, cfg: EngineConfig) -> list[str]:
    """Register every existing topic table, the engine's tables and its views by name.

    Call again to pick up topics created since (``engine.refresh_tables(spark, cfg)``).
    Safe beside the engine's own registrations in the same process (a ``delayq`` command
    the engine carries out registers too): one registration at a time.

    Returns:
        The topic table names registered.
    """
    with REGISTERING:
        return _register_all(spark, cfg)


def _register_all(spark: SparkSession, cfg: EngineConfig) -> list[str]:
    lay = layout(cfg)
    present = []
    for name in ENGINE_TABLES + OPTIONAL_TABLES:
        path = lay.table(name)
        if DeltaTable.isDeltaTable(spark, path):
            register_table(spark, cfg, name, path)
            present.append(name)
    # The views need current tables: a lakehouse made by an older version gets them once
    # the engine has started (and upgraded it).
    current = set(ENGINE_TABLES) <= set(present) and set(column_names(SCHEDULE)) <= set(
        spark.read.format("delta").load(lay.schedule).columns
    )
    if list_files(lay.delay_offset, ".json"):
        register_views(spark, cfg, pending=current)
    topics = list_topics(cfg)
    for name in topics:
        register_table(spark, cfg, name, lay.topic(name))
    if current:
        register_history_view(spark, cfg, topics)
    if "consumer_log" in present:
        register_lag_view(spark, cfg)
    if "recurring" in present:
        register_schedules_view(spark, cfg)
    if "schedule_requests" in present:
        register_request_results_view(spark, cfg)
    return topics


class Catalog:
    """The engine's catalog registrations: each name once, after the round that made it.

    Holds no state but what it registered; does nothing when ``sql.register_tables`` is off.

    Example:
        >>> catalog = Catalog(spark, cfg)  # doctest: +SKIP
        >>> catalog.after_round(["orders"], committed=True)  # doctest: +SKIP
    """

    def __init__(self, spark: SparkSession, cfg: EngineConfig) -> None:
        self.spark = spark
        self.cfg = cfg
        self._known: set[str] = set()

    def open(self) -> None:
        """Register what exists now (the engine's start)."""
        if self.cfg.register_tables:
            self._known |= set(register_all(self.spark, self.cfg))

    def after_round(self, delta_topics: Iterable[str], committed: bool) -> None:
        """Register the Delta topic tables a round wrote and, after the first commit, the
        checkpoint views."""
        if not self.cfg.register_tables:
            return
        with REGISTERING:
            self._register_new(delta_topics, committed)

    def _register_new(self, delta_topics: Iterable[str], committed: bool) -> None:
        new = sorted(set(delta_topics) - self._known)
        self._known |= set(new)  # tried once: a name that cannot be registered is said once
        for name in new:
            self._try(register_table, name, layout(self.cfg).topic(name))
        if new:
            self._try(register_history_view, list_topics(self.cfg))
        if committed and "delay_offset" not in self._known:
            self._known.add("delay_offset")
            self._try(register_views)

    def after_publish(self) -> None:
        """Name the recurring schedules' table and view once their first next occurrences
        are published."""
        if not self.cfg.register_tables or "schedules" in self._known:
            return
        with REGISTERING:
            self._known.add("schedules")
            self._try(register_table, "recurring", layout(self.cfg).recurring)
            self._try(register_schedules_view)

    def after_requests(self) -> None:
        """Name the results of the schedule requests made in SQL once some are decided."""
        if not self.cfg.register_tables or "schedule_request_results" in self._known:
            return
        with REGISTERING:
            self._known.add("schedule_request_results")
            self._try(register_request_results_view)

    def _try(self, register: Callable[..., Any], *args: Any) -> None:
        """Names are a convenience: a registration that fails mid-run is logged and
        delivery goes on (queries by path work)."""
        try:
            register(self.spark, self.cfg, *args)
        except Exception as err:
            text = str(err).strip()
            log.warning(
                "could not name a table in the SQL catalog (%s: %s)",
                type(err).__name__,
                text.splitlines()[0][:300] if text else "",
            )
