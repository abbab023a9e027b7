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
import tempfile
import time
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
        # Hive makes an (empty) folder per session for downloaded resources: in one folder of
        # delayq's, emptied by later sessions, not scattered over the temp folder.
        "spark.hadoop.hive.downloaded.resources.dir": (
            f"{HIVE_RESOURCES}/${{hive.session.id}}_resources"
        ),
    }


#: Where Hive's per-session resource folders go (see :func:`tidy_resources`).
HIVE_RESOURCES = Path(tempfile.gettempdir()) / "delayq-hive"


def tidy_resources(older_than_s: float = 3600.0) -> int:
    """Remove Hive's empty per-session folders older than ``older_than_s``; how many.

    Example:
        >>> tidy_resources() >= 0
        True
    """
    removed = 0
    cutoff = time.time() - older_than_s
    try:
        entries = list(HIVE_RESOURCES.iterdir())
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.name.endswith("_resources") and entry.stat().st_mtime < cutoff:
                entry.rmdir()  # only when empty
                removed += 1
        except OSError:
            continue
    return removed


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
    found = _locked(lock, "POSIX")
    return _held_by_lockf(lock) if found == -1 else found


def claimant(folder: Path | str) -> int | None:
    """The delayq process that has claimed the metastore in ``folder`` (its ``flock`` on
    ``owner.lock``, taken when its session starts, before Derby opens anything), or
    ``None``; ``-1`` when the lock table is not readable.

    Example:
        >>> claimant("/nonexistent/_metastore") is None
        True
    """
    return _locked(Path(folder) / _OWNER_FILE, "FLOCK")


def _locked(file: Path, kind: str) -> int | None:
    """The process holding a ``kind`` lock (``POSIX`` or ``FLOCK``) on ``file``, from the
    kernel's lock table (``/proc/locks``); ``None`` if none, ``-1`` if the table is not
    readable and the file exists."""
    try:
        stat = file.stat()
    except OSError:
        return None
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return -1
    wanted = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    for line in table.splitlines():
        parts = line.split()
        # "1: POSIX  ADVISORY  WRITE 12345 fd:01:67890 0 EOF" (device in hex, inode)
        if len(parts) >= 6 and parts[1] == kind and parts[5] == wanted:
            return int(parts[4])
    return None


def _held_by_lockf(lock: Path) -> int | None:
    import fcntl

    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return -1
    finally:
        os.close(fd)  # closing releases a lock taken here
    return None


#: The flock this process holds on each metastore it uses (kept for the process's life).
_OWNED: dict[Path, int] = {}
_OWNER_FILE = "owner.lock"


def _claim(folder: Path) -> bool:
    """Take (or keep) this process's claim on the metastore in ``folder``: a non-blocking
    ``flock`` on ``owner.lock``, held until the process ends. Decided when a session starts,
    where Derby's own lock is only taken at the first catalog use: two delayq processes
    starting together cannot both choose the metastore."""
    if folder in _OWNED:
        return True
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / _OWNER_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _OWNED[folder] = fd
    return True


def _our_jvms() -> set[int]:
    """The JVM this Python drives: its parent under spark-submit, else the child PySpark
    launched (if one runs)."""
    pids = {os.getppid()}
    try:
        from pyspark import SparkContext

        gateway = SparkContext._gateway
        proc = getattr(gateway, "proc", None)
        if proc is not None:
            pids.add(int(proc.pid))
    except Exception:  # no PySpark gateway yet
        pass
    return pids


def _release(folder: Path) -> None:
    fd = _OWNED.pop(folder, None)
    if fd is not None:
        os.close(fd)  # closing releases the flock


def catalog_conf(cfg: EngineConfig) -> dict[str, str]:
    """The catalog settings for a new Spark application on ``cfg``'s lakehouse.

    ``embedded``: the lakehouse's metastore, unless another process uses it (a delayq process
    that claimed it, or any Spark that has Derby's database open): then the session's memory,
    said once. ``memory``: the session's memory. ``spark``: nothing (the catalog Spark is
    configured with).
    """
    warehouse = f"{cfg.lakehouse_path}/_warehouse"
    if cfg.sql_catalog == "spark":
        return {}
    if cfg.sql_catalog == "embedded":
        path = metastore_path(cfg)
        folder = path.parent
        try:
            claimed = _claim(folder)
        except OSError as err:  # a read-only lakehouse: names in memory, as before
            log.warning("the lakehouse's metastore (%s) cannot be used: %s", folder, err)
            claimed = False
            pid: int | None = None
        else:
            pid = holder(path)
            if pid in _our_jvms():
                pid = None  # this process's own Spark (a session stopped and built again)
        if claimed and pid is None:
            return hive_conf(path, warehouse)
        if claimed:
            _release(folder)
        if pid is not None or not claimed:
            who = f"process {pid}" if pid and pid > 0 else "another process"
            log.warning(
                "the lakehouse's metastore (%s) is in use by %s, a running engine or session:"
                " this session names tables in its own memory (SQL tools: the engine's SQL"
                " endpoint, sql.server.enabled)",
                folder,
                who,
            )
    return {"spark.sql.catalogImplementation": "in-memory", "spark.sql.warehouse.dir": warehouse}
