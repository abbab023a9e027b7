"""Start, stop and check a local Spark standalone cluster: one master and two workers.

The daemons are the Spark the venv's ``pyspark`` ships (its ``spark-class`` launcher and its
jars: nothing downloaded), listen on 127.0.0.1, and keep everything under one *home* folder
(``.cluster/`` by default, git-ignored)::

    master.log, master.pid       the master's output, and its pid (its own process group)
    worker-1.log, worker-1.pid   each worker's, and its work folder worker-1/ (executors' logs)

:func:`start` returns once the master's status page lists every worker ``ALIVE``; it starts
only what is not running, so it also brings back a worker that died. Applications join with
``--master spark://127.0.0.1:7077`` (``delayq ... --set spark.master=...``, or
``spark-submit --master ...``).

Example:
    >>> cluster = start(Path(".cluster"))  # doctest: +SKIP
    >>> cluster.master_url  # doctest: +SKIP
    'spark://127.0.0.1:7077'
    >>> stop(Path(".cluster"))  # doctest: +SKIP
    True

From the shell::

    python -m jobs.tools.cluster up [--home .cluster] [--workers 2] [--cores 2] [--memory 4g]
    python -m jobs.tools.cluster status [--home .cluster]
    python -m jobs.tools.cluster down [--home .cluster]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.errors import SetupError
from engine.core.processes import alive

HOST = "127.0.0.1"
DEFAULT_HOME = Path(".cluster")
MASTER_PORT = 7077
MASTER_UI_PORT = 8080
WORKERS = 2
#: Cores and memory each worker offers. The machine has 2 cores: cores are a scheduling
#: budget (an engine, a producer and a consumer each take some), not a claim on CPUs.
WORKER_CORES = 2
WORKER_MEMORY = "4g"
#: The daemons' own heap (not the executors').
DAEMON_MEMORY = "512m"
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
_POLL_S = 0.25


#: Daemons started by this process, kept so that a dead one is reaped (a zombie would still
#: count as running).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _running(pid: int | None) -> bool:
    """Whether ``pid`` is a Spark daemon that runs (not a zombie, not a reused pid)."""
    child = _CHILDREN.get(pid or -1)
    if child is not None:
        return child.poll() is None
    if not alive(pid):
        return False
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"org.apache.spark.deploy." in command


class ClusterError(SetupError):
    """Raised when the cluster cannot be started (Java, the venv, a port in use)."""


@dataclass(frozen=True)
class Cluster:
    """A running cluster, as its master reports it.

    Attributes:
        home: the folder it runs from.
        master_url: what applications pass as ``--master``.
        ui_url: the master's web page (its JSON at ``<ui_url>/json/``).
        workers: each worker's ``id``, ``host``, ``port``, ``cores``, ``coresused``,
            ``memory`` (MB) and ``state``, as the master's JSON gives them.
        apps: the running applications' ``id``, ``name``, ``cores`` and ``state``.
        started_in: seconds :func:`start` took; ``None`` when all was running already.
    """

    home: Path
    master_url: str
    ui_url: str
    workers: tuple[dict[str, Any], ...]
    apps: tuple[dict[str, Any], ...]
    started_in: float | None = None

    @property
    def alive_workers(self) -> int:
        """Workers the master counts as alive."""
        return sum(w.get("state") == "ALIVE" for w in self.workers)


def spark_class() -> Path:
    """The venv's ``spark-class`` (pyspark's launcher of Spark's JVM classes)."""
    launcher = Path(sys.executable).parent / "spark-class"
    if not launcher.exists():
        raise ClusterError(f"{launcher} is missing: run `make setup` first")
    return launcher


def _pid(home: Path, name: str) -> int | None:
    try:
        return int((home / f"{name}.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _launch(home: Path, name: str, args: list[str]) -> int:
    """Start one daemon in its own process group, output to ``<name>.log``; its pid."""
    log = home / f"{name}.log"
    if log.exists():
        log.replace(home / f"{name}.log.1")
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": HOST,
        "SPARK_DAEMON_MEMORY": DAEMON_MEMORY,
        "SPARK_LOG_DIR": str(home),
        "PYSPARK_PYTHON": sys.executable,  # executors' Python workers: the venv's
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(spark_class()), *args], stdout=out, stderr=subprocess.STDOUT, env=env,
            cwd=home, start_new_session=True,
        )  # fmt: skip
    _CHILDREN[proc.pid] = proc
    (home / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc.pid


def read_state(home: Path = DEFAULT_HOME, ui_port: int = MASTER_UI_PORT) -> Cluster | None:
    """The cluster as its master reports it; ``None`` when no master answers."""
    ui_url = f"http://{HOST}:{ui_port}"
    try:
        with urllib.request.urlopen(f"{ui_url}/json/", timeout=2) as answer:
            state = json.load(answer)
    except (OSError, ValueError, urllib.error.URLError):
        return None
    return Cluster(
        home=home,
        master_url=state.get("url", ""),
        ui_url=ui_url,
        workers=tuple(w for w in state.get("workers", []) if w.get("state") != "DEAD"),
        apps=tuple(state.get("activeapps", [])),
    )


def start(
    home: Path = DEFAULT_HOME,
    workers: int = WORKERS,
    cores: int = WORKER_CORES,
    memory: str = WORKER_MEMORY,
    port: int = MASTER_PORT,
    ui_port: int = MASTER_UI_PORT,
    timeout: float = 120.0,
) -> Cluster:
    """Start the master and the workers that are not running; return once all are alive.

    Raises:
        ClusterError: a daemon exited, or the workers were not all alive in ``timeout``;
            the message holds the end of its log.
    """
    home = home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    for stale in [p for p in home.glob("*.pid") if not _running(_pid(home, p.stem))]:
        stale.unlink()  # after a reboot, a crash or a kill: start that one again
    conf = home / "daemons.conf"
    # a port in use is an error, not a silent move to the next one (read_state looks here)
    conf.write_text("spark.port.maxRetries 0\n")
    began = time.monotonic()
    launched = False
    if not _running(_pid(home, "master")):
        args = [MASTER_CLASS, "--host", HOST, "--port", str(port), "--webui-port", str(ui_port),
                "--properties-file", str(conf)]  # fmt: skip
        _launch(home, "master", args)
        launched = True
    _wait(home, "master", lambda: read_state(home, ui_port) is not None, began + timeout)
    master_url = f"spark://{HOST}:{port}"
    for i in range(1, workers + 1):
        name = f"worker-{i}"
        if _running(_pid(home, name)):
            continue
        work = home / name
        work.mkdir(exist_ok=True)
        _launch(
            home,
            name,
            [WORKER_CLASS, "--host", HOST, "--cores", str(cores), "--memory", memory,
             "--work-dir", str(work), "--webui-port", "0", "--properties-file", str(conf),
             master_url],
        )  # fmt: skip
        launched = True

    def all_alive() -> bool:
        state = read_state(home, ui_port)
        return state is not None and state.alive_workers >= workers

    _wait(home, "worker-1", all_alive, began + timeout)
    state = read_state(home, ui_port)
    assert state is not None
    took = round(time.monotonic() - began, 1) if launched else None
    return Cluster(state.home, state.master_url, state.ui_url, state.workers, state.apps, took)


def _wait(home: Path, name: str, ready: Any, deadline: float) -> None:
    while not ready():
        daemons = sorted(p.stem for p in home.glob("*.pid"))
        dead = [d for d in daemons if not _running(_pid(home, d))]
        if dead or time.monotonic() > deadline:
            which = dead[0] if dead else name
            tail = _tail(home / f"{which}.log")
            why = "exited" if dead else "is not ready in time"
            raise ClusterError(f"the Spark {which} {why}; the end of its log:\n{tail}")
        time.sleep(_POLL_S)


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def kill(home: Path, name: str, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to one daemon's process group (``master``, ``worker-1``, ...); whether
    it was running."""
    pid = _pid(home.resolve(), name)
    if not _running(pid):
        return False
    assert pid is not None
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def stop(home: Path = DEFAULT_HOME, timeout: float = 30.0) -> bool:
    """Stop every daemon (workers first): SIGTERM, then SIGKILL after ``timeout``; whether
    anything was running."""
    home = home.resolve()
    names = [p.stem for p in home.glob("*.pid")]
    running = False
    for group in ([n for n in names if n != "master"], [n for n in names if n == "master"]):
        stopping = [n for n in group if kill(home, n, signal.SIGTERM)]
        running = running or bool(stopping)
        deadline = time.monotonic() + timeout
        for name in stopping:
            while _running(_pid(home, name)) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            kill(home, name, signal.SIGKILL)
    for name in names:
        (home / f"{name}.pid").unlink(missing_ok=True)
    return running


def describe(cluster: Cluster | None) -> str:
    """What ``make cluster-status`` prints."""
    if cluster is None:
        return "no Spark master answers (make cluster-up starts one)"
    lines = [f"master   {cluster.master_url}   (web page {cluster.ui_url})"]
    for w in cluster.workers:
        lines.append(
            f"worker   {w.get('host')}:{w.get('port')}  {w.get('state')}  cores "
            f"{w.get('coresused')}/{w.get('cores')} used, memory {w.get('memoryused')}/"
            f"{w.get('memory')} MB"
        )
    for app in cluster.apps:
        lines.append(f"app      {app.get('name')} ({app.get('id')}): {app.get('cores')} cores")
    if not cluster.apps:
        lines.append("app      none running")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jobs.tools.cluster up|status|down``."""
    parser = argparse.ArgumentParser(prog="cluster", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "status", "down"])
    parser.add_argument("--home", type=Path, default=DEFAULT_HOME)
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--cores", type=int, default=WORKER_CORES)
    parser.add_argument("--memory", default=WORKER_MEMORY)
    parser.add_argument("--port", type=int, default=MASTER_PORT)
    parser.add_argument("--ui-port", type=int, default=MASTER_UI_PORT)
    args = parser.parse_args(argv)
    if args.action == "down":
        print("cluster stopped" if stop(args.home) else "no cluster was running")
        return 0
    if args.action == "status":
        print(describe(read_state(args.home, args.ui_port)))
        return 0
    try:
        cluster = start(args.home, args.workers, args.cores, args.memory, args.port, args.ui_port)
    except ClusterError as err:
        print(f"cluster: error: {err}", file=sys.stderr)
        return 2
    if cluster.started_in is not None:
        print(f"cluster started in {cluster.started_in:.1f} s")
    print(describe(cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
