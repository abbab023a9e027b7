"""Start, stop and check a local S3 server (S3Proxy), for runs and tests on an object store.

S3Proxy (``org.gaul:s3proxy``, Apache-2.0, from Maven Central: ``make s3-jars`` resolves it
from ``build/s3proxy/pom.xml``) is a real S3 server: it speaks the S3 API over HTTP, signs
with AWS Signature V2/V4, and keeps objects as files in a local folder (its
``filesystem-nio2`` backend). It honours ``If-None-Match: *`` atomically (a hard link per
object), the put-if-absent the lakehouse's commits need. It listens on 127.0.0.1 only and
keeps everything under one *home* folder (``.s3/`` by default, git-ignored)::

    lib/*.jar           the server (``make s3-jars``)
    s3proxy.conf        its configuration, written on every launch
    credentials         the access key and secret made at the first start (owner-only)
    env                 ``export AWS_...`` lines for a shell: ``source .s3/env``
    s3proxy.log         its output
    s3proxy.pid         its pid
    data/<bucket>/      the objects

The credentials are made at random at the first start and kept in ``home``: nothing secret
is in the repository. :func:`start` returns once the server answers and the bucket exists.

Example:
    >>> server = start(Path(".s3"))  # doctest: +SKIP
    >>> server.endpoint  # doctest: +SKIP
    'http://127.0.0.1:9000'
    >>> stop(Path(".s3"))  # doctest: +SKIP
    True

From the shell::

    python -m jobs.tools.objectstore up [--home .s3] [--port 9000] [--bucket delayq]
    python -m jobs.tools.objectstore status [--home .s3]
    python -m jobs.tools.objectstore down [--home .s3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from engine.core.errors import SetupError
from engine.core.processes import alive

HOST = "127.0.0.1"
DEFAULT_HOME = Path(".s3")
DEFAULT_PORT = 9000
DEFAULT_BUCKET = "delayq"
REGION = "us-east-1"
MAIN = "org.gaul.s3proxy.Main"
#: A small heap with C1 only: a local server on a 2-core machine shared with Spark.
JVM_OPTIONS = ("-Xms64m", "-Xmx512m", "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true")
_POLL_S = 0.05

#: Servers started by this process, so that a stopped one is reaped.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class ObjectStoreError(SetupError):
    """Raised when the S3 server cannot be started, or is not set up (Java, jars)."""


@dataclass(frozen=True)
class Server:
    """A running S3 server.

    Attributes:
        home: the folder it runs from.
        port: its port on 127.0.0.1.
        pid: its process id.
        access_key: the access key id clients sign with.
        secret_key: the secret key.
        started_in: seconds :func:`start` took (``None``: it was running already).
    """

    home: Path
    port: int
    pid: int
    access_key: str
    secret_key: str
    started_in: float | None = None

    @property
    def endpoint(self) -> str:
        """The URL S3 clients talk to (``storage.s3.endpoint``, ``AWS_ENDPOINT_URL``)."""
        return f"http://{HOST}:{self.port}"

    def environment(self) -> dict[str, str]:
        """The ``AWS_*`` variables that point S3 clients (delayq, Spark, delta-rs) here.

        Example:
            >>> Server(Path("h"), 9000, 1, "k", "s").environment()["AWS_ENDPOINT_URL"]
            'http://127.0.0.1:9000'
        """
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
        }

    def make_bucket(self, bucket: str) -> None:
        """Create ``bucket`` unless it exists."""
        filesystem = pafs.S3FileSystem(
            endpoint_override=f"{HOST}:{self.port}",
            scheme="http",
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=REGION,
            allow_bucket_creation=True,
        )
        if filesystem.get_file_info(bucket).type == pafs.FileType.NotFound:
            filesystem.create_dir(bucket)


def start(
    home: Path,
    port: int = DEFAULT_PORT,
    bucket: str | None = DEFAULT_BUCKET,
    timeout: float = 60,
    *,
    lib: Path | None = None,
) -> Server:
    """Start the server from ``home`` (or return the one running from it) and make ``bucket``.

    Args:
        home: the server's folder (created if missing).
        port: its port on 127.0.0.1.
        bucket: a bucket to create if missing (``None``: none).
        timeout: seconds to wait for it to answer.
        lib: the folder of its jars; ``home/lib`` by default.

    Raises:
        ObjectStoreError: Java or the jars are missing, one from ``home`` runs on another
            port, or it did not answer within ``timeout`` (the log's tail says why).
    """
    began = time.monotonic()
    home = home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    access, secret = _credentials(home)
    running = status(home)
    if running is not None:
        if running.port != port:
            raise ObjectStoreError(
                f"an S3 server from {home} already runs on port {running.port} (pid "
                f"{running.pid}), not {port}: stop it first (python -m jobs.tools.objectstore "
                "down)"
            )
        if bucket:
            running.make_bucket(bucket)
        return running
    jar = _jar(home / "lib" if lib is None else lib)
    (home / "data").mkdir(exist_ok=True)
    conf = home / "s3proxy.conf"
    conf.write_text(_properties(home, port, access, secret))
    log = home / "s3proxy.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [_java(), *JVM_OPTIONS, "-cp", str(jar), MAIN, "--properties", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=home,
            start_new_session=True,
        )
    _CHILDREN[proc.pid] = proc
    (home / "s3proxy.pid").write_text(f"{proc.pid}\n")
    server = Server(home, port, proc.pid, access, secret)
    (home / "env").write_text("".join(f"export {k}={v}\n" for k, v in server.environment().items()))
    while not _answers(port):
        if proc.poll() is not None or time.monotonic() - began > timeout:
            stop(home)
            raise ObjectStoreError(
                f"the S3 server did not answer on {HOST}:{port}" + _log_tail(log)
            )
        time.sleep(_POLL_S)
    if bucket:
        server.make_bucket(bucket)
    return Server(home, port, proc.pid, access, secret, time.monotonic() - began)


def stop(home: Path, timeout: float = 10) -> bool:
    """Stop the server running from ``home``; whether one was running."""
    home = home.resolve()
    pid = _pid(home)
    (home / "s3proxy.pid").unlink(missing_ok=True)
    if pid is None or not _is_server(pid, home):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _is_server(pid, home) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    if _is_server(pid, home):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        child.wait(timeout)
    return True


def status(home: Path) -> Server | None:
    """The server running from ``home`` and answering, if any; never starts one."""
    home = home.resolve()
    pid = _pid(home)
    if pid is None or not _is_server(pid, home):
        return None
    port = _port_of(home)
    if port is None or not _answers(port):
        return None
    access, secret = _credentials(home)
    return Server(home, port, pid, access, secret)


# ---------------------------------------------------------------------- its files


def _properties(home: Path, port: int, access: str, secret: str) -> str:
    return f"""\
# Written by jobs/tools/objectstore.py on every launch: edits are lost.
s3proxy.endpoint=http://{HOST}:{port}
s3proxy.authorization=aws-v2-or-v4
s3proxy.identity={access}
s3proxy.credential={secret}
s3proxy.virtual-host=
jclouds.provider=filesystem-nio2
jclouds.identity={access}
jclouds.credential={secret}
jclouds.filesystem.basedir={home / "data"}
"""


def _credentials(home: Path) -> tuple[str, str]:
    """The server's access key and secret, made at random the first time."""
    path = home / "credentials"
    try:
        found = json.loads(path.read_text())
        return str(found["access_key"]), str(found["secret_key"])
    except (OSError, ValueError, KeyError):
        pass
    access, secret = f"delayq-{secrets.token_hex(4)}", secrets.token_urlsafe(24)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        json.dump({"access_key": access, "secret_key": secret}, out)
    return access, secret


def _pid(home: Path) -> int | None:
    try:
        return int((home / "s3proxy.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _port_of(home: Path) -> int | None:
    try:
        for line in (home / "s3proxy.conf").read_text().splitlines():
            if line.startswith("s3proxy.endpoint="):
                return int(line.rsplit(":", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def _is_server(pid: int, home: Path) -> bool:
    """Whether ``pid`` is a live S3Proxy started from ``home`` (not a zombie or reused pid)."""
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is None
    if not alive(pid):
        return False
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return MAIN.encode() in command and str(home).encode() in command


def _answers(port: int) -> bool:
    """Whether an HTTP server answers on the port (S3Proxy says 403 to an unsigned GET)."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _jar(lib: Path) -> Path:
    jars = sorted(lib.glob("s3proxy-*.jar"))
    if not jars:
        raise ObjectStoreError(f"no S3Proxy jar in {lib}: run `make s3-jars`")
    return jars[-1]


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise ObjectStoreError("java not found: install a JDK 17 (openjdk-17-jdk-headless)")
    return found


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f" (no log at {log})"
    return f"\nlast lines of {log}:\n" + "\n".join(tail)


# ---------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``up``, ``status`` or ``down``; exit 0 on success, 1 on failure (one line why)."""
    parser = argparse.ArgumentParser(prog="python -m jobs.tools.objectstore")
    parser.add_argument("action", choices=("up", "status", "down"))
    parser.add_argument("--home", type=Path, default=DEFAULT_HOME)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--bucket", default=DEFAULT_BUCKET)
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            server = start(args.home, args.port, args.bucket)
            took = f" in {server.started_in:.1f} s" if server.started_in else " (already up)"
            print(f"S3 server (S3Proxy) on {server.endpoint}, pid {server.pid}{took}; bucket "
                  f"{args.bucket}, data in {server.home / 'data'}")  # fmt: skip
            print(f"for a shell: source {args.home}/env   (then --set "
                  f"lakehouse.path=s3a://{args.bucket}/lh --set sql.catalog=memory)")  # fmt: skip
            return 0
        if args.action == "status":
            found = status(args.home)
            if found is None:
                print(f"no S3 server running from {args.home}")
                return 1
            buckets = sorted(p.name for p in (found.home / "data").iterdir() if p.is_dir())
            print(f"S3 server on {found.endpoint}, pid {found.pid}; buckets: "
                  f"{', '.join(buckets) or 'none'}")  # fmt: skip
            return 0
        print("stopped" if stop(args.home) else f"no S3 server was running from {args.home}")
        return 0
    except ObjectStoreError as err:
        print(f"objectstore: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
