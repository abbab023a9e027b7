"""The control endpoint and its client, with a stand-in command runner (no Spark)."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.control.endpoint import ControlServer, captured, endpoint_file, read_endpoint
from engine.control.remote import call
from engine.core.config import EngineConfig
from engine.core.errors import ConfigError


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ControlServer]:
    def run(
        argv: list[str], stdin: str | None, files: dict[str, str], who: str | None
    ) -> tuple[int, str, str]:
        shown = f"ran {' '.join(argv)} in={stdin} files={sorted(files)} by={who is not None}"
        return (3, shown + "\n", "a warning\n")

    started = ControlServer(EngineConfig(lakehouse=str(tmp_path)), run).start()
    yield started
    started.stop()


def test_a_command_runs_in_the_engine_and_comes_back_with_its_output(
    server: ControlServer, tmp_path: Path
) -> None:
    cfg = EngineConfig(lakehouse=str(tmp_path))
    assert oct(Path(endpoint_file(cfg)).stat().st_mode & 0o777) == "0o600"
    reply = call(cfg, ["status", "--x"], "lines", {"ids.txt": "A\n"})
    assert reply is not None
    assert (reply.code, reply.stdout, reply.stderr) == (
        3, "ran status --x in=lines files=['ids.txt'] by=True\n", "a warning\n"
    )  # fmt: skip


def test_requests_without_the_token_are_refused(server: ControlServer) -> None:
    request = urllib.request.Request(
        f"{server.url}/v1/run", data=json.dumps({"argv": ["status"]}).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401


def test_a_stopped_or_dead_engine_is_not_called(tmp_path: Path) -> None:
    cfg = EngineConfig(lakehouse=str(tmp_path))
    server = ControlServer(cfg, lambda argv, stdin, files, who: (0, "", "")).start()
    info = read_endpoint(cfg)
    server.stop()
    assert not os.path.exists(endpoint_file(cfg)) and call(cfg, ["status"]) is None
    assert info is not None
    # a file left by an engine killed with SIGKILL: its process is gone
    Path(endpoint_file(cfg)).write_text(json.dumps({**info.__dict__, "pid": 2**22 + 1}))
    assert call(cfg, ["status"]) is None


def test_output_is_captured_per_thread() -> None:
    seen: dict[str, str] = {}

    def command(name: str) -> None:
        with captured() as (out, _):
            for _ in range(200):
                print(name)
        seen[name] = out.getvalue()

    threads = [threading.Thread(target=command, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": "a\n" * 200, "b": "b\n" * 200}


def test_a_bad_control_port_fails_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"control\.port"):
        EngineConfig.from_mapping({"control.port": "70000"})
