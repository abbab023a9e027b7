"""Reading the runnable code blocks of a Markdown file, and running them as a user would.

A fenced ``bash`` or ``python`` block runs unless the line just before its fence is
``<!-- illustrative: why -->``. A ``<!-- readme-check: skip "PREFIX" (why) -->`` line before a
block skips that block's lines starting with PREFIX. In a shell block a line may exit 1 only
when its comment says ``exit 1``; any other non-zero exit fails. Python blocks continue one
interpreter session, in order, interleaved with the shell blocks as in the file.
"""

from __future__ import annotations

import queue
import re
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

_FENCE = re.compile(r"^```(\w*)\s*$")
_ILLUSTRATIVE = re.compile(r"^<!--\s*illustrative:\s*(.+?)\s*-->\s*$")
_SKIP = re.compile(r'^<!--\s*readme-check:\s*skip\s+"([^"]+)"')


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    language: str
    code: str
    line: int  # of the opening fence, 1-based
    illustrative: str | None = None
    skip: tuple[str, ...] = field(default_factory=tuple)


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
        if fence.group(1) in ("bash", "python"):
            found.append(
                Block(
                    fence.group(1),
                    "\n".join(lines[i + 1 : end]) + "\n",
                    i + 1,
                    illustrative.group(1) if illustrative else None,
                    skips,
                )
            )
        i = end + 1
    return found


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
