"""Where a killed engine was in its work, read from the files it left in the lakehouse.

Nothing here asks the engine: the delayOffset log's files (``<round>.plan.json`` written
before a round's first topic write, ``<round>.json`` its progress), the topic tables' Delta
logs (each delivery commit's ``userMetadata`` names its round) and data files (a file no log
version adds is written but not committed), and the stamping tables' ``delayq-stamp`` txn.

:func:`assert_landed` checks a kill against what the killing engine said
(:mod:`tests.support.killing_engine`); :func:`kill_inside_a_round` kills an engine from
outside while one of its delivery rounds is in progress, and says which.

Example:
    >>> before = on_disk(lay)  # doctest: +SKIP
    >>> ...  # the engine runs and is killed
    >>> assert_landed("plan", said, before, on_disk(lay))  # doctest: +SKIP
    'round 4: planned, nothing written'
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow.parquet as pq

from engine.lakehouse.storage.layout import Layout

_ROUND_FILE = re.compile(r"^(\d{20})(\.plan)?\.json$")
_ROUND_TAG = re.compile(r"^delayq round (\d+) ")
_SAID = re.compile(r"SIGKILL at (\S+)((?: \w+ \S+)*)\s*$", re.MULTILINE)
STAMP_APP_ID = "delayq-stamp"
COMMANDS_APP_ID = "delayq-commands-"  # + the checkpoint's id; its version is the round


@dataclass(frozen=True)
class OnDisk:
    """What a lakehouse's files say about its delivery and stamping, at one moment.

    Attributes:
        committed: rounds with progress in ``delay_offset``.
        planned: rounds with a plan in ``delay_offset``.
        temp_files: hidden temporary files in ``delay_offset`` (a write cut short).
        topic_rounds: per topic table, the rounds its Delta commits record.
        unstaged: per topic table, its data files that no Delta log version adds (written,
            never committed), relative to the table.
        stamp_planned: the newest stamping batch planned (-1: none).
        stamped: per stamping table (``schedule``, ``quarantine``), the highest batch its
            ``delayq-stamp`` txn records (-1: none).
        decided: the newest round whose command outcomes are in ``command_results`` (-1:
            none).
    """

    committed: frozenset[int]
    planned: frozenset[int]
    temp_files: frozenset[str]
    topic_rounds: dict[str, frozenset[int]]
    unstaged: dict[str, frozenset[str]]
    stamp_planned: int
    stamped: dict[str, int]
    decided: int = -1

    @property
    def pending(self) -> int | None:
        """The round planned and not committed, above every committed one (``None``: none)."""
        newer = [p for p in self.planned if p > max(self.committed, default=-1)]
        return max(newer) if newer else None

    def new_unstaged(self, before: OnDisk) -> dict[str, frozenset[str]]:
        """Per topic table, uncommitted data files that were not there ``before``."""
        return {
            table: files - before.unstaged.get(table, frozenset())
            for table, files in self.unstaged.items()
            if files - before.unstaged.get(table, frozenset())
        }

    def committed_round(self, round_: int) -> list[str]:
        """The topic tables with a commit of ``round_``."""
        return sorted(t for t, rounds in self.topic_rounds.items() if round_ in rounds)


def on_disk(lay: Layout) -> OnDisk:
    """Read the delivery and stamping state of a local lakehouse from its files."""
    committed, planned, temps = set(), set(), set()
    for name in _names(Path(lay.delay_offset)):
        found = _ROUND_FILE.match(name)
        if found:
            (planned if found.group(2) else committed).add(int(found.group(1)))
        elif name.startswith(".tmp-"):
            temps.add(name)
    topic_rounds, unstaged = {}, {}
    for table in _names(Path(lay.topics)):
        path = Path(lay.topic(table))
        if not path.is_dir():
            continue
        rounds, added = set(), set()
        for action in _log_actions(path):
            info = action.get("commitInfo")
            tag = _ROUND_TAG.match(str((info or {}).get("userMetadata") or ""))
            if tag:
                rounds.add(int(tag.group(1)))
            if "add" in action:
                added.add(unquote(action["add"]["path"]))
        topic_rounds[table] = frozenset(rounds)
        unstaged[table] = frozenset(set(_data_files(path)) - added)
    plans = [
        int(m.group(1))
        for m in map(_ROUND_FILE.match, _names(Path(lay.checkpoint("stamp")) / "batches"))
        if m and not m.group(2)
    ]
    stamped = {
        name: _newest_txn(Path(lay.table(name)), lambda app: app == STAMP_APP_ID)
        for name in ("schedule", "quarantine")
    }
    decided = _newest_txn(Path(lay.command_results), lambda app: app.startswith(COMMANDS_APP_ID))
    return OnDisk(
        frozenset(committed), frozenset(planned), frozenset(temps), topic_rounds,
        {t: f for t, f in unstaged.items() if f}, max(plans, default=-1), stamped, decided,
    )  # fmt: skip


def rounds_in(lay: Layout, table: str, files: frozenset[str]) -> tuple[set[int], int]:
    """The ``delivery_round`` values the readable ``files`` of a topic table hold, and how
    many files could not be read (one cut short by the kill, as it was being written)."""
    rounds: set[int] = set()
    unreadable = 0
    for name in files:
        try:
            column = pq.read_table(Path(lay.topic(table)) / name, columns=["delivery_round"])
        except Exception:  # a file being written when the process died
            unreadable += 1
            continue
        rounds |= set(column["delivery_round"].to_pylist())
    return rounds, unreadable


def said(output: str) -> tuple[str, dict[str, str]]:
    """Where the killing engine's output says it died: ``("topic-after", {"round": "4",
    "table": "t1"})``."""
    found = _SAID.findall(output)
    assert found, f"the killing engine said nothing of a kill:\n{output[-3000:]}"
    point, words = found[-1]
    parts = words.split()
    return point, dict(zip(parts[::2], parts[1::2], strict=True))


def assert_landed(
    lay: Layout, point: str, where: dict[str, str], before: OnDisk, after: OnDisk
) -> str:
    """Check from ``after`` (the files once the engine is dead; ``before``: as it started)
    that the kill landed at ``point``, where the engine said (``where``); a line saying
    what is on disk."""
    pending = after.pending
    if point == "stamp-after":
        batch = int(where["batch"])
        assert after.stamp_planned == batch, (point, where, after.stamp_planned)
        assert after.stamped["schedule"] == batch, (point, where, after.stamped)
        assert after.stamped["quarantine"] < batch, (point, where, after.stamped)
        return f"batch {batch}: in schedule, quarantine holds up to {after.stamped['quarantine']}"
    round_ = int(where["round"])
    # a round in progress: its plan is on disk, its progress is not
    assert pending == round_, (point, where, pending, max(after.committed, default=-1))
    assert round_ not in after.committed
    new_files = after.new_unstaged(before)
    staged = {table: rounds_in(lay, table, files) for table, files in new_files.items()}
    staged_now = sorted(t for t, (rounds, _) in staged.items() if round_ in rounds)
    shown = after.committed_round(round_)
    assert not set(staged_now) & set(shown), (staged_now, shown)
    if point == "plan":
        assert not shown and not staged_now, (shown, staged_now)  # nothing written yet
    elif point == "commands-applied":
        assert after.decided == round_ > before.decided, (where, before.decided, after.decided)
        assert not shown and not staged_now, (shown, staged_now)  # no topic written yet
    elif point == "topic-staged":
        table = where["table"]
        rounds, _ = staged.get(table, (set(), 0))
        assert rounds == {round_}, (where, staged)  # its files are there, of this round only
        assert table not in shown, (where, shown)  # ... and no commit shows them
    elif point == "topic-after":
        assert where["table"] in shown, (where, after.topic_rounds)
    elif point == "offset-temp":
        assert after.temp_files - before.temp_files, after.temp_files  # half written
        assert not staged_now, staged  # every topic write of the round is committed
    elif point != "external":
        raise AssertionError(f"no check for {point}")
    return (
        f"round {round_} planned, not committed: staged {staged_now or '-'}, "
        f"committed {shown or '-'}"
    )


def kill_inside_a_round(
    proc: subprocess.Popen[bytes], lay: Layout, timeout: float, poll: float = 0.005
) -> int:
    """SIGKILL ``proc``'s process group (the engine and its JVM) while a delivery round it
    planned is in progress; the round.

    The delayOffset folder is watched for a new plan without its progress. The group is
    then frozen (SIGSTOP) and, once every thread of it has stopped, the folder is read again:
    if the round is still uncommitted the group is killed; otherwise it goes on (SIGCONT)
    and the watch goes on.
    """
    folder = Path(lay.delay_offset)
    seen = {int(m.group(1)) for m in map(_ROUND_FILE.match, _names(folder)) if m}
    above = max(seen, default=-1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the engine exited ({proc.returncode}) before a round"
        round_ = _in_progress(folder, above)
        if round_ is not None:
            os.killpg(proc.pid, signal.SIGSTOP)
            _wait_stopped(proc.pid, 30)
            if _in_progress(folder, above) == round_:
                os.killpg(proc.pid, signal.SIGKILL)
                return round_
            os.killpg(proc.pid, signal.SIGCONT)  # it committed meanwhile: the next one
        time.sleep(poll)
    raise AssertionError(f"no delivery round in progress seen in {timeout:.0f}s")


def _in_progress(folder: Path, above: int) -> int | None:
    """The newest round above ``above`` with a plan and no progress."""
    committed, planned = set(), set()
    for name in _names(folder):
        found = _ROUND_FILE.match(name)
        if found:
            (planned if found.group(2) else committed).add(int(found.group(1)))
    waiting = [p for p in planned - committed if p > above and p > max(committed, default=-1)]
    return max(waiting) if waiting else None


def _wait_stopped(group: int, timeout: float) -> None:
    """Wait until every thread of every process in ``group`` is stopped (or gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = list(_thread_states(group))
        if states and all(s in "TtZX" for s in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process group {group} did not stop in {timeout:.0f}s")


def _thread_states(group: int) -> Iterator[str]:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != group:  # pgrp
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                yield Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # gone meanwhile


def _names(folder: Path) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except FileNotFoundError:
        return []


def _log_actions(table: Path) -> Iterator[dict[str, Any]]:
    log = table / "_delta_log"
    for name in _names(log):
        if re.fullmatch(r"\d{20}\.json", name):
            for line in (log / name).read_text().splitlines():
                if line.strip():
                    yield json.loads(line)


def _newest_txn(table: Path, app_id: Callable[[str], bool]) -> int:
    """The highest ``txn`` version a table's log records for apps ``app_id`` accepts (-1)."""
    versions = (
        int(t["version"])
        for a in _log_actions(table)
        if (t := a.get("txn")) and app_id(str(t.get("appId")))
    )
    return max(versions, default=-1)


def _data_files(table: Path) -> Iterator[str]:
    for folder, dirs, files in os.walk(table):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        for name in files:
            if name.endswith(".parquet") and not name.startswith((".", "_")):
                yield os.path.relpath(os.path.join(folder, name), table)
