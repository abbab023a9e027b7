"""Run a ``delayq`` command in the engine running on the lakehouse, when one answers.

The engine's endpoint (:mod:`engine.control.endpoint`) is found through
``<lakehouse>/_engine/control.json``. A file whose engine is gone (its process has ended, or
nothing listens at its address, or what listens there does not know its token) is ignored,
and the command runs in its own local Spark as before. Once connected, a failure is an
error, never a second run: the command may have been carried out already.

Example:
    >>> reply = call(cfg, ["status"])  # doctest: +SKIP
    >>> print(reply.stdout if reply else "no engine running")  # doctest: +SKIP
"""

from __future__ import annotations

import getpass
import http.client
import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from engine.control.endpoint import RUN_PATH, EndpointInfo, read_endpoint
from engine.core.config import EngineConfig
from engine.core.errors import DelayQError
from engine.core.processes import alive

#: How long to try to reach an engine before running the command locally.
CONNECT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Reply:
    """What the command printed in the engine, and its exit code."""

    code: int
    stdout: str
    stderr: str


def running_engine(cfg: EngineConfig) -> EndpointInfo | None:
    """The endpoint of the engine running on ``cfg``'s lakehouse, if its file names a live
    process (on this host; another host's is tried as it is)."""
    info = read_endpoint(cfg)
    if info is None:
        return None
    if info.host == socket.gethostname() and not alive(info.pid):
        return None
    return info


def call(
    cfg: EngineConfig,
    argv: list[str],
    stdin: str | None = None,
    files: dict[str, str] | None = None,
) -> Reply | None:
    """Run ``delayq <argv>`` in the running engine; None when no engine answers.

    Args:
        cfg: the lakehouse whose engine is asked.
        argv: the command and its arguments, as typed after ``delayq``.
        stdin: what the command reads as standard input (``send --file -``).
        files: files the command reads, by the name given on the command line.

    Raises:
        DelayQError: the engine was reached but refused the command or stopped answering.

    Example:
        >>> call(EngineConfig(lakehouse="/nowhere"), ["status"]) is None
        True
    """
    info = running_engine(cfg)
    if info is None:
        return None
    address = urlsplit(info.url)
    connection = http.client.HTTPConnection(
        address.hostname or "127.0.0.1", address.port or 80, timeout=CONNECT_TIMEOUT_S
    )
    try:
        connection.connect()
    except OSError:
        return None  # the file outlived its engine
    where = f"the engine at {info.url} ({info.holder()})"
    try:
        assert connection.sock is not None
        connection.sock.settimeout(None)  # a command may wait (cancel --wait)
        who = f"{getpass.getuser()}@{socket.gethostname()}"
        request = {"argv": argv, "stdin": stdin, "files": files or {}, "caller": who}
        body = json.dumps(request).encode()
        connection.request(
            "POST",
            RUN_PATH,
            body=body,
            headers={"Authorization": f"Bearer {info.token}", "Content-Type": "application/json"},
        )
        response = connection.getresponse()
        data = json.loads(response.read() or b"{}")
    except (OSError, http.client.HTTPException, ValueError) as err:
        raise DelayQError(
            f"{where} stopped answering ({err}); the command may have run: check before "
            "running it again"
        ) from None
    finally:
        connection.close()
    if response.status == 401:
        return None  # another engine's endpoint now has that port: this one is gone
    if response.status != 200:
        raise DelayQError(f"{where} refused the command: {data.get('error', response.reason)}")
    return Reply(int(data["code"]), str(data["stdout"]), str(data["stderr"]))


__all__ = ["CONNECT_TIMEOUT_S", "Reply", "call", "running_engine"]
