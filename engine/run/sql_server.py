"""SQL from any tool while the engine runs: JDBC/ODBC and Spark Connect from the engine's Spark.

With ``sql.server.enabled`` the engine's own Spark application serves

* **JDBC** through Spark's Thrift server (HiveServer2's protocol):
  ``beeline -u jdbc:hive2://127.0.0.1:10000 -e "SELECT * FROM delayq.orders"``, or any BI
  tool with a Hive/Spark JDBC or ODBC driver;
* **Spark Connect**: ``pyspark --remote sc://127.0.0.1:15002``, or
  ``SparkSession.builder.remote("sc://127.0.0.1:15002")`` in a plain Python with
  ``pyspark[connect]``.

Each client gets a session of its own on the engine's catalog: every delayq table and view
by name, including topics created later, with no metastore of its own (the embedded
metastore opens in one process at a time, and the engine has it). Queries share the
engine's cores: a heavy query slows deliveries. Addresses are written to
``<lakehouse>/_engine/sql.json`` while the server runs (``delayq status`` shows them).

Example:
    >>> server = SqlServer(spark, cfg).start()  # doctest: +SKIP
    >>> server.jdbc_url  # doctest: +SKIP
    'jdbc:hive2://127.0.0.1:10000'
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from pyspark.sql import SparkSession

from engine.core.config import EngineConfig
from engine.core.errors import ConfigError, SetupError
from engine.core.processes import alive
from engine.lakehouse.storage.fs import delete_file, jvm, read_text, write_text
from engine.lakehouse.storage.layout import layout

#: Written while the server runs, removed when it stops: where SQL clients connect.
ADDRESS_FILE = "sql.json"


def address_file(cfg: EngineConfig) -> str:
    """``<lakehouse>/_engine/sql.json``.

    Example:
        >>> address_file(EngineConfig(lakehouse="/lake"))
        '/lake/_engine/sql.json'
    """
    return layout(cfg).engine_file(ADDRESS_FILE)


def read_addresses(cfg: EngineConfig) -> dict[str, Any] | None:
    """The running SQL server's addresses (``jdbc``, ``connect``, ``pid``), or ``None``
    (none written, or its process has ended).

    Example:
        >>> read_addresses(cfg)  # doctest: +SKIP
        {'jdbc': 'jdbc:hive2://127.0.0.1:10000', 'connect': 'sc://127.0.0.1:15002', 'pid': 4242}
    """
    try:
        found = json.loads(read_text(address_file(cfg)) or "")
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or not alive(found.get("pid")):
        return None  # left by an engine that was killed
    return found


_THRIFT_PORT = "hive.server2.thrift.port"


def _in_new_thread(start: Callable[[], Any]) -> Any:
    """``start()`` on a new thread (a new JVM thread through Py4J): Hive keeps a session per
    thread, and the Thrift server would take the settings of one already on this thread
    (the metastore's: port 10000 on every interface) instead of the ones given."""
    result: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(start())
        except BaseException as err:  # handed to the caller below
            failure.append(err)

    thread = threading.Thread(target=run, name="delayq-sql-start", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def _port(host: str, port: int, key: str) -> int:
    """``port`` if it can be listened on (0: a free one), else a ConfigError naming ``key``
    (or ``sql.server.host`` when the address is not this machine's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            if isinstance(err, socket.gaierror) or err.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    "sql.server.host", host, f"not an address of this machine ({err})"
                ) from None
            raise ConfigError(
                key,
                f"{host}:{port}",
                f"cannot listen there ({err.strerror or err}): choose another port "
                "(0: any free one) or set sql.server.enabled=false",
            ) from None
        return int(probe.getsockname()[1])


def _check_environment() -> None:
    """Hive's Thrift server takes its address from these variables over any setting."""
    for name in ("HIVE_SERVER2_THRIFT_BIND_HOST", "HIVE_SERVER2_THRIFT_PORT"):
        if os.environ.get(name):
            raise SetupError(
                f"{name} is set ({os.environ[name]}): it would override sql.server.host and "
                "sql.server.jdbc_port; unset it"
            )


class SqlServer:
    """The Thrift (JDBC) server and Spark Connect, in this Spark application.

    Nothing is opened until :meth:`start`; :meth:`stop` closes both.

    Args:
        spark: the engine's session (clients get new sessions of it).
        cfg: ``sql.server.host``, ``sql.server.jdbc_port``, ``sql.server.connect_port``.
    """

    def __init__(self, spark: SparkSession, cfg: EngineConfig) -> None:
        self.spark = spark
        self.cfg = cfg
        self.jdbc_url = ""
        self.connect_url = ""
        self._thrift: Any = None
        self._connect = False

    def start(self) -> SqlServer:
        """Listen on both ports and write ``sql.json``; returns ``self``.

        Raises:
            ConfigError: a port cannot be listened on, or the host is not this machine's.
            SetupError: a ``HIVE_SERVER2_THRIFT_*`` variable would override the settings.
        """
        _check_environment()
        host = self.cfg.sql_server_host
        jdbc = _port(host, self.cfg.sql_jdbc_port, "sql.server.jdbc_port")
        connect = _port(host, self.cfg.sql_connect_port, "sql.server.connect_port")
        if jdbc == connect:  # two "any free port" probes can return the same one
            connect = _port(host, 0, "sql.server.connect_port")
        view = jvm(self.spark)
        session = self.spark.newSession()  # the server's settings stay out of the engine's
        session.conf.set("hive.server2.thrift.bind.host", host)
        session.conf.set(_THRIFT_PORT, str(jdbc))
        thriftserver = view.org.apache.spark.sql.hive.thriftserver
        try:
            # exitOnError=False: a serving error must not end the engine's process
            self._thrift = _in_new_thread(
                lambda: thriftserver.HiveThriftServer2.startWithSparkSession(
                    session._jsparkSession, False
                )
            )
        except Exception as err:
            raise ConfigError(
                "sql.server.jdbc_port",
                f"{host}:{jdbc}",
                f"the Thrift server did not start: {_first_line(err)}",
            ) from None
        self.jdbc_url = f"jdbc:hive2://{host}:{jdbc}"
        try:
            listening = self._thrift.getHiveConf()
            bound = (listening.get("hive.server2.thrift.bind.host"), listening.get(_THRIFT_PORT))
            if bound != (host, str(jdbc)):
                raise SetupError(f"Spark's Thrift server ignored {host}:{jdbc}: not serving JDBC")
            context = self.spark.sparkContext._jsc.sc()
            context.conf().set("spark.connect.grpc.binding.address", host)
            context.conf().set("spark.connect.grpc.binding.port", str(connect))
            try:
                view.org.apache.spark.sql.connect.service.SparkConnectService.start(context)
            except Exception as err:
                raise ConfigError(
                    "sql.server.connect_port",
                    f"{host}:{connect}",
                    f"Spark Connect did not start: {_first_line(err)}",
                ) from None
            self._connect = True
        except BaseException:
            self.stop()
            raise
        self.connect_url = f"sc://{host}:{connect}"
        record = {"jdbc": self.jdbc_url, "connect": self.connect_url, "pid": os.getpid()}
        write_text(address_file(self.cfg), json.dumps(record))  # seen whole or not at all
        return self

    def stop(self) -> None:
        """Close both servers and remove ``sql.json`` (safe to call twice); a failure to
        stop one still stops the other."""
        delete_file(address_file(self.cfg))
        view = jvm(self.spark)
        try:
            if self._connect:
                self._connect = False
                empty = view.scala.Option.empty()
                view.org.apache.spark.sql.connect.service.SparkConnectService.stop(empty, empty)
        finally:
            if self._thrift is not None:
                thrift, self._thrift = self._thrift, None
                thrift.stop()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__
