"""The engine as users run it: a separate process, killed and restarted, stopped with Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from engine.control.commands import CommandResult, cancel_many, reschedule_many, results_of
from engine.core.clock import SystemClock, to_millis
from engine.lakehouse.catalog.names import register_all
from engine.lakehouse.catalog.session import REPO_ROOT
from engine.lakehouse.storage.layout import layout
from engine.produce.send import Message, send_many
from engine.run.report import LOG_DIR_ENV
from tests.support.crash_points import assert_landed, kill_inside_a_round, on_disk, said
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows
from tests.support.process import PROPS, VENV_BIN, engine_args, start, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "stop",
    [
        "Ctrl-C",  # a terminal's Ctrl-C: SIGINT to the whole process group
        "SIGTERM",  # `kill <pid>` of spark-submit (the JVM) alone
    ],
)
def test_spark_submit_stops_cleanly_on_ctrl_c_and_sigterm(
    spark: SparkSession, make_cfg: Any, tmp_path: Path, stop: str
) -> None:
    """(``delayq run`` stopped with Ctrl-C: the standby of the fencing test below.)"""
    cfg = make_cfg()
    log = tmp_path / "run.log"
    # SIGTERM (to spark-submit alone) on the default queries; Ctrl-C (the whole process group,
    # as a terminal sends it) on driver threads: on the queries it can reach a Python worker
    # Spark is starting at that instant, which prints "Fatal Python error" (issue 37's note).
    queries = stop != "Ctrl-C"
    job = ["jobs/delay_engine.py", *engine_args(cfg, "--set", WARN, queries=queries)]
    proc = start([str(VENV_BIN / "spark-submit"), "--properties-file", str(PROPS), *job], log)
    try:
        wait_for(lambda: "delivered" in log.read_text(), 120, "a progress line")
        if stop == "Ctrl-C":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, log.read_text()[-3000:]
    assert_stopped_cleanly(log.read_text())


#: The log level users see by default (the tests' engines otherwise print errors only).
WARN = "spark.log_level=WARN"


def assert_stopped_cleanly(output: str) -> None:
    """An engine's output after Ctrl-C or SIGTERM: it says it stops cleanly, with no Python
    or Java stack trace, and a last line says what was delivered."""
    assert "stopping cleanly" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    java_frames = [line for line in output.splitlines() if line.startswith("\tat ")]
    assert not java_frames, output[-3000:]
    after = output.split("stopping cleanly", 1)[1]
    assert any("delivered" in line for line in after.splitlines())


def test_a_bug_shows_one_line_naming_the_log_file_with_the_traceback(
    make_cfg: Any, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.buggy_cli", "status", *engine_args(make_cfg())],
        capture_output=True,
        text=True,
        env={**os.environ, LOG_DIR_ENV: str(logs)},
        cwd=REPO_ROOT,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 70, output[-3000:]
    (report,) = [line for line in done.stderr.splitlines() if "internal error" in line]
    expected = 'delayq: internal error (a bug): NumberFormatException: For input string: "not a'
    assert report.startswith(expected), report
    assert "Traceback" not in output and "\tat " not in output, output[-3000:]
    (log_file,) = logs.glob("delayq-*.log")
    assert f"the traceback is in {log_file}" in report
    trace = log_file.read_text()
    assert "Traceback (most recent call last)" in trace and "in _broken" in trace
    assert "JVM stack trace:" in trace and "java.lang.Integer.parseInt(" in trace


def test_executors_that_cannot_start_python_stop_the_engine_at_once_naming_the_setting(
    spark: SparkSession, make_cfg: Any, tmp_path: Path
) -> None:
    """``PYSPARK_PYTHON`` names no program (a relative path a cluster's workers do not
    have): Spark fails the first tasks that need Python (a batch's, or a Python source's
    read). Retried as a lost executor, that went on every 12 s for minutes; it is a set-up
    mistake, reported in one line (exit 2)."""
    cfg = make_cfg()
    send_many(spark, cfg, [Message("t", "m", delay_level=1)])
    log = tmp_path / "run.log"
    args = engine_args(cfg, "--set", "stamp.driver_batch_bytes=0", queries=True)
    job = [str(VENV_BIN / "spark-submit"), "--properties-file", str(PROPS)]
    proc = start([*job, "jobs/delay_engine.py", *args], log, {"PYSPARK_PYTHON": "/no/python"})
    try:
        code = proc.wait(180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert code == 2, output[-3000:]
    said = [line for line in output.splitlines() if "could not start" in line]
    assert said and said[-1].startswith(
        "delay_engine: error: Spark could not start '/no/python'"
    ), said
    assert "retrying" not in output, output[-3000:]


def test_engine_producers_and_a_consumer_started_at_once_on_a_new_lakehouse(
    spark: SparkSession, make_cfg: Any, tmp_path: Path
) -> None:
    cfg = make_cfg()
    # the default catalog: all four race for the embedded metastore as well
    settings = engine_args(cfg, "--set", "spark.log_level=WARN", catalog="embedded")
    lines = "\n".join(settings[1::2])  # the --set values, for the consumer process
    ids = ["race-a", "race-b"]
    delayq = str(VENV_BIN / "delayq")
    logs = {name: tmp_path / f"{name}.log" for name in ("engine", "p0", "p1", "consumer")}
    procs = {
        "engine": start([delayq, "run", *settings], logs["engine"]),
        **{
            f"p{i}": start(
                [delayq, "send", *settings, "--topic", "orders", "--body", f"m{i}", "--id", msg_id],
                logs[f"p{i}"],
            )
            for i, msg_id in enumerate(ids)
        },
        "consumer": start(
            [sys.executable, "-m", "tests.support.waiting_consumer", lines, ",".join(ids)],
            logs["consumer"],
        ),
    }
    try:
        codes = {name: procs[name].wait(300) for name in ("p0", "p1", "consumer")}
        os.killpg(procs["engine"].pid, signal.SIGINT)  # Ctrl-C
        codes["engine"] = procs["engine"].wait(60)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    outputs = {name: log.read_text() for name, log in logs.items()}
    for name, output in outputs.items():
        assert codes[name] == 0, f"{name} exited {codes[name]}:\n{output[-3000:]}"
        java_frames = [line for line in output.splitlines() if line.startswith("\tat ")]
        assert "Traceback" not in output and not java_frames, f"{name}:\n{output[-3000:]}"
    assert f"received {' '.join(ids)}" in outputs["consumer"]
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids, cfg)


#: (where the engine dies, the how-many-th time it gets there); "external" is a SIGKILL from
#: outside while a delivery round is in progress (its plan written, its progress not).
STORM = (
    ("topic-after", 1),
    ("commands-applied", 1),  # in the round that decides the cancels and reschedules
    ("plan", 1),
    ("offset-temp", 1),
    ("stamp-after", 1),
    ("external", 0),
    ("topic-staged", 3),
)


def _run_to_end(proc: Any, timeout: float) -> int:
    """Wait for a started process; kill its group (the JVM too) if it outlives ``timeout``."""
    try:
        return int(proc.wait(timeout))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_kill_storm_every_message_once_never_early(
    spark: SparkSession, make_cfg: Any, tmp_path: Path
) -> None:
    """Engines killed at each crash point, in turn, then one run to the end (the job under
    ``spark-submit``, its topics queried by name from another session meanwhile). Each kill is
    checked, right after it, from the lakehouse's files to have landed where it says (see
    :func:`tests.support.crash_points.assert_landed`): a round planned and not committed,
    with its topic files staged or committed as the point says; a stamping batch in
    ``schedule`` and not in ``quarantine``. The last run delivers every message exactly once,
    never early, and quarantines each bad row and each retry once. Cancels and reschedules
    issued before the ``commands-applied`` engine starts are decided in the round it dies
    in (outcomes and moved rows written, no topic yet): each is decided once, a cancelled
    message is never delivered and a moved one is delivered once, at its new time."""
    cfg = make_cfg()
    lay = layout(cfg)
    settings = engine_args(cfg, "--show", "0")
    delayq = str(VENV_BIN / "delayq")
    ids: list[str] = []
    resent = 0
    landed: list[tuple[str, int, int, str]] = []  # point, delivered before, after, on disk
    stamp_killed = -1  # the stamping batch killed between schedule and quarantine
    cancelled: list[str] = []
    move_to: dict[str, int] = {}
    cancels: list[CommandResult] = []
    moves: list[CommandResult] = []
    for k, (point, nth) in enumerate(STORM):
        # A wave before each start over three topics: levels 0-3 and timers up to 22 s (due
        # while the engine runs as well as when it starts), each wave's first five ids sent
        # again (a producer's retries) and five of the previous wave's, and two bad rows.
        wave = [
            Message(f"t{i % 3}", f"{k}-{i}", delay_level=(i // 2) % 4)
            if i % 2
            else Message(f"t{i % 3}", f"{k}-{i}", delay=f"{(i % 12) * 2}s")
            for i in range(2_000 // len(STORM))
        ]
        sent = send_many(spark, cfg, wave)
        again = [*sent[:5], *ids[-5:]]
        send_many(spark, cfg, [Message("t0", "retry", msg_id=msg_id) for msg_id in again])
        resent += len(again)
        ids += sent
        if point == "commands-applied":  # timers 16-20 s away: decided before they are due
            later = [m for i, m in enumerate(sent) if i % 2 == 0 and i % 12 in (8, 10)]
            cancelled, moved = later[:5], later[5:10]
            issued = to_millis(SystemClock().now())
            # later than the timers' 16-20 s, and than the engine's start under a loaded suite
            move_to = {m: issued + (60_000 if n % 2 else 75_000) for n, m in enumerate(moved)}
            cancels = cancel_many(spark, cfg, cancelled, wait=0)
            moves = reschedule_many(spark, cfg, [(m, t, None) for m, t in move_to.items()], wait=0)
        spark.sql(
            f"INSERT INTO delta.`{lay.commitlog}` (msg_id, body, store_ts) VALUES "
            f"('bad-{k}-1', X'01', current_timestamp()), ('bad-{k}-2', X'02', current_timestamp())"
        )
        before = len(delivered_rows(spark, cfg))
        disk = on_disk(lay)
        log = tmp_path / f"engine-{k}.log"
        if point == "external":
            proc = start([delayq, "run", *settings], log)
            try:
                where = {"round": str(kill_inside_a_round(proc, lay, 180))}
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            code = _run_to_end(proc, 30)
        else:
            until = ["--until-idle", "--max-seconds", "90"]
            command = [sys.executable, "-m", "tests.support.killing_engine", point, str(nth)]
            code = _run_to_end(start([*command, *settings, *until], log), 300)
            output = log.read_text()
            assert code == -signal.SIGKILL, f"no kill at {point}:\n{output[-3000:]}"
            said_point, where = said(output)
            assert said_point == point, output[-3000:]
        assert code == -signal.SIGKILL, log.read_text()[-3000:]
        found = assert_landed(lay, point, where, disk, on_disk(lay))
        if point == "stamp-after":
            stamp_killed = int(where["batch"])
        landed.append((point, before, len(delivered_rows(spark, cfg)), found))

    # the last run: the job with spark-submit, as users submit it
    final_log = tmp_path / "final.log"
    job = ["jobs/delay_engine.py", *settings, "--until-idle", "--max-seconds", "150"]
    final = start(
        [str(VENV_BIN / "spark-submit"), "--properties-file", str(PROPS), *job], final_log
    )
    # while an engine runs, topics are queryable by name from this (other) session
    assert register_all(spark, cfg) == ["t0", "t1", "t2"]
    assert spark.sql(f"SELECT count(*) FROM {cfg.database}.t0").first()[0] > 0  # type: ignore[index]
    code = _run_to_end(final, 300)
    assert code == 0, final_log.read_text()[-3000:]
    assert "pending none" in final_log.read_text()
    print("\nkill storm: point, delivered before -> after, on disk after the kill")
    for point, before, after, found in landed:
        print(f"  {point:13} {before:5} -> {after:5}  {found}")
    rows = delivered_rows(spark, cfg)
    assert_exactly_once_never_early(rows, [m for m in ids if m not in cancelled], cfg)
    shown_at = {
        r["msg_id"]: to_millis(r["deliver_ts"].astimezone(UTC))
        for r in rows
        if r["msg_id"] in move_to
    }
    assert shown_at == move_to  # delivered at the new time, not the first one
    for asked, status in ((cancels, "cancelled"), (moves, "rescheduled")):
        done = results_of(spark, cfg, [c.command_id for c in asked], asked[0].action)
        assert [(d.status, len(d.outcomes)) for d in done] == [(status, 1)] * len(asked), done
    quarantine = spark.read.format("delta").load(lay.quarantine)
    reasons = [r["reason"] for r in quarantine.select("reason").collect()]
    assert sum(r.startswith("duplicate: ") for r in reasons) == resent  # each retry, once
    assert reasons.count("topic is missing") == 2 * len(STORM)
    # the batch killed half stamped owed quarantine rows, which its replay wrote
    assert quarantine.where(f"stamp_batch = {stamp_killed}").count() > 0, stamp_killed


def test_a_second_engine_is_refused_and_a_stalled_one_is_fenced_once_a_standby_took_over(
    spark: SparkSession, make_cfg: Any, tmp_path: Path
) -> None:
    """Two engines started together: one runs, the other refuses at once naming it. A
    standby waits; the running engine is stopped with SIGSTOP (a stall: its process lives)
    past its lease (10 s), and the standby takes over and delivers. Once the standby has stopped
    cleanly on Ctrl-C (what ``delayq run`` says then is checked), SIGCONT wakes the first:
    it exits naming the fence and writes nothing, not a topic commit, not a round's
    progress, not a stamping batch. Every message once, never early, across it."""
    cfg = make_cfg()
    delayq = str(VENV_BIN / "delayq")
    run = [delayq, "run", *engine_args(cfg, "--set", "lease.timeout=10s", queries=True)]
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "standby")}
    # two engines started together: one takes the lakehouse, the other refuses at once
    procs = {name: start(run, logs[name]) for name in ("a", "b")}
    stalled: int | None = None
    try:
        finished = wait_any(procs, 180)
        refused = logs[finished].read_text()
        (runner,) = set(procs) - {finished}
        assert procs[finished].returncode == 2, refused[-3000:]
        expected = f"another engine holds the lakehouse {cfg.lakehouse}: host "
        assert expected in refused and f", pid {procs[runner].pid}, since " in refused, refused
        assert "Traceback" not in refused
        standby = start([*run, "--set", "lease.standby=true", "--set", WARN], logs["standby"])
        procs["standby"] = standby
        wait_for(lambda: "standing by" in logs["standby"].read_text(), 120, "a standby")
        ids = send_many(spark, cfg, [Message("orders", f"m{i}", delay_level=1) for i in range(20)])
        wait_for(lambda: len(delivered_rows(spark, cfg)) > 0, 120, "deliveries by the first")
        stalled = procs[runner].pid
        os.killpg(stalled, signal.SIGSTOP)  # its process lives on: only its lease runs out
        late = send_many(spark, cfg, [Message("orders", f"n{i}", delay_level=2) for i in range(20)])
        wait_for(
            lambda: len(delivered_rows(spark, cfg)) == len(ids) + len(late), 120, "the standby"
        )
        status = subprocess.run(
            [delayq, "status", *engine_args(cfg)], capture_output=True, text=True, timeout=120
        )
        assert f", pid {standby.pid}, since " in status.stdout, status.stdout + status.stderr
        os.killpg(standby.pid, signal.SIGINT)  # Ctrl-C: the standby stops and lets go
        assert standby.wait(60) == 0, logs["standby"].read_text()[-3000:]
        assert_stopped_cleanly(logs["standby"].read_text())
        before = _table_files(Path(cfg.lakehouse))
        os.killpg(stalled, signal.SIGCONT)
        stalled = None
        code = procs[runner].wait(60)
        woke = logs[runner].read_text()
        assert code == 2, woke[-3000:]
        assert "another engine took the lakehouse over" in woke, woke[-3000:]
        assert "Traceback" not in woke and "\tat " not in woke, woke[-3000:]
        assert _table_files(Path(cfg.lakehouse)) == before  # the woken engine wrote nothing
    finally:
        if stalled is not None:
            os.killpg(stalled, signal.SIGCONT)
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids + late, cfg)


def _table_files(lakehouse: Path) -> dict[str, int]:
    """What a lakehouse has committed, with sizes: every Delta log entry of its tables, the
    delayOffset log's rounds and plans, the stamping log's batches (a data file a write in
    progress when the engine stalled finishes is no commit)."""
    return {
        str(f.relative_to(lakehouse)): f.stat().st_size
        for f in lakehouse.rglob("*.json")
        if f.is_file() and f.relative_to(lakehouse).parts[0] != "_engine"
    }


def wait_any(procs: dict[str, Any], timeout: float) -> str:
    """The name of the first of ``procs`` to exit; fails after ``timeout``."""
    wait_for(
        lambda: any(p.poll() is not None for p in procs.values()),
        timeout,
        "one of the engines to exit",
    )
    return next(n for n, p in procs.items() if p.poll() is not None)


def _java_child(pid: int) -> bool:
    """Whether a JVM runs among ``pid``'s descendants."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[2]) == os.getpgid(pid) and b"java" in cmdline.split(b"\0")[0]:
            return True
    return False


@pytest.mark.parametrize("sent", ["SIGINT", "SIGTERM"])
def test_a_command_stopped_while_its_jvm_starts_says_one_line_and_leaves_no_jvm(
    make_cfg: Any, tmp_path: Path, sent: str
) -> None:
    """Ctrl-C (or SIGTERM to the process group) the moment the command's JVM exists, before
    it answers: PySpark used to remove the folder the JVM writes its address to, and the JVM
    printed a Java stack trace and ran on, orphaned (a SIGTERM made it a bug, exit 70)."""
    cfg = make_cfg()
    log = tmp_path / "status.log"
    command = [str(VENV_BIN / "delayq"), "status", "--local", *engine_args(cfg)]
    proc = subprocess.Popen(
        command, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's
    )  # fmt: skip
    group = os.getpgid(proc.pid)
    try:
        wait_for(lambda: _java_child(proc.pid), 120, "the command's JVM")
        os.killpg(group, getattr(signal, sent))
        code = proc.wait(120)
        output = log.read_text()
        assert code == 130, output[-3000:]
        assert output.strip().endswith("delayq: interrupted"), output[-3000:]
        assert "\tat " not in output and "Exception in thread" not in output, output[-3000:]
        wait_for(lambda: subprocess.run(["pgrep", "-g", str(group)]).returncode != 0, 30,
                 "the JVM gone with the command")  # fmt: skip
    finally:
        if subprocess.run(["pgrep", "-g", str(group)], capture_output=True).returncode == 0:
            os.killpg(group, signal.SIGKILL)
