"""Reading the runnable code blocks of a Markdown file, and running them as a user would.

A fenced ``bash``, ``python`` or ``sql`` block runs unless the line just before its fence is
``<!-- illustrative: why -->``. A ``<!-- readme-check: skip "PREFIX" (why) -->`` line before a
block skips that block's lines starting with PREFIX. In a shell block a line may exit 1 only
when its comment says ``exit 1``; any other non-zero exit fails. Python blocks continue one
interpreter session, in order, interleaved with the shell blocks as in the file; a SQL block's
statements run there too, each with ``spark.sql(...).show()`` (an earlier block made ``spark``).

A shell block the README tells the reader to leave running in a second terminal (an engine)
is marked ``<!-- readme-check: background until "TEXT" -->``: it starts in the background, the
check goes on once it has printed TEXT, and it is stopped with Ctrl-C (SIGINT to its process
group, as a terminal sends it) before a block marked ``<!-- readme-check: stop background -->``
or at the end; it must then exit 0 without a stack trace. A block followed by
``<!-- readme-check: prints `TEXT` -->`` must print TEXT (what the page shows the reader).
"""

from __future__ import annotations

import ast
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Longest one block may run.
BLOCK_TIMEOUT_S = 600
#: The JIT setting the suite gives every JVM it starts (tests/conftest.py): a plain shell's
#: commands get it too, or each of their Sparks would start at twice the CPU.
_JVM_VARIABLES = ("SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS", "SPARK_EXECUTOR_OPTS")

_FENCE = re.compile(r"^```(\w*)\s*$")
_ILLUSTRATIVE = re.compile(r"^<!--\s*illustrative:\s*(.+?)\s*-->\s*$")
_SKIP = re.compile(r'^<!--\s*readme-check:\s*skip\s+"([^"]+)"')
_BACKGROUND = re.compile(r'^<!--\s*readme-check:\s*background\s+until\s+"([^"]+)"\s*-->\s*$')
_PRINTS = re.compile(r"^<!--\s*readme-check:\s*prints\s+`([^`]+)`\s*-->\s*$")
_STOP_BACKGROUND = re.compile(r"^<!--\s*readme-check:\s*stop background\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    language: str
    code: str
    line: int  # of the opening fence, 1-based
    illustrative: str | None = None
    skip: tuple[str, ...] = field(default_factory=tuple)
    #: runs in the background; the check goes on once it printed this
    background_until: str | None = None
    #: the background block is stopped before this one runs
    stops_background: bool = False
    #: what the block must print
    prints: str | None = None


def blocks(text: str) -> list[Block]:
    """The ``bash`` and ``python`` blocks of a Markdown text, in order."""
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        before = lines[i - 1] if i > 0 else ""
        after = lines[end + 1] if end + 1 < len(lines) else ""
        illustrative = _ILLUSTRATIVE.match(before)
        skips = tuple(m.group(1) for m in (_SKIP.match(before), _SKIP.match(after)) if m)
        background = _BACKGROUND.match(before)
        prints = _PRINTS.match(after)
        if fence.group(1) in ("bash", "python", "sql"):
            found.append(
                Block(
                    fence.group(1),
                    "\n".join(lines[i + 1 : end]) + "\n",
                    i + 1,
                    illustrative.group(1) if illustrative else None,
                    skips,
                    background.group(1) if background else None,
                    bool(_STOP_BACKGROUND.match(before)),
                    prints.group(1) if prints else None,
                )
            )
        i = end + 1
    return found


def sql_statements(code: str) -> list[str]:
    """A SQL block's statements: ``--`` comments dropped (outside quotes), split at ``;``.

    Example:
        >>> sql_statements("SELECT 1;  -- one\\nSELECT ';' AS s;\\n")
        ['SELECT 1', "SELECT ';' AS s"]
    """
    statements: list[str] = []
    current: list[str] = []
    quote = ""
    for line in code.splitlines():
        for i, ch in enumerate(line):
            if quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif line.startswith("--", i):
                break
            elif ch == ";":
                statements.append("".join(current))
                current = []
                continue
            current.append(ch)
        current.append(" ")
    statements.append("".join(current))
    return [" ".join(s.split()) for s in statements if s.strip()]


def sql_as_python(code: str) -> str:
    """Python that runs a SQL block's statements in a session holding ``spark``."""
    return "".join(f"spark.sql({s!r}).show(truncate=False)\n" for s in sql_statements(code))


def _logical_lines(code: str) -> list[str]:
    out: list[str] = []
    pending = ""
    for raw in code.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        out.append(pending + raw)
        pending = ""
    return [line for line in out if line.strip() and not line.strip().startswith("#")]


def _comment(line: str) -> str:
    """The trailing ``# comment`` of a shell line (outside quotes), or ``""``."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[i + 1 :]
    return ""


def shell_script(block: Block) -> str:
    """A bash script running the block's lines, stopping at the first that fails."""
    out = ["set -o pipefail"]
    for line in _logical_lines(block.code):
        if any(line.strip().startswith(prefix) for prefix in block.skip):
            continue
        allowed = "1" if "exit 1" in _comment(line) else "0"
        shown = line.strip().replace("'", "'\\''")
        out.append(line)
        out.append(
            f'__rc=$?; if [ "$__rc" -ne 0 ] && ! [ "$__rc" -le {allowed} ]; then '
            f"echo 'README line failed (exit '$__rc'): {shown}' >&2; exit 1; fi"
        )
    return "\n".join(out) + "\n"


_DRIVER = """
import sys, traceback
namespace = {"__name__": "__main__"}
while True:
    header = sys.stdin.readline()
    if not header:
        break
    code = sys.stdin.read(int(header))
    try:
        exec(compile(code, "<README block>", "exec"), namespace)
        print("\\n@@ok", flush=True)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        print("\\n@@failed", flush=True)
"""


class PythonSession:
    """One Python interpreter that runs blocks in turn, sharing their names."""

    def __init__(self, python: str, env: dict[str, str], cwd: Path, log: Path) -> None:
        self._log = log.open("wb")
        self._process = subprocess.Popen(
            [python, "-u", "-c", _DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, env=env, cwd=cwd, text=True,
        )  # fmt: skip
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.put(line)
        self._lines.put("@@exited\n")

    def run(self, code: str, timeout: float) -> tuple[bool, str]:
        """Run one block; (succeeded, what it printed)."""
        assert self._process.stdin is not None
        self._process.stdin.write(f"{len(code)}\n{code}")
        self._process.stdin.flush()
        printed: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                return False, "".join(printed) + f"\n(timed out after {timeout:.0f} s)"
            if line.strip() in ("@@ok", "@@failed", "@@exited"):
                return line.strip() == "@@ok", "".join(printed)
            printed.append(line)

    def close(self) -> None:
        """End the interpreter (and its Spark)."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._log.close()


def plain_env(home: Path, conf: Path | None = None) -> dict[str, str]:
    """A new user's plain shell: ``HOME`` and ``PATH`` without the venv (not activated),
    ``DELAYQ_CONF`` naming ``conf`` when given, and the suite's JIT setting for JVMs."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    env = {"HOME": os.environ.get("HOME", str(home)), "PATH": path}
    env.update({k: os.environ[k] for k in _JVM_VARIABLES if k in os.environ})
    if conf is not None:
        env["DELAYQ_CONF"] = str(conf)
    return env


def page_env(tmp: Path) -> dict[str, str]:
    """A plain shell's environment (venv not active) whose ``DELAYQ_CONF`` points
    ``conf/engine.toml``'s defaults at a new lakehouse under ``tmp``, with the short levels
    ``1s 2s 3s``."""
    conf = tmp / "engine.toml"
    conf.write_text(
        f'[lakehouse]\npath = "{tmp / "lakehouse"}"\n'
        '[levels]\ndelays = "1s 2s 3s"\n'
        '[delivery]\nprogress_interval = "2s"\n'
        '[spark]\nlog_level = "ERROR"\n'
        # names per session: each of the ~20 processes skips opening the embedded metastore
        # (4 s); tests/e2e/test_sql.py runs the default catalog end to end
        '[sql]\ncatalog = "memory"\n'
        '[spark.conf]\n"spark.ui.enabled" = "false"\n'
        '"spark.sql.shuffle.partitions" = "2"\n'
    )
    return plain_env(tmp, conf)


def run_shell(block: Block, env: dict[str, str], cwd: Path, where: str) -> str:
    """Run a shell block as written; fail naming ``where`` if a line fails or prints a stack
    trace. Returns what it printed on standard output."""
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", shell_script(block)],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=BLOCK_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, (
        f"{where}: the shell block failed\n{block.code}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-3000:]}"
    )
    assert "Traceback" not in done.stdout + done.stderr, f"{where}: a stack trace\n{done.stderr}"
    return done.stdout


class Background:
    """A shell block left running, as in a second terminal."""

    def __init__(self, block: Block, env: dict[str, str], cwd: Path, where: str, log: Path):
        assert block.background_until is not None
        self.where = where
        self._log_path = log
        self._log = log.open("wb")
        self._process = subprocess.Popen(
            ["bash", "--noprofile", "--norc", "-c", shell_script(block)],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
            env={**env, "PYTHONUNBUFFERED": "1"},  # each line as a terminal shows it
        )  # fmt: skip
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        try:
            while block.background_until not in self.printed():
                assert self._process.poll() is None, (
                    f"{where}: the background block ended (exit {self._process.returncode}) "
                    f"before printing {block.background_until!r}\n{self.printed()[-4000:]}"
                )
                assert time.monotonic() < deadline, f"{where}: nothing printed in time"
                time.sleep(0.2)
        except BaseException:
            self._kill()  # never left running (it would hold the lakehouse's lease)
            raise

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait()
        self._log.close()

    def printed(self) -> str:
        """What it printed so far (standard output and error)."""
        return self._log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self, timeout: float = 120.0) -> None:
        """Ctrl-C, as a terminal sends it (SIGINT to the process group); fail unless it then
        exits 0 without a stack trace."""
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGINT)
        try:
            code: int | None = self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)  # what it may have left behind
        self._kill()
        printed = self.printed()
        assert code == 0, f"{self.where}: Ctrl-C ended it with exit {code}\n{printed[-4000:]}"
        assert "Traceback" not in printed, f"{self.where}: a stack trace\n{printed[-4000:]}"


def docstring_block(path: Path) -> Block | None:
    """The literal ``::`` block of a job's docstring (the line a user copies)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith("::"):
            body = []
            for text in lines[i + 1 :]:
                if text.strip() and not text.startswith("    "):
                    break
                body.append(text[4:])
            return Block("bash", "\n".join(body).strip() + "\n", i + 1)
    return None


def commands(code: str) -> list[str]:
    """A block's command lines, continuation lines joined and spaces normalised."""
    joined = code.replace("\\\n", " ")
    return [" ".join(line.split()) for line in joined.splitlines() if line.strip()]


def run_page(page: Path, env: dict[str, str], cwd: Path, scratch: Path) -> int:
    """Run a Markdown page's runnable blocks in order, as a reader would, from ``cwd``: the
    Python and SQL blocks in one interpreter, the shell blocks each in a new shell, a
    background block left running until the block that stops it (or the end). Fails naming
    the page and line of the first block that fails. Returns how many blocks ran.

    Example:
        >>> run_page(Path("README.md"), plain_env(tmp), REPO_ROOT, tmp)  # doctest: +SKIP
        12
    """
    runnable = [b for b in blocks(page.read_text(encoding="utf-8")) if b.illustrative is None]
    shown = page.relative_to(cwd) if page.is_relative_to(cwd) else page
    python = PythonSession(
        str(cwd / ".venv" / "bin" / "python"), env, cwd, scratch / f"{page.stem}-python.log"
    )
    background: Background | None = None
    try:
        for block in runnable:
            where = f"{shown}:{block.line}"
            started = time.monotonic()
            printed = ""
            if block.stops_background:
                assert background is not None, f"{where}: no background block to stop"
                background.stop()
                background = None
            if block.background_until is not None:
                assert background is None, f"{where}: a second background block"
                log = scratch / f"{page.stem}-background.log"
                background = Background(block, env, cwd, where, log)
            elif block.language == "bash":
                printed = run_shell(block, env, cwd, where)
            else:
                code = block.code if block.language == "python" else sql_as_python(block.code)
                ok, printed = python.run(code, BLOCK_TIMEOUT_S)
                failed = f"{where}: the {block.language} block failed\n{block.code}"
                assert ok, f"{failed}\n---\n{printed[-4000:]}"
            if block.prints is not None:
                missing = f"{where}: the block did not print {block.prints!r}"
                assert block.prints in printed, f"{missing}\n---\n{printed[-4000:]}"
            print(f"{where} ({block.language}): {time.monotonic() - started:.1f} s", flush=True)
        if background is not None:
            background.stop()
            background = None
    finally:
        if background is not None:
            with contextlib.suppress(AssertionError):
                background.stop()
        python.close()
    return len(runnable)
