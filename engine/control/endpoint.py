"""A running engine answers ``delayq`` commands: a small HTTP endpoint, loopback by default.

``delayq run`` (and ``jobs/delay_engine.py``) starts one next to the engine and writes
``<lakehouse>/_engine/control.json``: its address, the engine's host, pid and start time, and
a random token (the file is readable by its owner only). A ``delayq`` command finds the file
(:mod:`engine.control.remote`) and, instead of starting a Spark of its own (20-30 s), posts
its arguments; the engine runs the very same command function in its own Spark session and
returns what it printed and its exit code. So a command's output and exit code are the same
whichever way it ran.

Protection: the endpoint listens on ``control.host`` (``127.0.0.1`` unless changed) and
refuses any request without the token; whoever can read the lakehouse's ``_engine`` folder
can run commands (as whoever can write the lakehouse's tables can anyway). Binding another
address exposes it to that network: put it behind something that encrypts (plain HTTP).

Example:
    >>> server = ControlServer(cfg, run=lambda argv, stdin, files, who: (0, "ok\\n", ""))
    ... # doctest: +SKIP
    >>> server.start().url  # doctest: +SKIP
    'http://127.0.0.1:40123'
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import os
import secrets
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TextIO

from engine.core.config import EngineConfig
from engine.lakehouse.storage.fs import delete_file, read_text, write_text
from engine.lakehouse.storage.layout import layout
from engine.lakehouse.storage.store import local_path

log = logging.getLogger(__name__)

#: Where a running engine says how to reach it, under the lakehouse.
ENDPOINT_FILE = "control.json"
#: Largest request accepted (``send --file`` carries the file).
MAX_REQUEST_BYTES = 64 * 1024 * 1024
#: Commands carried out at the same time; more wait their turn (the engine's rounds come
#: first: each command thread shares the driver with them).
MAX_COMMANDS = 4
RUN_PATH = "/v1/run"
#: Longest :meth:`ControlServer.stop` waits for a warm-up command to finish.
STOP_WAIT_S = 60.0

#: Runs one command: (arguments after ``delayq``, standard input, files it reads by name,
#: the caller's ``user@host``) -> (exit code, standard output, standard error).
Runner = Callable[[list[str], str | None, dict[str, str], str | None], tuple[int, str, str]]


@dataclass(frozen=True)
class EndpointInfo:
    """What ``control.json`` holds."""

    url: str
    token: str
    host: str
    pid: int
    since: str
    lakehouse: str

    def holder(self) -> str:
        """``host pid 123 since ...``: who answers."""
        return f"{self.host} pid {self.pid} since {self.since}"


def endpoint_file(cfg: EngineConfig) -> str:
    """``<lakehouse>/_engine/control.json``.

    Example:
        >>> endpoint_file(EngineConfig(lakehouse="/lake"))
        '/lake/_engine/control.json'
    """
    return layout(cfg).engine_file(ENDPOINT_FILE)


def read_endpoint(cfg: EngineConfig) -> EndpointInfo | None:
    """The endpoint a running engine wrote for this lakehouse, if any (it may be stale)."""
    try:
        data = json.loads(read_text(endpoint_file(cfg)) or "")
        return EndpointInfo(**{k: data[k] for k in EndpointInfo.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------ per-thread output


class _Routed:
    """A standard stream that a thread can point elsewhere (its command's buffers)."""

    def __init__(self, name: str, default: TextIO) -> None:
        self._name = name
        self._default = default

    def _target(self) -> TextIO:
        target: TextIO | None = getattr(_THREAD, self._name, None)
        return target if target is not None else self._default

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __iter__(self) -> Iterator[str]:
        return iter(self._target())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)


_THREAD = threading.local()
_INSTALL = threading.Lock()


def _install() -> None:
    with _INSTALL:
        for name in ("stdout", "stderr", "stdin"):
            stream = getattr(sys, name)
            if not isinstance(stream, _Routed):
                setattr(sys, name, _Routed(name, stream))


def sent_files() -> dict[str, str] | None:
    """The files the calling ``delayq`` sent with the command this thread carries out, by
    the name given on its command line (None: this thread is not carrying out a command)."""
    files: dict[str, str] | None = getattr(_THREAD, "files", None)
    return files


def caller() -> str | None:
    """``user@host`` of the ``delayq`` whose command this thread carries out (None: none)."""
    who: str | None = getattr(_THREAD, "caller", None)
    return who


@contextmanager
def captured(
    stdin: str | None = None, files: dict[str, str] | None = None, who: str | None = None
) -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """Within the block, this thread's ``print``s (and ``DataFrame.show``) go to the two
    buffers yielded, it reads ``stdin`` as standard input, ``files`` through
    :func:`sent_files` and ``who`` through :func:`caller`; other threads are untouched.

    Example:
        >>> with captured() as (out, err):
        ...     print("hello")
        >>> out.getvalue()
        'hello\\n'
    """
    _install()
    out, err = io.StringIO(), io.StringIO()
    _THREAD.stdout, _THREAD.stderr, _THREAD.stdin = out, err, io.StringIO(stdin or "")
    _THREAD.files, _THREAD.caller = dict(files or {}), who
    try:
        yield out, err
    finally:
        _THREAD.stdout = _THREAD.stderr = _THREAD.stdin = None
        _THREAD.files = _THREAD.caller = None


# ------------------------------------------------------------------ the server


class ControlServer:
    """The endpoint of one running engine.

    Args:
        cfg: the lakehouse (where ``control.json`` goes), ``control.host`` and ``.port``.
        run: runs one command in the engine's process (the CLI gives its own).
    """

    def __init__(self, cfg: EngineConfig, run: Runner) -> None:
        self.cfg = cfg
        self.run = run
        self.token = secrets.token_urlsafe(32)
        self._server: ThreadingHTTPServer | None = None
        self._turns = threading.BoundedSemaphore(MAX_COMMANDS)
        self._thread: threading.Thread | None = None
        self._warming: threading.Thread | None = None
        self._stopping = threading.Event()
        self.info: EndpointInfo | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` once started."""
        if self.info is None:
            raise RuntimeError("the control endpoint is not started")
        return self.info.url

    def start(self) -> ControlServer:
        """Listen, then write ``control.json`` (a command can only find a listening engine)."""
        server = ThreadingHTTPServer((self.cfg.control_host, self.cfg.control_port), _handler(self))
        server.daemon_threads = True
        server.block_on_close = False  # a stop does not wait for commands still running
        self._server = server
        host, port = str(server.server_address[0]), int(server.server_address[1])
        shown = host if ":" not in host else f"[{host}]"
        self.info = EndpointInfo(
            url=f"http://{shown}:{port}",
            token=self.token,
            host=socket.gethostname(),
            pid=os.getpid(),
            since=datetime.now(UTC).isoformat(timespec="seconds"),
            lakehouse=self.cfg.lakehouse_path,
        )
        self._thread = threading.Thread(
            target=server.serve_forever, name="delayq-control", daemon=True
        )
        self._thread.start()
        _write_private(endpoint_file(self.cfg), json.dumps(asdict(self.info), indent=2))
        return self

    def warm_up(self, commands: list[list[str]]) -> None:
        """Run ``commands`` once in the background (their output is dropped), so that the
        first Spark reads of the tables are done before a user's command needs them.
        :meth:`stop` lets the one running finish (its Spark must not stop under it) and
        skips the rest."""

        def warm() -> None:
            for command in commands:
                if self._stopping.is_set():
                    return
                self.run(command, None, {}, None)

        self._warming = threading.Thread(target=warm, name="delayq-control-warm", daemon=True)
        self._warming.start()

    def stop(self) -> None:
        """Remove ``control.json`` (if it is still this engine's), then stop listening; waits
        for a warm-up command in progress (at most :data:`STOP_WAIT_S`)."""
        self._stopping.set()
        if self._warming is not None:
            self._warming.join(STOP_WAIT_S)
        current = read_endpoint(self.cfg)
        if current is not None and current.token == self.token:
            delete_file(endpoint_file(self.cfg))
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def answer(self, request: dict[str, Any]) -> tuple[int, str, str]:
        """Run one request's command (``argv``, optional ``stdin`` and ``files``)."""
        argv = request.get("argv")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv) or not argv:
            return 2, "", "delayq: error: the request names no command\n"
        stdin = request.get("stdin")
        files = request.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()
        ):
            files = {}
        who = request.get("caller")
        with self._turns:
            return self.run(
                argv,
                stdin if isinstance(stdin, str) else None,
                files,
                who if isinstance(who, str) else None,
            )


def _write_private(location: str, text: str) -> None:
    """Write ``text`` to ``location`` replacing it in one step; on a local disk readable by
    its owner only (in a bucket, by who may read the bucket)."""
    local = local_path(location)
    if local is None:
        write_text(location, text)
        return
    path = Path(local)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.unlink(missing_ok=True)  # never write through a file someone else made
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    descriptor = os.open(temporary, flags, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)


def _handler(owner: ControlServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            log.debug("control: " + format, *args)

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            given = self.headers.get("Authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), owner.token.encode()):
                self._reply(401, {"error": "wrong or missing token"})
                return
            if self.path != RUN_PATH:
                self._reply(404, {"error": f"no such path {self.path}"})
                return
            size = int(self.headers.get("Content-Length") or 0)
            if not 0 < size <= MAX_REQUEST_BYTES:
                self._reply(413, {"error": f"requests are 1 to {MAX_REQUEST_BYTES} bytes"})
                return
            try:
                request = json.loads(self.rfile.read(size))
            except ValueError:
                self._reply(400, {"error": "the request is not JSON"})
                return
            try:
                code, out, err = owner.answer(request if isinstance(request, dict) else {})
            except Exception as failure:  # the runner reports its own; this is a last guard
                log.exception("control: a command failed")
                self._reply(500, {"error": f"{type(failure).__name__}: {failure}"})
                return
            self._reply(200, {"code": code, "stdout": out, "stderr": err})

    return Handler


__all__ = [
    "ENDPOINT_FILE",
    "ControlServer",
    "EndpointInfo",
    "Runner",
    "caller",
    "captured",
    "endpoint_file",
    "read_endpoint",
    "sent_files",
]
