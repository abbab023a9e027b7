"""The embedded metastore: table names kept with the lakehouse, in ``<lakehouse>/_metastore/``.

With ``sql.catalog = "embedded"`` (the default) a session's catalog is a Hive metastore in an
Apache Derby database inside the lakehouse, so names registered once are seen by every later
session: ``spark-sql`` or ``pyspark`` with ``.jars/spark-defaults.conf`` (which points at the
default lakehouse's metastore), a notebook, the engine. Derby lets one process open it at a
time: a session that finds it open in another process (a running engine) names tables in its
own memory instead, as ``sql.catalog = "memory"`` does, and says so once.

Example:
    >>> conf = catalog_conf(cfg)  # doctest: +SKIP
    >>> conf["spark.sql.catalogImplementation"]  # doctest: +SKIP
    'hive'
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from engine.core.config import EngineConfig

log = logging.getLogger(__name__)

#: The metastore's folder under the lakehouse root: the Derby database in ``db``, its log
#: in ``derby.log``.
METASTORE_DIR = "_metastore"
#: Derby holds an OS lock on this file while a process has the database open.
_LOCK_FILE = "dbex.lck"


def metastore_path(cfg: EngineConfig) -> Path:
    """``<lakehouse>/_metastore/db``, the Derby database holding the names."""
    return Path(cfg.lakehouse_path) / METASTORE_DIR / "db"


def derby_log(cfg: EngineConfig) -> Path:
    """``<lakehouse>/_metastore/derby.log``: Derby writes here, not to the current folder."""
    return Path(cfg.lakehouse_path) / METASTORE_DIR / "derby.log"


def metastore_url(path: Path | str) -> str:
    """The JDBC address of the embedded Derby database at ``path`` (created on first use).

    Example:
        >>> metastore_url("/data/lakehouse/_metastore/db")
        'jdbc:derby:;databaseName=/data/lakehouse/_metastore/db;create=true'
    """
    return f"jdbc:derby:;databaseName={path};create=true"


def hive_conf(path: Path | str, warehouse: str) -> dict[str, str]:
    """The Spark settings that put a session's catalog in the Derby metastore at ``path``.

    Example:
        >>> hive_conf("/lh/_metastore/db", "/lh/_warehouse")["spark.sql.catalogImplementation"]
        'hive'
    """
    return {
        "spark.sql.catalogImplementation": "hive",
        "spark.hadoop.javax.jdo.option.ConnectionURL": metastore_url(path),
        "spark.sql.warehouse.dir": warehouse,
    }


def holder(path: Path | str) -> int | None:
    """The process that has the Derby database at ``path`` open, or ``None``.

    Reads the kernel's lock table (``/proc/locks``) for Derby's lock file rather than taking
    the lock, so asking never stops a process that opens the database at that moment.
    Returns ``-1`` when the lock table is not readable and the lock is held.

    Example:
        >>> holder("/nonexistent/_metastore/db") is None
        True
    """
    lock = Path(path) / _LOCK_FILE
    try:
        inode = lock.stat().st_ino
    except OSError:
        return None
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return _held_by_lockf(lock)
    for line in table.splitlines():
        parts = line.split()
        # "1: POSIX  ADVISORY  WRITE 12345 fd:01:67890 0 EOF"
        if len(parts) >= 6 and parts[1] == "POSIX" and parts[5].rsplit(":", 1)[-1] == str(inode):
            pid = int(parts[4])
            return pid if pid != os.getpid() else None
    return None


def _held_by_lockf(lock: Path) -> int | None:
    import fcntl

    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return -1
    finally:
        os.close(fd)  # closing releases a lock taken here
    return None


def catalog_conf(cfg: EngineConfig) -> dict[str, str]:
    """The catalog settings for a new Spark application on ``cfg``'s lakehouse.

    ``embedded``: the lakehouse's metastore, unless another process has it open (then the
    session's memory, logged once). ``memory``: the session's memory. ``spark``: nothing (the
    catalog Spark is configured with).
    """
    warehouse = f"{cfg.lakehouse_path}/_warehouse"
    if cfg.sql_catalog == "spark":
        return {}
    if cfg.sql_catalog == "embedded":
        path = metastore_path(cfg)
        pid = holder(path)
        if pid is None:
            return hive_conf(path, warehouse)
        who = f"process {pid}" if pid > 0 else "another process"
        log.warning(
            "the lakehouse's metastore (%s) is open in %s, a running engine or session: this"
            " session names tables in its own memory (SQL tools: the engine's SQL endpoint,"
            " sql.server.enabled)",
            path,
            who,
        )
    return {"spark.sql.catalogImplementation": "in-memory", "spark.sql.warehouse.dir": warehouse}
