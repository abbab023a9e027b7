"""Start, stop and check a local single-node Kafka broker (KRaft), for local runs and tests.

One JVM is both broker and controller (``process.roles=broker,controller``), runs the jars
that ``make kafka-jars`` resolves from Maven Central (``build/kafka/pom.xml``: no Kafka
tarball), listens on 127.0.0.1 only and gets a small heap, since Spark shares the machine.
Everything lives under one *home* folder (``.kafka/`` by default, git-ignored):

    lib/*.jar            the broker and its dependencies (``make kafka-jars``)
    server.properties    the broker's configuration, written on every launch
    log4j2.properties    its logging: INFO lines to stdout, so into ``broker.log``
    broker.log           the JVM's stdout and stderr (the run before in ``broker.log.1``)
    broker.pid           the JVM's pid, which is also the id of its own process group
    data/                ``log.dirs``: topics and the KRaft metadata log, formatted once

:func:`start` returns once the broker answers a Metadata request with its own cluster id
and lists itself as a live broker: from then on topics are created, produced to and
consumed from at once. The broker outlives the Python process that started it, until
:func:`stop` (or ``python -m jobs.tools.broker down``).

Example:
    >>> broker = start(Path(".kafka"))  # doctest: +SKIP
    >>> broker.bootstrap_servers  # doctest: +SKIP
    '127.0.0.1:9092'
    >>> stop(Path(".kafka"))  # doctest: +SKIP
    True

From the shell::

    python -m jobs.tools.broker up [--home .kafka] [--port 9092]
    python -m jobs.tools.broker status [--home .kafka]
    python -m jobs.tools.broker down [--home .kafka]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from engine.core.errors import SetupError

HOST = "127.0.0.1"
DEFAULT_HOME = Path(".kafka")
DEFAULT_PORT = 9092
DEFAULT_CONTROLLER_PORT = 9093
NODE_ID = 1

#: The broker's JVM: a small heap (Spark shares a 2-core machine), Kafka's own G1 settings,
#: no remote JMX (nothing opens a JMX port unless asked), IPv4 only. C1 only
#: (``TieredStopAtLevel=1``): on two busy cores the C2 compiler's threads made the start
#: about 2 s longer (5.8 s against 3.5 s with Spark running beside it); a local broker's
#: throughput does not need C2's code.
JVM_OPTIONS: tuple[str, ...] = (
    "-Xms256m",
    "-Xmx512m",
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
    "-Djava.net.preferIPv4Stack=true",
)
#: The one-off ``StorageTool format`` run needs less.
FORMAT_JVM_OPTIONS: tuple[str, ...] = (
    "-Xms64m",
    "-Xmx256m",
    "-XX:TieredStopAtLevel=1",
    "-Djava.awt.headless=true",
)

LOG_TAIL_LINES = 20
#: Exceptions the broker logs at ERROR on a healthy start (a request that reached the
#: controller before it won its election): never the cause of a failure.
_BENIGN_ERRORS = ("NotControllerException",)
_PROBE_TIMEOUT = 2.0
_POLL_INTERVAL = 0.1

#: Brokers started by this process, kept so that they are reaped (no zombie, no
#: ResourceWarning) and so that :func:`stop` can wait on them directly.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}

_LOG4J2 = """\
# Written by jobs/tools/broker.py on every launch: the broker logs to stdout, i.e. broker.log.
status = warn
appender.stdout.type = Console
appender.stdout.name = STDOUT
appender.stdout.layout.type = PatternLayout
appender.stdout.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
# Every internal client dumps its whole configuration (hundreds of lines) at INFO.
logger.config.name = org.apache.kafka.common.config.AbstractConfig
logger.config.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


class BrokerError(SetupError):
    """Raised when the broker cannot be started, or is not set up (Java, jars)."""


@dataclass(frozen=True)
class Broker:
    """A running broker.

    Attributes:
        home: the folder it runs from (as given to :func:`start`).
        port: its client port, on 127.0.0.1.
        controller_port: its KRaft controller port, on 127.0.0.1.
        pid: the JVM's process id (and process group id).
        cluster_id: the cluster id its storage was formatted with.
        started_in: seconds :func:`start` took, format included; ``None`` when the broker
            was already running.
    """

    home: Path
    port: int
    controller_port: int
    pid: int
    cluster_id: str
    started_in: float | None = None

    @property
    def bootstrap_servers(self) -> str:
        """``host:port`` for Kafka clients and Spark's ``kafka.bootstrap.servers``."""
        return f"{HOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        """The broker's log: the JVM's stdout and stderr."""
        return self.home / "broker.log"


def start(
    home: Path,
    port: int = DEFAULT_PORT,
    controller_port: int = DEFAULT_CONTROLLER_PORT,
    timeout: float = 60,
    *,
    lib: Path | None = None,
) -> Broker:
    """Start a broker from ``home``, or return the one already running from it.

    The first start formats ``home/data`` with a new random cluster id; later starts reuse
    it, so topics and committed offsets survive a restart. The ports may change between
    starts.

    Args:
        home: the broker's folder (created if missing).
        port: the client port on 127.0.0.1.
        controller_port: the KRaft controller port on 127.0.0.1.
        timeout: seconds to wait for the broker to be ready.
        lib: the folder of the broker's jars; ``home/lib`` by default.

    Returns:
        The running broker; its ``started_in`` is ``None`` if it was running already.

    Raises:
        BrokerError: Java or the jars are missing; a broker from ``home`` runs on other
            ports or does not answer; the broker exited or was not ready within
            ``timeout`` (the message names the first error in its log, then shows the
            log's last lines).
    """
    began = time.monotonic()
    home.mkdir(parents=True, exist_ok=True)
    with _locked(home):
        running = _running(home, timeout)
        if running is not None:
            if (running.port, running.controller_port) != (port, controller_port):
                raise BrokerError(
                    f"a kafka broker from {home} already runs on ports {running.port} and "
                    f"{running.controller_port} (pid {running.pid}), not {port} and "
                    f"{controller_port}: stop it first (python -m jobs.tools.broker down)"
                )
            return running
        java = _java()
        jars = _classpath(home / "lib" if lib is None else lib)
        root = home.resolve()
        (root / "server.properties").write_text(_server_properties(root, port, controller_port))
        (root / "log4j2.properties").write_text(_LOG4J2)
        log = root / "broker.log"
        if log.exists():
            log.replace(root / "broker.log.1")
        cluster_id = _cluster_id_of(root) or _format(java, jars, root)
        proc = _launch(java, jars, root)
        _pid_path(root).write_text(f"{proc.pid}\n")
        broker = Broker(home, port, controller_port, proc.pid, cluster_id)
        while True:
            if proc.poll() is not None:
                _forget(root, proc.pid)
                raise BrokerError(
                    f"kafka broker exited with code {proc.returncode} while starting"
                    + _log_tail(broker.log_path)
                )
            if _answers(port, cluster_id):
                return Broker(
                    home, port, controller_port, proc.pid, cluster_id, time.monotonic() - began
                )
            if time.monotonic() - began > timeout:
                _terminate(proc.pid, 10)
                _forget(root, proc.pid)
                raise BrokerError(
                    f"kafka broker not ready on {HOST}:{port} after {timeout:g} s, stopped it"
                    + _log_tail(broker.log_path)
                )
            time.sleep(_POLL_INTERVAL)


def stop(home: Path, timeout: float = 30) -> bool:
    """Stop the broker running from ``home``, if any.

    Sends SIGTERM to the broker's process group (a controlled shutdown, about 2 s), waits up
    to ``timeout`` seconds, then sends SIGKILL. The pid file is removed either way.

    Args:
        home: the broker's folder.
        timeout: seconds to wait after SIGTERM before SIGKILL.

    Returns:
        True if a broker was running and is now stopped, False if none was running.
    """
    if not home.is_dir():
        return False
    with _locked(home):
        pid = _read_pid(home)
        if pid is None:
            _pid_path(home).unlink(missing_ok=True)  # unreadable: no broker can be found
            return False
        stopped = _is_broker(pid, home)
        if stopped:
            _terminate(pid, timeout)
        _forget(home, pid)
        return stopped


def status(home: Path) -> Broker | None:
    """The broker running from ``home``, if it is up and answering; never starts one.

    Args:
        home: the broker's folder.

    Returns:
        The broker (``started_in`` is ``None``), or ``None`` if none answers.
    """
    if not home.is_dir():
        return None
    pid = _read_pid(home)
    ports = _ports_of(home)
    cluster_id = _cluster_id_of(home)
    if pid is None or ports is None or cluster_id is None or not _is_broker(pid, home):
        return None
    if not _answers(ports[0], cluster_id):
        return None
    return Broker(home, ports[0], ports[1], pid, cluster_id)


# --- the broker's files --------------------------------------------------------------------


def _server_properties(root: Path, port: int, controller_port: int) -> str:
    """The broker's configuration: one node, broker and controller, loopback only."""
    return f"""\
# Written by jobs/tools/broker.py on every launch: edits are lost.
process.roles=broker,controller
node.id={NODE_ID}
controller.quorum.bootstrap.servers={HOST}:{controller_port}
listeners=PLAINTEXT://{HOST}:{port},CONTROLLER://{HOST}:{controller_port}
advertised.listeners=PLAINTEXT://{HOST}:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={root / "data"}
# One broker: every internal topic has one replica.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
default.replication.factor=1
min.insync.replicas=1
num.partitions=1
auto.create.topics.enable=true
group.initial.rebalance.delay.ms=0
# After an unclean stop (SIGKILL, crash) the new broker cannot register until the old one's
# session expires: 4 s instead of 9 s.
broker.heartbeat.interval.ms=1000
broker.session.timeout.ms=4000
# Few threads: two cores are shared with Spark.
num.network.threads=2
num.io.threads=2
num.recovery.threads.per.data.dir=1
background.threads=2
log.cleaner.threads=1
"""


def _pid_path(home: Path) -> Path:
    return home / "broker.pid"


def _read_pid(home: Path) -> int | None:
    """The pid in ``home/broker.pid``, or ``None`` if there is none (or it is garbage)."""
    try:
        return int(_pid_path(home).read_text().strip())
    except (OSError, ValueError):
        return None


def _ports_of(home: Path) -> tuple[int, int] | None:
    """The client and controller ports in ``home/server.properties``, if readable."""
    try:
        text = (home / "server.properties").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("listeners="):
            ports = dict(
                (name, int(address.rsplit(":", 1)[1]))
                for name, _, address in (
                    item.partition("://") for item in line.split("=", 1)[1].split(",")
                )
            )
            if "PLAINTEXT" in ports and "CONTROLLER" in ports:
                return ports["PLAINTEXT"], ports["CONTROLLER"]
    return None


def _cluster_id_of(home: Path) -> str | None:
    """The cluster id ``home/data`` was formatted with, or ``None`` if it is not formatted."""
    try:
        text = (home / "data" / "meta.properties").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "cluster.id":
            return value.strip()
    return None


def _log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The broker log's first error and last ``lines`` lines, set out for an error message."""
    first_error = ""
    in_error = False  # the line before was the first error: its exception may follow
    tail: deque[str] = deque(maxlen=lines)
    try:
        with log.open(errors="replace") as handle:
            for line in handle:
                if in_error and line.strip() and not line[:1].isspace() and line[0] != "[":
                    if any(benign in line for benign in _BENIGN_ERRORS):
                        first_error = ""
                    else:
                        first_error += f": {line.strip()}"
                in_error = not first_error and _is_error(line)
                if in_error:
                    first_error = line.strip()
                tail.append(line)
    except OSError:
        return f" (no log at {log})"
    cause = f": {first_error}" if first_error else ""
    shown = "".join(tail).rstrip() or "(empty)"
    return f"{cause}\nlast {lines} lines of {log}:\n{shown}"


def _is_error(line: str) -> bool:
    """Whether a log line is an error of the broker's logger or of the JVM itself."""
    return (
        "] ERROR " in line
        or "] FATAL " in line
        or line.startswith(("Error", "Exception in thread"))
    )


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``home`` so that two starts cannot race."""
    with (home / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- the JVM -------------------------------------------------------------------------------


def _java() -> str:
    """The ``java`` to run: ``$JAVA_HOME/bin/java`` if set, else the one on ``PATH``."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise BrokerError(
            "java not found: install a JDK 17 (apt-get install openjdk-17-jdk-headless)"
        )
    return found


def _classpath(lib: Path) -> str:
    """The class path for the jars in ``lib``; fails if there are none."""
    if not any(lib.glob("*.jar")):
        raise BrokerError(f"no Kafka jars in {lib}: run `make kafka-jars`")
    return f"{lib.resolve()}/*"


def _new_cluster_id() -> str:
    """A random cluster id as Kafka makes them: 16 random bytes in URL-safe base64."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):  # Kafka's own Uuid.randomUuid() avoids these too
            return text


def _format(java: str, jars: str, root: Path) -> str:
    """Format ``root/data`` for a new one-node cluster; returns its cluster id.

    Raises:
        BrokerError: the storage tool failed (its output is in the broker log).
    """
    cluster_id = _new_cluster_id()
    command = [
        java,
        *FORMAT_JVM_OPTIONS,
        f"-Dlog4j2.configurationFile={root / 'log4j2.properties'}",
        "-cp",
        jars,
        "kafka.tools.StorageTool",
        "format",
        "--standalone",
        "-t",
        cluster_id,
        "-c",
        str(root / "server.properties"),
    ]
    log = root / "broker.log"
    with log.open("ab") as out:
        done = subprocess.run(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=root
        )
    if done.returncode != 0:
        raise BrokerError(
            f"formatting {root / 'data'} failed with code {done.returncode}" + _log_tail(log)
        )
    return cluster_id


def _launch(java: str, jars: str, root: Path) -> subprocess.Popen[bytes]:
    """Launch the broker's JVM detached: its own session and process group."""
    command = [
        java,
        *JVM_OPTIONS,
        f"-Dlog4j2.configurationFile={root / 'log4j2.properties'}",
        "-cp",
        jars,
        "kafka.Kafka",
        str(root / "server.properties"),
    ]
    with (root / "broker.log").open("ab") as out:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=root,
            start_new_session=True,
        )
    _CHILDREN[proc.pid] = proc
    return proc


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (reaping it if it is our child)."""
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): the signal test has to do
    return stat.rpartition(")")[2].split()[0] != "Z"


def _is_broker(pid: int, home: Path) -> bool:
    """Whether ``pid`` is alive and is the broker of ``home`` (not a reused pid)."""
    if not _alive(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc (macOS): trust the pid file
    props = str(home.resolve() / "server.properties").encode()
    return b"kafka.Kafka" in argv and props in argv


def _terminate(pid: int, timeout: float) -> None:
    """SIGTERM the broker's process group, then SIGKILL after ``timeout`` seconds."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(_POLL_INTERVAL)


def _forget(home: Path, pid: int) -> None:
    """Drop the pid file and our handle on process ``pid``."""
    _pid_path(home).unlink(missing_ok=True)
    child = _CHILDREN.pop(pid, None)
    if child is not None and child.poll() is None:
        _CHILDREN[pid] = child  # still running (SIGKILL ignored?): keep it to reap later


def _running(home: Path, timeout: float) -> Broker | None:
    """The broker already running from ``home``, waiting for it if it is still starting.

    Raises:
        BrokerError: its process is alive but does not answer within ``timeout``.
    """
    pid = _read_pid(home)
    if pid is None:
        return None
    if not _is_broker(pid, home):
        _forget(home, pid)  # a stale pid file
        return None
    ports = _ports_of(home)
    cluster_id = _cluster_id_of(home)
    if ports is not None and cluster_id is not None:
        deadline = time.monotonic() + timeout
        while _is_broker(pid, home):
            if _answers(ports[0], cluster_id):
                return Broker(home, ports[0], ports[1], pid, cluster_id)
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL_INTERVAL)
        else:
            _forget(home, pid)  # it exited while we waited: start afresh
            return None
    raise BrokerError(
        f"kafka broker pid {pid} from {home} is running but does not answer: "
        "stop it (python -m jobs.tools.broker down)" + _log_tail(home / "broker.log")
    )


# --- the readiness probe: one Metadata request ---------------------------------------------


class _Metadata(NamedTuple):
    cluster_id: str | None
    brokers: tuple[tuple[int, str, int], ...]  # (node id, host, port) of each live broker


class _Reader:
    """Reads the big-endian fields of a Kafka response."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def int16(self) -> int:
        (value,) = struct.unpack_from(">h", self.data, self.pos)
        self.pos += 2
        return int(value)

    def int32(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return int(value)

    def string(self) -> str | None:
        size = self.int16()
        if size < 0:
            return None
        raw = self.data[self.pos : self.pos + size]
        if len(raw) != size:
            raise ValueError("truncated string")
        self.pos += size
        return raw.decode()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("connection closed mid-response")
        chunks += chunk
    return bytes(chunks)


def _metadata(port: int, timeout: float = _PROBE_TIMEOUT) -> _Metadata | None:
    """Ask whatever listens on ``127.0.0.1:port`` for Kafka metadata (Metadata v4).

    v4 is the oldest version Kafka 4 still answers (KIP-896) and its encoding is the plain,
    non-flexible one. The request names no topic, so nothing is created and the answer is
    small. A broker answers only once it serves clients: after it is registered and unfenced.

    Returns:
        The cluster id and live brokers, or ``None`` if nothing answered like a Kafka broker.
    """
    client_id = b"jobs.tools.broker"
    correlation_id = 7
    request = struct.pack(">hhih", 3, 4, correlation_id, len(client_id)) + client_id
    request += struct.pack(">ib", 0, 0)  # topics: none; allow_auto_topic_creation: false
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.sendall(struct.pack(">i", len(request)) + request)
            (size,) = struct.unpack(">i", _recv_exactly(sock, 4))
            if not 8 <= size <= 1 << 20:
                return None
            reader = _Reader(_recv_exactly(sock, size))
        if reader.int32() != correlation_id:
            return None
        reader.int32()  # throttle_time_ms
        brokers = []
        for _ in range(reader.int32()):
            node_id, host, broker_port = reader.int32(), reader.string(), reader.int32()
            reader.string()  # rack
            brokers.append((node_id, host or "", broker_port))
        return _Metadata(reader.string(), tuple(brokers))
    except (OSError, struct.error, ValueError):
        return None


def _answers(port: int, cluster_id: str) -> bool:
    """Whether the broker of ``cluster_id`` serves clients on ``127.0.0.1:port``."""
    found = _metadata(port)
    return (
        found is not None
        and found.cluster_id == cluster_id
        and any(broker_port == port for _, _, broker_port in found.brokers)
    )


# --- command line --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--home",
        type=Path,
        default=DEFAULT_HOME,
        help="the broker's folder: jars in HOME/lib, data, log and pid (default: .kafka)",
    )
    parser = argparse.ArgumentParser(
        prog="python -m jobs.tools.broker",
        description="A local single-node Kafka broker (KRaft) on 127.0.0.1.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", parents=[common], help="start the broker (if not running)")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="client port (9092)")
    up.add_argument(
        "--controller-port",
        type=int,
        default=DEFAULT_CONTROLLER_PORT,
        help="KRaft controller port (9093)",
    )
    up.add_argument("--timeout", type=float, default=60, help="seconds to wait (60)")
    up.add_argument("--lib", type=Path, default=None, help="the jars' folder (HOME/lib)")
    down = commands.add_parser("down", parents=[common], help="stop the broker")
    down.add_argument("--timeout", type=float, default=30, help="seconds before SIGKILL (30)")
    commands.add_parser(
        "status", parents=[common], help="tell whether the broker is up (exit code 1 if not)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m jobs.tools.broker``; returns the process exit code.

    Args:
        argv: the arguments, without the program name; ``sys.argv[1:]`` by default.

    Returns:
        0 on success; 1 if ``status`` finds no broker; 2 if ``up`` failed.
    """
    args = _parser().parse_args(argv)
    home: Path = args.home
    if args.command == "up":
        try:
            broker = start(home, args.port, args.controller_port, args.timeout, lib=args.lib)
        except BrokerError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if broker.started_in is None:
            print(
                f"kafka broker already up at {broker.bootstrap_servers} "
                f"(pid {broker.pid}, log: {broker.log_path})"
            )
        else:
            print(
                f"kafka broker up at {broker.bootstrap_servers} in {broker.started_in:.1f} s "
                f"(pid {broker.pid}, log: {broker.log_path})"
            )
        return 0
    if args.command == "down":
        if stop(home, args.timeout):
            print(f"kafka broker stopped (home: {home})")
        else:
            print(f"no kafka broker running from {home}")
        return 0
    found = status(home)
    if found is None:
        print(f"kafka broker down (home: {home})")
        return 1
    print(
        f"kafka broker up at {found.bootstrap_servers} "
        f"(pid {found.pid}, cluster {found.cluster_id}, log: {found.log_path})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
