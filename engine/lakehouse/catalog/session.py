"""Build a Delta-enabled Spark session for the engine, jobs, notebooks and tests.

Example:
    >>> from engine.core.config import load_config
    >>> spark = build_spark(load_config())            # doctest: +SKIP
    >>> spark.sql("SELECT * FROM delayq.orders").show()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from pyspark import SparkConf
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSourceStreamReader

from engine.core.config import DEFAULT_CONF, EngineConfig
from engine.core.errors import SetupError
from engine.lakehouse.catalog.metastore import catalog_conf, derby_log, tidy_resources
from engine.lakehouse.catalog.names import register_all
from engine.lakehouse.storage.fs import jvm
from engine.lakehouse.storage.layout import layout
from engine.lakehouse.storage.location import carried, s3a_conf, settings_for
from engine.lakehouse.storage.store import split_s3

REPO_ROOT = DEFAULT_CONF.parent.parent
LOG4J_CONF = REPO_ROOT / "conf" / "log4j2.properties"

#: The driver JVM's options every session needs (plus the class archive, when there is one).
DRIVER_JAVA_OPTIONS = f"-Duser.timezone=UTC -Dlog4j2.configurationFile={LOG4J_CONF.as_uri()}"
#: The class data archive `make jars` writes next to the jars (jobs/tools/class_archive.py):
#: the classes a delayq Spark loads, mapped at start instead of read from the jars and
#: verified again. One that is missing, or stale (other jars, another JDK), is not used.
CLASS_ARCHIVE = "classes.jsa"
#: Uses the archive, silently: the JVM says nothing when it cannot.
USE_ARCHIVE = "-XX:SharedArchiveFile={archive} -Xlog:cds=off -Xlog:cds+dynamic=off"

#: Settings every engine session needs, whatever the deployment.
log = logging.getLogger(__name__)

DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.extraJavaOptions": DRIVER_JAVA_OPTIONS,
    "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
    "spark.ui.showConsoleProgress": "false",
    # Plain log lines on the console; Spark 4 defaults to JSON.
    "spark.log.structuredLogging.enabled": "false",
    # Delta's commits on s3a:// with S3's conditional PUT, safe with several writers (as the
    # engine's own commits are); Delta's default there is safe with one driver only. The
    # class is built by `make jars` (build/jvm). Read when the Spark starts.
    "spark.delta.logStore.s3a.impl": "delayq.s3.ConditionalPutLogStore",
    # And on a local (or shared, mounted) disk with a hard link, as the engine's own: Delta's
    # default there renames over a commit another writer made after its check, losing it.
    "spark.delta.logStore.file.impl": "delayq.fs.LinkLogStore",
}


def jars_folder(cfg: EngineConfig) -> Path:
    """``cfg.jars_dir``, relative to the cwd, else to the repository."""
    folder = Path(cfg.jars_dir).expanduser()
    if not folder.is_absolute() and not folder.is_dir():
        folder = REPO_ROOT / cfg.jars_dir
    return folder


def driver_java_options(cfg: EngineConfig) -> str:
    """The driver JVM's options: UTC, delayq's log settings and, once ``make jars`` has
    written it, the class archive (a Spark starts about a quarter sooner).

    Example:
        >>> "-Duser.timezone=UTC" in driver_java_options(EngineConfig())
        True
    """
    archive = (jars_folder(cfg) / CLASS_ARCHIVE).resolve()
    if not archive.is_file() or any(c.isspace() for c in str(archive)):
        return DRIVER_JAVA_OPTIONS  # (Spark splits the options at spaces)
    return f"{DRIVER_JAVA_OPTIONS} {USE_ARCHIVE.format(archive=archive)}"


def jar_paths(cfg: EngineConfig) -> list[str]:
    """The jars in ``cfg.jars_dir`` (relative to the cwd, else to the repository).

    Raises:
        SetupError: when the folder is missing or empty, saying to run ``make jars``.
    """
    folder = jars_folder(cfg)
    jars = sorted(str(p.resolve()) for p in folder.glob("*.jar"))
    if not jars:
        raise SetupError(
            f"no JVM jars in {folder} (spark.jars_dir): run `make jars` to fetch Delta with Maven"
        )
    return jars


def require_java() -> None:
    """Fail with one clear line when no Java runtime can be found (Spark's launcher takes
    ``$JAVA_HOME/bin/java`` whenever JAVA_HOME is set, before the PATH's)."""
    home = os.environ.get("JAVA_HOME")
    if home and not _java_home_ok():
        raise SetupError(
            f"JAVA_HOME={home} holds no bin/java: point it at a JDK 17, or unset it to use "
            "the `java` on PATH"
        )
    if not shutil.which("java") and not _java_home_ok():
        raise SetupError(
            "Java not found: install a JDK 17 (e.g. `apt-get install openjdk-17-jdk-headless`)"
            " and put `java` on PATH or set JAVA_HOME"
        )


def _java_home_ok() -> bool:
    home = os.environ.get("JAVA_HOME")
    return home is not None and (Path(home) / "bin" / "java").exists()


_THREAD = threading.local()


@contextmanager
def separate_session(spark: SparkSession) -> Iterator[SparkSession]:
    """Within the block, :func:`build_spark` on this thread returns a new session of
    ``spark``'s (its own SQL settings, current database and temporary views; the same Spark,
    catalog and cache) and changes neither ``spark`` nor the log level: a command that a
    running engine carries out cannot change the engine's session.

    Example:
        >>> with separate_session(engine_spark):  # doctest: +SKIP
        ...     build_spark(cfg).sql("SET spark.sql.shuffle.partitions=64")
    """
    _THREAD.session = spark.newSession()
    try:
        yield _THREAD.session
    finally:
        _THREAD.session = None


def _separate(cfg: EngineConfig, extra_conf: dict[str, str] | None) -> SparkSession | None:
    session: SparkSession | None = getattr(_THREAD, "session", None)
    if session is None:
        return None
    for key, value in {**cfg.spark_conf, **(extra_conf or {})}.items():
        if session.conf.isModifiable(key):
            session.conf.set(key, value)
    if cfg.register_tables:
        register_all(session, cfg)
    return session


def build_spark(cfg: EngineConfig, extra_conf: dict[str, str] | None = None) -> SparkSession:
    """Return a Delta-enabled session, creating it if needed.

    Under ``spark-submit`` the master and jars come from the command line (see the job
    docstrings); otherwise the session runs on ``cfg.spark_master`` with the jars from
    ``cfg.jars_dir``. With ``cfg.register_tables`` the tables that exist are named in the
    session's catalog (:func:`engine.lakehouse.catalog.names.register_all`); nothing is created.

    Raises:
        SetupError: when Java or the jars are missing, or Delta cannot be loaded.
    """
    separate = _separate(cfg, extra_conf)
    if separate is not None:
        return separate
    require_java()
    active = SparkSession.getActiveSession()
    builder = SparkSession.builder.appName(cfg.app_name)
    if active is None:
        launched = SparkConf()  # under spark-submit this holds the command line's settings
        if not launched.contains("spark.master"):
            builder = builder.master(cfg.spark_master)
            if "PYSPARK_PYTHON" not in os.environ:
                # Python workers run this interpreter (the venv's), not whatever `python3`
                # is first on PATH: a plain shell without the venv active works too.
                builder = builder.config("spark.pyspark.python", sys.executable)
        if not launched.contains("spark.jars"):
            jars = jar_paths(cfg)
            builder = builder.config("spark.jars", ",".join(jars))
            if not launched.contains("spark.driver.extraClassPath"):
                # Also on the driver's own class path: threads Spark does not start itself
                # (the SQL endpoint's JDBC sessions) find Delta's catalog there.
                builder = builder.config("spark.driver.extraClassPath", ":".join(jars))
        master = launched.get("spark.master", cfg.spark_master)
        if master.startswith("local") and "SPARK_LOCAL_IP" not in os.environ:
            # The embedded default talks to itself only: keep the driver on loopback
            # (Spark would otherwise pick the machine's first non-loopback address).
            for key in ("spark.driver.bindAddress", "spark.driver.host"):
                if not launched.contains(key):
                    builder = builder.config(key, "127.0.0.1")
        for key, value in catalog_conf(cfg).items():
            builder = builder.config(key, value)
        found = split_s3(layout(cfg).root)  # (registers an S3 lakehouse's settings)
        if found is not None:
            for key, value in s3a_conf(found[0], settings_for(layout(cfg).root)).items():
                builder = builder.config(f"spark.hadoop.{key}", value)
    settings = {**DELTA_CONF, "spark.driver.extraJavaOptions": driver_java_options(cfg)}
    for key, value in {**settings, **cfg.spark_conf, **(extra_conf or {})}.items():
        builder = builder.config(key, value)
    spark = _keeping_sigint(builder.getOrCreate)
    if "PYSPARK_PYTHON" not in os.environ:
        # Python data sources (the stamping query's commitlog source) run the interpreter
        # their registration names, which PySpark takes from PYSPARK_PYTHON ("python3"
        # without it): this one, as for every other Python worker above.
        spark.sparkContext.pythonExec = sys.executable
    spark.sparkContext.setLogLevel(cfg.log_level.upper())
    if active is None and spark.conf.get("spark.sql.catalogImplementation") == "hive":
        _open_metastore(spark, cfg)
    _check_delta(spark)
    if cfg.register_tables:
        register_all(spark, cfg)  # a reader's session start: name what exists
    return spark


def _keeping_sigint(get_or_create: Callable[[], SparkSession]) -> SparkSession:
    """``get_or_create()``, keeping a SIGINT handler the caller installed.

    A new SparkContext installs its own SIGINT handler (cancel every job, raise
    KeyboardInterrupt wherever the main thread is, even inside a py4j call). A caller that
    handles Ctrl-C itself (``delayq run``'s clean stop) keeps its handler through the
    session's set-up that follows (the metastore, naming the tables); a plain session
    (a notebook, a REPL: Python's default handler) gets Spark's.
    """
    if threading.current_thread() is not threading.main_thread():
        return get_or_create()
    before = signal.getsignal(signal.SIGINT)
    spark = get_or_create()
    if callable(before) and before is not signal.default_int_handler:
        signal.signal(signal.SIGINT, before)
    return spark


#: Spark's setting of the checkpoint file manager, and delayq's put-if-absent one (build/jvm).
CHECKPOINT_MANAGER_KEY = "spark.sql.streaming.checkpointFileManagerClass"
LINK_CHECKPOINT_MANAGER = "delayq.fs.LinkCheckpointFileManager"


def link_checkpoints(spark: SparkSession) -> bool:
    """Have ``spark``'s streaming queries create their checkpoint entries on a local disk with
    a hard link (:data:`LINK_CHECKPOINT_MANAGER`: put-if-absent, about 4 ms an entry here
    where Spark's default takes about 50), when the class is on the JVM's class path; returns
    whether it is. The engine's stages call it before they start their queries.

    It holds for the session's other streaming queries too: their new entries on a local
    disk are created put-if-absent as Spark's own default does; any other scheme, and files
    Spark replaces, go through Spark's default manager.

    Example:
        >>> link_checkpoints(spark)  # doctest: +SKIP
        True
    """
    if spark.conf.get(CHECKPOINT_MANAGER_KEY, None) == LINK_CHECKPOINT_MANAGER:
        return True
    try:
        jvm(spark).java.lang.Class.forName(LINK_CHECKPOINT_MANAGER)
    except Exception:  # (not on the class path: Spark's default manager)
        log.info("%s is not on the class path: Spark's checkpoint manager", LINK_CHECKPOINT_MANAGER)
        return False
    spark.conf.set(CHECKPOINT_MANAGER_KEY, LINK_CHECKPOINT_MANAGER)
    return True


class QuietStreamReader(DataSourceStreamReader):
    """A Python streaming source's reader whose planning process ends without a word when
    Spark hangs up on it.

    Spark plans a Python source's batches in a Python process of its own and ends it by
    closing its connection when the query stops; PySpark's runner then tries to report the
    closed connection on that same connection and prints the failure, three tracebacks, to
    the console. :meth:`stop`, which the runner calls on its way out, ends the process
    quietly instead when (and only when) the runner's own read or write of the connection
    failed; any other failure (one raised in delayq's code) is reported to Spark as before.

    Example:
        >>> class ClockReader(QuietStreamReader): ...  # doctest: +SKIP
    """

    def stop(self) -> None:
        if hung_up(sys.exception()):
            os._exit(0)


_S = TypeVar("_S", bound=type)


def carrying_s3(source: _S, location: str) -> _S:
    """``source`` (a Python data source class with an ``s3`` class attribute), or a subclass
    of it carrying the S3 settings of ``location`` when it is in a bucket: Spark pickles the
    class to the processes that plan and read its batches, which know no settings of their own.

    Example:
        >>> class Source:
        ...     s3 = None
        >>> carrying_s3(Source, "/lake/commitlog") is Source
        True
    """
    settings = carried(location)
    if settings is None:
        return source
    return type(f"{source.__name__}S3", (source,), {"s3": settings})  # type: ignore[return-value]


_ENGINE_DIR = str(Path(__file__).resolve().parents[2])  # engine/


def hung_up(err: BaseException | None) -> bool:
    """Whether ``err`` is a closed connection met outside delayq's code (PySpark's runner
    reading or writing its socket).

    Example:
        >>> hung_up(EOFError())
        True
        >>> hung_up(ValueError("a bug"))
        False
    """
    if not isinstance(err, (EOFError, BrokenPipeError, ConnectionResetError)):
        return False
    frame = err.__traceback__
    while frame is not None:
        if os.path.realpath(frame.tb_frame.f_code.co_filename).startswith(_ENGINE_DIR):
            return False  # raised in (or through) delayq's code: Spark hears of it
        frame = frame.tb_next
    return True


def _open_metastore(spark: SparkSession, cfg: EngineConfig) -> None:
    """Open the session's metastore now, not at a table's first use mid-work: a failure is
    one line naming the metastore. Derby's log goes to ``_metastore/derby.log``, not to the
    current folder (read when Derby starts, which is here)."""
    tidy_resources()
    if cfg.sql_catalog == "embedded":
        log_file = derby_log(cfg)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        jvm(spark).java.lang.System.setProperty("derby.stream.error.file", str(log_file))
    try:
        spark.catalog.databaseExists("default")
    except Exception as err:  # py4j wraps Hive's and Derby's errors
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise SetupError(
            f"the SQL catalog's metastore could not be opened ({first}): another Spark (a "
            "spark-sql shell?) may have the lakehouse's metastore open; close it, or set "
            "sql.catalog=memory"
        ) from None


def _check_delta(spark: SparkSession) -> None:
    view = jvm(spark)
    try:
        view.java.lang.Class.forName(
            "io.delta.tables.DeltaTable", True, view.Thread.currentThread().getContextClassLoader()
        )
    except Exception as err:  # py4j wraps ClassNotFoundException
        raise SetupError(
            "Delta Lake classes are not on the driver's classpath. Under spark-submit pass "
            "`--properties-file .jars/spark-defaults.conf` (written by `make jars`)."
        ) from err
