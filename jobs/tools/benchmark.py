"""The benchmark behind ``make bench``: throughput, lateness, backlog, spike, fan-out, memory.

A tool that ships with the project, not part of the library (it needs matplotlib).

Every workload runs the real engine (stamping and delivery loops, real clock) on a
fresh lakehouse under the output folder, in the same Spark application as the load
generator (the embedded default: one JVM on the machine's cores).

Lateness is measured from when a row became visible in its topic table: the timestamp of
the Delta commit that holds it (each topic write records its round in ``userMetadata``),
minus the row's ``deliver_ts``. A commit before ``deliver_ts`` counts as early.

Workloads:

* ``steady``: sends at stepped rates (mixed levels and timers) until the engine falls behind;
* ``backlog``: a fixed rate while 0 .. N timers wait days ahead;
* ``spike``: N messages due at the same instant, plus messages due one second later;
* ``fanout``: a fixed rate spread over 1, 10, 100 topics;
* ``ahead``: the first two steady rates with timers due 10-13 s after they are sent (stamped
  well ahead: lateness is the delivery stage's alone);
* ``restart``: 0 .. N timers waiting days ahead and 1,000 messages due (sent, not stamped, as
  a crash leaves them); then a new engine process, launched as ``make engine`` does: the
  seconds from its launch to its first delivered round;
* ``scale``: the engine as an application on a standalone cluster the workload starts (two
  workers, executors in their own JVMs): N messages sent to it at once (a ``commitlog``
  backlog to stamp), all due at one instant (a spike to deliver). Where the CPU seconds go
  (the driver's JVM and Python against the executors' JVMs and Python workers, from
  ``/proc``) and the driver's peak resident size, at each size.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyarrow.dataset import field as pc_field
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from engine.core.clock import SystemClock, to_millis
from engine.core.config import EngineConfig
from engine.core.levels import parse_levels
from engine.deliver.ahead import HORIZON_S
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.delta_log import list_topics, table_exists
from engine.lakehouse.storage.fs import jvm
from engine.lakehouse.storage.layout import layout
from engine.lakehouse.storage.location import store_for
from engine.produce.send import Message, send_arrow, send_df, send_many
from engine.recur.defs import create_schedules
from engine.run.engine import Engine

log = logging.getLogger("delayq.bench")

#: Compressed levels so that messages come due within seconds of being sent.
BENCH_LEVELS = "1s 2s 3s"
#: Timers in the steady load are due 0..this many ms after they are sent.
TIMER_SPREAD_MS = 3000
#: Timers in the ``ahead`` workload are due this many ms (plus the spread) after they are sent.
AHEAD_MS = 10_000
#: A step has fallen behind when its p99 lateness passes this, or messages are missing.
BEHIND_P99_MS = 10_000
#: Messages due when the ``restart`` workload launches its engine process.
RESTART_DUE = 1_000
#: How long the ``restart`` workload waits for the new engine's first delivered round.
RESTART_TIMEOUT_S = 600
#: ``scale``: the cluster it starts (workers x cores, each worker's memory) and the engine's
#: executors' memory; the engine takes every core.
SCALE_WORKERS, SCALE_CORES, SCALE_WORKER_MEMORY, SCALE_EXECUTOR_MEMORY = 2, 2, "3g", "2g"
#: ``scale``: how long a run may take, launch to the last row visible.
SCALE_TIMEOUT_S = 1800
#: ``scale``: seconds the engine runs on the cluster before the messages are sent.
SCALE_WARM_S = 20
#: The executors' process name on a standalone cluster's workers.
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
#: ``idle``: seconds an engine runs after its warm-up before it is measured.
IDLE_SETTLE_S = 20


@dataclass(frozen=True)
class BenchPlan:
    """What a mode runs."""

    mode: str
    rates: tuple[int, ...]
    step_seconds: int
    backlogs: tuple[int, ...]
    backlog_rate: int
    spike: int
    fanouts: tuple[int, ...]
    fanout_rate: int
    drain_seconds: int = 90
    wakeups: int = 20
    kafka_messages: int = 500_000
    #: ``kafka``: records through the same path first, not measured (the JVM compiles the
    #: Kafka reader's and sender's code: a long-running engine has it compiled).
    kafka_warm_messages: int = 100_000
    #: ``kafka_eos``: records sent through both Kafka sinks (at least once, exactly once).
    kafka_eos_messages: int = 100_000
    #: ``delayq`` command timings: runs through a running engine, runs with ``--local``.
    cli_runs: tuple[int, int] = (10, 1)
    aging: tuple[int, int] = (4, 45)  # segments x seconds, at fanout_rate on one engine
    #: ``members``: messages on one topic, handled by groups of each size (SimpleConsumer).
    members: tuple[int, tuple[int, ...]] = (2_000, (1, 2, 4))
    #: ``scale``: messages in each run's backlog-then-spike, smallest first.
    scale: tuple[int, ...] = (200_000, 1_000_000)
    #: ``idle``: seconds an engine is measured with nothing to do (after IDLE_SETTLE_S).
    idle_seconds: int = 60
    #: ``recurring``: schedules firing every minute (cron ``* * * * *``), x minutes measured.
    recurring: tuple[int, int] = (100_000, 3)
    #: ``smoothing``: messages due at one instant into a topic capped at this many a second.
    smoothing: tuple[int, int] = (1_000_000, 100_000)
    #: Seconds of the unmeasured load at 200 msg/s that warms a fresh JVM up.
    warm_seconds: int = 15


QUICK = BenchPlan(
    "quick", (1_000, 10_000, 50_000), 20, (0, 1_000_000), 1_000, 1_000_000, (1, 10, 100), 1_000
)
FULL = BenchPlan(
    "full",
    (1_000, 10_000, 50_000, 100_000, 200_000),
    60,
    (0, 1_000_000, 10_000_000, 50_000_000),
    1_000,
    1_000_000,
    (1, 10, 100),
    1_000,
    kafka_messages=2_000_000,
    kafka_eos_messages=500_000,
    cli_runs=(10, 10),
    aging=(5, 120),
    members=(10_000, (1, 2, 4)),
    scale=(1_000_000, 5_000_000),
)
#: A minute-long run of every workload on tiny numbers: checks the benchmark itself.
SMOKE = BenchPlan(
    "smoke",
    (200,),
    5,
    (0, 10_000),
    200,
    10_000,
    (1, 3),
    200,
    drain_seconds=60,
    wakeups=3,
    kafka_messages=2_000,
    kafka_warm_messages=200,
    kafka_eos_messages=1_000,
    cli_runs=(2, 1),
    aging=(2, 5),
    members=(40, (2,)),
    scale=(20_000,),
    idle_seconds=5,
    recurring=(1_000, 1),
    smoothing=(10_000, 1_000),
    warm_seconds=3,
)
PLANS = {p.mode: p for p in (SMOKE, QUICK, FULL)}


# --------------------------------------------------------------------------- load


def load_frame(
    spark: SparkSession,
    n: int,
    tag: str,
    topics: int,
    now: datetime,
    timer_share: float = 0.5,
    lead_ms: int = 0,
) -> DataFrame:
    """``n`` messages over ``topics`` topics: half on levels 1..3, half timers due soon (in
    ``lead_ms`` plus 0..3 s)."""
    now_ms = to_millis(now) + lead_ms
    timer = F.rand(seed=7) < F.lit(timer_share)
    due = F.timestamp_millis(F.lit(now_ms) + (F.rand(seed=11) * TIMER_SPREAD_MS).cast("long"))
    return spark.range(n).select(
        F.concat(F.lit("bench_"), (F.col("id") % topics).cast("string")).alias("topic"),
        F.concat(F.lit(f"{tag}-"), F.col("id").cast("string")).alias("body"),
        F.lit(tag).alias("tags"),
        F.when(timer, F.lit(None)).otherwise(F.col("id") % 3 + 1).cast("int").alias("delay_level"),
        F.when(timer, due).otherwise(F.lit(None)).alias("deliver_at"),
    )


def load_table(
    n: int,
    tag: str,
    topics: int,
    now: datetime,
    timer_share: float = 0.5,
    lead_ms: int = 0,
    seed: int = 0,
) -> pa.Table:
    """:func:`load_frame`'s messages as an Arrow table, made on the driver for
    :func:`send_arrow` (the producer's fast path)."""
    rng = np.random.default_rng(seed)
    ids = np.arange(n)
    timer = rng.random(n) < timer_share
    due_ms = to_millis(now) + lead_ms + (rng.random(n) * TIMER_SPREAD_MS).astype(np.int64)
    levels = pa.array((ids % 3 + 1).astype(np.int32), mask=timer)
    deliver = pa.array(due_ms * 1000, pa.int64(), mask=~timer).cast(pa.timestamp("us", tz="UTC"))
    names = pa.array([f"bench_{t}" for t in range(topics)], pa.string())
    numbers = pc.cast(pa.array(ids), pa.string())
    return pa.table(
        {
            "topic": names.take(pa.array(ids % topics)),
            "body": pc.cast(pc.binary_join_element_wise(f"{tag}-", numbers, ""), pa.binary()),
            "tags": pa.repeat(pa.scalar(tag, pa.string()), n),
            "delay_level": levels,
            "deliver_at": deliver,
        }
    )


class Producer(threading.Thread):
    """Sends ``rate`` messages per second for ``seconds``, batching like a real producer.

    Each commit carries what is due since the previous one (``rate`` x elapsed): when a
    send takes longer than a second, the next is larger instead of the rate falling.
    """

    def __init__(
        self,
        spark: SparkSession,
        cfg: EngineConfig,
        rate: int,
        seconds: float,
        tag: str,
        topics: int = 1,
        lead_ms: int = 0,
    ) -> None:
        super().__init__(name=f"producer-{tag}", daemon=True)
        self.spark, self.cfg, self.rate, self.seconds = spark, cfg, rate, seconds
        self.tag, self.topics, self.lead_ms = tag, topics, lead_ms
        self.sent = 0
        self.elapsed = 0.0
        self.send_seconds: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        clock = SystemClock()
        started = time.monotonic()
        tick = 0
        try:
            while time.monotonic() - started < self.seconds:
                t = time.monotonic()
                due = round(self.rate * min(t - started + 1, self.seconds)) - self.sent
                if due > 0:
                    rows = load_table(
                        due,
                        self.tag,
                        self.topics,
                        clock.now(),
                        timer_share=1.0 if self.lead_ms else 0.5,
                        lead_ms=self.lead_ms,
                        seed=tick,
                    )
                    self.sent += send_arrow(self.spark, self.cfg, rows, clock)
                    self.send_seconds.append(time.monotonic() - t)
                tick += 1
                time.sleep(max(0.0, started + tick - time.monotonic()))
        except BaseException as err:  # reported by the workload
            self.error = err
        self.elapsed = time.monotonic() - started


# --------------------------------------------------------------------------- memory


class MemorySampler(threading.Thread):
    """Samples JVM heap in use and process resident sizes every half second."""

    def __init__(self, spark: SparkSession) -> None:
        super().__init__(name="memory-sampler", daemon=True)
        view = jvm(spark)
        self._bean = view.java.lang.management.ManagementFactory.getMemoryMXBean()
        self._system = view.java.lang.System
        self.jvm_pid = int(view.java.lang.ProcessHandle.current().pid())
        self._stop = threading.Event()
        self.peak: dict[str, float] = {}

    def reset(self) -> dict[str, float]:
        """Return the peaks since the last reset and start again."""
        peak, self.peak = self.peak, {}
        return peak

    def live_heap_mb(self) -> float:
        """JVM heap in use right after a full collection: what the driver keeps, without the
        garbage that makes the sampled peak depend on when the collector last ran."""
        self._system.gc()
        return round(float(self._bean.getHeapMemoryUsage().getUsed()) / 2**20, 1)

    def run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                sample = {
                    "jvm_heap_used_mb": self._bean.getHeapMemoryUsage().getUsed() / 2**20,
                    "jvm_rss_mb": _rss_mb(self.jvm_pid),
                    "python_rss_mb": _rss_mb(os.getpid()),
                }
            except Exception:  # the JVM is going down
                return
            for name, value in sample.items():
                self.peak[name] = round(max(self.peak.get(name, 0.0), value), 1)

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _stat(pid: int) -> tuple[float, int]:
    """A process's own CPU seconds so far (user + system) and its start time (clock ticks
    after boot), from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[19])


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    return _stat(pid)[0]


def _tree_rss_mb(pid: int) -> float:
    """Resident size of a process and its descendants (a spark-submit JVM and its Python)."""
    total = 0.0
    for each in _tree(pid):
        try:
            total += _rss_mb(each)
        except OSError:  # gone meanwhile
            continue
    return total


def _tree(pid: int) -> list[int]:
    """A process and its descendants, those alive now."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):  # gone meanwhile
            continue
        found.append(current)
    return found


class CpuTracker:
    """CPU seconds (user + system) of process trees, processes that exited included.

    Each process seen is remembered by pid and start time with its own CPU seconds at the
    last look: a process that exits between two looks keeps its last figure. (A reaped
    child's seconds in its parent's ``cutime`` are not used: PySpark's daemon does not reap
    its workers, and a reaped child would be counted twice.) What a process used after the
    last look before it exited, or a process that lived between two looks, is missed.
    """

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], float] = {}

    def look(self, roots: Sequence[int]) -> None:
        """Take the current figures of ``roots`` and their descendants."""
        for pid in (each for root in roots for each in _tree(root)):
            try:
                own, started = _stat(pid)
            except OSError:  # gone meanwhile
                continue
            self.seen[(pid, started)] = own  # (pid, start time): pids are reused

    def total(self, only: Callable[[int], bool] = lambda pid: True) -> float:
        """The CPU seconds of every process seen (``only`` those whose pid it accepts)."""
        return sum(s for (pid, _), s in self.seen.items() if only(pid))


def _driver_root() -> int:
    """The driver's first process: spark-submit's JVM when it started this Python, else this
    process (which started its own JVM)."""
    parent = os.getppid()
    try:
        command = Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        return os.getpid()
    return parent if b"java" in command.split(b"\0")[0] else os.getpid()


def _batch_id(engine: Engine) -> int:
    """The delivery query's current batch id (from its last progress; -1 before any)."""
    query = engine.deliver_query.query
    progress = query.lastProgress if query is not None else None
    return int(progress["batchId"]) if progress else -1


def _executors(app_id: str) -> list[int]:
    """The pids of an application's executors on this machine (standalone workers' JVMs)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if EXECUTOR_CLASS.encode() in command and app_id.encode() in command:
            pids.append(int(proc.name))
    return pids


def _absolute_python(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``PYSPARK_PYTHON`` as an absolute path when it is a relative one (a
    cluster's executors start it from their own work folders)."""
    python = env.get("PYSPARK_PYTHON", "")
    if "/" in python and not python.startswith("/"):
        return {**env, "PYSPARK_PYTHON": str(Path(python).absolute())}
    return dict(env)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _every(seconds: float, call: Callable[[int], None]) -> Callable[[int], None]:
    """``call``, at most once every ``seconds`` (the first time at once)."""
    last = [-math.inf]

    def limited(pid: int) -> None:
        if time.monotonic() - last[0] >= seconds:
            last[0] = time.monotonic()
            call(pid)

    return limited


@dataclass(frozen=True)
class Sample:
    """The ``scale`` workload's look at the engine's processes: when (ms), their CPU seconds so
    far, and the rows ``schedule`` holds."""

    ms: float
    driver_python_s: float  # what the driver's JVM started: its Python, the sources' planners
    driver_jvm_s: float
    executors_s: float  # the executors' JVMs and their Python workers
    stamped: int


def _cpu_share(
    samples: Sequence[Sample], start_ms: float | None, end_ms: float | None
) -> dict[str, Any]:
    """Seconds and CPU seconds between ``start_ms`` and ``end_ms`` (the samples nearest each),
    split between driver and executors, and the executors' share; ``None`` figures for a
    phase that did not start or end."""
    if start_ms is None or end_ms is None or not samples:
        return {"seconds": None, "driver_cpu_s": None, "driver_python_cpu_s": None,
                "executor_cpu_s": None, "executor_cpu_share": None}  # fmt: skip
    first = min(samples, key=lambda s: abs(s.ms - start_ms))
    last = min(samples, key=lambda s: abs(s.ms - end_ms))
    python = last.driver_python_s - first.driver_python_s
    driver = python + last.driver_jvm_s - first.driver_jvm_s
    executors = last.executors_s - first.executors_s
    return {
        "seconds": round((end_ms - start_ms) / 1000, 1),
        "driver_cpu_s": round(driver, 1),
        "driver_python_cpu_s": round(python, 1),
        "executor_cpu_s": round(executors, 1),
        "executor_cpu_share": round(executors / (driver + executors), 3)
        if driver + executors > 0
        else None,
    }


def _delivered_rows(log_dir: Path, before: set[Path], tag: str | None = "delayq round ") -> int:
    """Rows added by delivery commits in a topic table's Delta log (no Spark), except the
    commits in ``before``; with ``tag=None``, by every commit (``schedule``'s stamping)."""
    rows = 0
    for commit in sorted(set(log_dir.glob("*.json")) - before) if log_dir.exists() else ():
        try:
            entries = [json.loads(line) for line in commit.read_text().splitlines() if line]
        except (OSError, ValueError):  # being written
            continue
        info: dict[str, Any] = next((e["commitInfo"] for e in entries if "commitInfo" in e), {})
        if tag is None or str(info.get("userMetadata", "")).startswith(tag):
            rows += sum(
                int(json.loads(e["add"].get("stats") or "{}").get("numRecords", 0))
                for e in entries
                if "add" in e
            )
    return rows


# --------------------------------------------------------------------------- measuring


def commit_times(path: str) -> dict[int, int]:
    """``{delivery round: commit ms}`` of a topic table's delivery commits, from its Delta
    log (Python only: Spark's ``history()`` of 100 topic tables held gigabytes of heap)."""
    times: dict[int, int] = {}
    log_dir = f"{path}/_delta_log"
    store = store_for(log_dir)
    for name in store.names(log_dir):
        if not name.endswith(".json"):
            continue
        for line in (store.read(f"{log_dir}/{name}") or b"").decode().splitlines():
            info = json.loads(line).get("commitInfo") if line.strip() else None
            if info is None:
                continue
            found = _ROUND_TAG.match(str(info.get("userMetadata") or ""))
            if found:
                times[int(found.group(1))] = int(info["timestamp"])
    return times


_ROUND_TAG = re.compile(r"^delayq round (\d+)")
#: Workloads that watch a lakehouse's files on this machine's disk (engine processes'
#: commits, their control.json): not run with an S3 lakehouse.
LOCAL_ONLY = frozenset({"restart", "cli", "scale"})
_VISIBLE = pa.schema(
    [(n, pa.int64()) for n in ("delivery_round", "deliver_ms", "delivered_ms", "visible_ms")]
)


def visible_rows(spark: SparkSession, cfg: EngineConfig, tag: str | None = None) -> pa.Table:
    """Delivered rows with ``visible_ms`` (their commit) and ``late_ms`` (after deliver_ts),
    read with Arrow from the topic tables and their logs."""
    lay = layout(cfg)
    frames = []
    for name in list_topics(cfg):
        path = lay.topic(name)
        where = None if tag is None else pc_field("tags") == tag
        rows = (
            store_for(path)
            .delta_table(path)
            .to_pyarrow_dataset()
            .to_table(
                columns=["msg_id", "deliver_ts", "delivered_ts", "delivery_round"], filter=where
            )
        )
        commits = commit_times(path)
        rounds = rows["delivery_round"].to_pylist()
        frames.append(
            pa.table(
                {
                    "msg_id": rows["msg_id"],
                    "deliver_ms": _millis(rows["deliver_ts"]),
                    "delivered_ms": _millis(rows["delivered_ts"]),
                    "visible_ms": pa.array([commits.get(r) for r in rounds], pa.int64()),
                }
            )
        )
    empty = pa.table(
        {
            "msg_id": pa.array([], pa.string()),
            **{n: pa.array([], pa.int64()) for n in ("deliver_ms", "delivered_ms", "visible_ms")},
        }
    )
    result = pa.concat_tables(frames) if frames else empty
    result = result.filter(pc.is_valid(result["visible_ms"]))  # (a commit being written)
    return result.append_column("late_ms", pc.subtract(result["visible_ms"], result["deliver_ms"]))


def _millis(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Epoch ms of a timestamp column, floored as Spark's ``unix_millis``."""
    micros = pc.cast(pc.cast(column, pa.timestamp("us", tz="UTC")), pa.int64())
    return pc.floor(pc.divide(pc.cast(micros, pa.float64()), 1000.0)).cast(pa.int64())


def lateness(rows: pa.Table, sent: int) -> dict[str, Any]:
    """Percentiles of ``late_ms`` (exact, numpy), and early, duplicate and missing counts."""
    late = rows["late_ms"].to_numpy()
    distinct = len(pc.unique(rows["msg_id"])) if rows.num_rows else 0
    early = pc.or_(
        pc.less(rows["visible_ms"], rows["deliver_ms"]),
        pc.less(rows["delivered_ms"], rows["deliver_ms"]),
    )
    p: list[int | None] = [None, None, None]
    if len(late):
        p = [int(v) for v in np.percentile(late, [50, 95, 99], method="lower")]
    return {
        "delivered": distinct,
        "late_p50_ms": p[0],
        "late_p95_ms": p[1],
        "late_p99_ms": p[2],
        "late_max_ms": int(late.max()) if len(late) else None,
        "early": int(pc.sum(pc.cast(early, pa.int64())).as_py() or 0),
        "duplicates": rows.num_rows - distinct,
        "missing": max(sent - distinct, 0),
    }


def round_stats(engine: Engine, since: int) -> dict[str, Any]:
    """Delivery rounds since the ``since``-th: durations, stages, files and rows read."""
    rounds = list(engine.stats.recent)[since:]
    busy = [r for r in rounds if r.delivered]
    if not rounds:
        return {"rounds": 0}
    stages: dict[str, list[float]] = {}
    for r in busy:
        for name, seconds in r.stages.items():
            stages.setdefault(name, []).append(seconds)
    return {
        "rounds": len(rounds),
        "delivering_rounds": len(busy),
        "round_mean_s": _mean([r.seconds for r in busy]),
        "round_p95_s": _pct([r.seconds for r in busy], 0.95),
        "idle_round_mean_s": _mean([r.seconds for r in rounds if not r.delivered]),
        "stage_mean_s": {name: _mean(values) for name, values in stages.items()},
        "files_read_mean": _mean([r.files_read for r in rounds]),
        "rows_read_mean": _mean([r.rows_read for r in rounds]),
        "files_read_max": max(r.files_read for r in rounds),
    }


def stamp_stats(engine: Engine, since_batch: int) -> dict[str, Any]:
    """Stamping batches after ``since_batch``: how many, their size, and their time by stage
    (``read``: the new files as Arrow; ``write``: check, stamp, dedup, the two commits)."""
    busy = [b for b in list(engine.stamper.stats.recent) if b.batch > since_batch and b.rows]
    if not busy:
        return {"batches": 0}
    return {
        "batches": len(busy),
        "rows_per_batch_mean": _mean([b.rows for b in busy]),
        "batch_p95_s": _pct([b.seconds for b in busy], 0.95),
        "stage_mean_s": {
            "batch": _mean([b.seconds for b in busy]),
            "read": _mean([b.read_s for b in busy]),
            "write": _mean([b.write_s for b in busy]),
        },
    }


def _last_stamp_batch(engine: Engine) -> int:
    recent = engine.stamper.stats.recent
    return recent[-1].batch if recent else -1


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


# --------------------------------------------------------------------------- workloads


@dataclass
class Bench:
    """One benchmark run: a session, a plan, an output folder, and the results so far."""

    spark: SparkSession
    base: EngineConfig
    plan: BenchPlan
    out_dir: Path
    say: Callable[[str], None] = print
    results: dict[str, Any] = field(default_factory=dict)
    #: ``--conf``/``--set`` arguments the bench was given, passed on to engine processes.
    engine_args: Sequence[str] = ()
    #: Keep the bench lakehouses after the run (to inspect their tables and logs).
    keep: bool = False

    def __post_init__(self) -> None:
        self.memory = MemorySampler(self.spark)
        self.memory.start()
        self.stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        # The workloads' lakehouses: under the output folder, or, when the configuration
        # puts the lakehouse in an S3 bucket (--set lakehouse.path=s3a://...), under it.
        root = self.base.lakehouse_path if self.base.on_object_store else str(self.out_dir)
        self.lake_root = f"{root}/lakehouse-{self.stamp}"

    def cfg(self, name: str, fresh: bool = True) -> EngineConfig:
        """A config on a lakehouse for one workload: a fresh one unless ``fresh`` is false."""
        path = f"{self.lake_root}/{name}"
        if fresh and not self.base.on_object_store:  # (a bucket's run has a prefix of its own)
            shutil.rmtree(path, ignore_errors=True)
        return self.base.with_overrides(
            lakehouse=str(path),
            levels=parse_levels(BENCH_LEVELS),
            register_tables=False,
            database=f"bench_{name}".replace("-", "_"),
        )

    @contextmanager
    def engine(self, cfg: EngineConfig) -> Iterator[Engine]:
        """A started engine, warm (stamping and delivery through a first batch), stopped after."""
        engine = Engine(self.spark, cfg, out=lambda line: log.info(line))
        engine.start()  # opens it first
        engine.wait_until_warm()
        try:
            yield engine
        finally:
            engine.stop()

    def drain(self, engine: Engine, timeout: float) -> bool:
        """Wait until every sent message is delivered; false on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            engine.check_queries()
            if engine.status().idle:
                return True
            time.sleep(0.5)
        return False

    def load(
        self,
        engine: Engine,
        cfg: EngineConfig,
        rate: int,
        seconds: float,
        tag: str,
        topics: int = 1,
        lead_ms: int = 0,
    ) -> dict[str, Any]:
        """Run a producer at ``rate`` and measure until it is all delivered.

        With ``lead_ms``, every message is a timer due that much (plus 0..3 s) after it is sent.
        """
        first_round = len(engine.stats.recent)
        first_batch = _last_stamp_batch(engine)
        self.memory.reset()
        producer = Producer(self.spark, cfg, rate, seconds, tag, topics, lead_ms)
        producer.start()
        producer.join()
        if producer.error is not None:
            raise producer.error
        drained = self.drain(engine, self.plan.drain_seconds + lead_ms / 1000)
        result: dict[str, Any] = {
            "rate_target": rate,
            "seconds": seconds,
            "topics": topics,
            "sent": producer.sent,
            "rate_achieved": round(producer.sent / max(producer.elapsed, 1e-9)),
            "send_mean_s": _mean(producer.send_seconds),
            "drained": drained,
        }
        result.update(lateness(visible_rows(self.spark, cfg, tag), producer.sent))
        result["delivery"] = round_stats(engine, first_round)
        result["stamping"] = stamp_stats(engine, first_batch)
        result["memory_peak"] = self.memory.reset()
        result["memory_peak"]["jvm_heap_live_mb"] = self.memory.live_heap_mb()
        return result

    def warm_up(self) -> None:
        """A short unmeasured load: the first batches of a fresh JVM are several times slower."""
        cfg = self.cfg("warm-up")
        seconds = self.plan.warm_seconds
        self.say(f"warm-up: {seconds} s at 200 msg/s (not measured)")
        with self.engine(cfg) as engine:
            self.load(engine, cfg, 200, seconds, "warm-up")

    def steady(self) -> list[dict[str, Any]]:
        """Step the rate up until the engine falls behind."""
        steps = []
        cfg = self.cfg("steady")
        with self.engine(cfg) as engine:
            for rate in self.plan.rates:
                self.say(f"steady: {rate} msg/s for {self.plan.step_seconds} s")
                step = self.load(engine, cfg, rate, self.plan.step_seconds, f"steady-{rate}")
                steps.append(step)
                self.say("  " + _brief(step))
                behind = (step["late_p99_ms"] or 0) > BEHIND_P99_MS or step["missing"]
                if behind or step["rate_achieved"] < 0.8 * rate:
                    self.say("  the engine (or the producer) fell behind: stopping the steps")
                    break
        return steps

    def ahead(self) -> list[dict[str, Any]]:
        """Timers due 10-13 s after they are sent, at the first two steady rates: stamping is
        done well before they are due, so their lateness is the delivery stage's."""
        runs = []
        cfg = self.cfg("ahead")
        with self.engine(cfg) as engine:
            for rate in self.plan.rates[:2]:
                self.say(f"ahead: {rate} msg/s for {self.plan.step_seconds} s, due in 10-13 s")
                run = self.load(
                    engine, cfg, rate, self.plan.step_seconds, f"ahead-{rate}", lead_ms=AHEAD_MS
                )
                # The claim that stamping is done before they are due, measured: rows stamped
                # after their deliver time.
                stamped_late = (
                    self.spark.read.format("delta")
                    .load(layout(cfg).schedule)
                    .where(
                        (F.col("tags") == f"ahead-{rate}")
                        & (F.col("stamped_ts") > F.col("deliver_ts"))
                    )
                    .count()
                )
                run.update(lead_ms=AHEAD_MS, stamped_after_due=stamped_late)
                runs.append(run)
                self.say("  " + _brief(run) + f" | stamped after due {stamped_late}")
        return runs

    def backlog(self) -> list[dict[str, Any]]:
        """The same load with 0 .. N messages waiting days ahead."""
        runs = []
        for size in self.plan.backlogs:
            cfg = self.cfg(f"backlog-{size}")
            self.say(f"backlog: {size:,} timers 2 days ahead, then {self.plan.backlog_rate} msg/s")
            loaded = self.preload(cfg, size)
            with self.engine(cfg) as engine:
                run = self.load(
                    engine, cfg, self.plan.backlog_rate, self.plan.step_seconds, f"backlog-{size}"
                )
            run.update(backlog=size, preload_seconds=loaded)
            runs.append(run)
            self.say("  " + _brief(run))
        return runs

    def preload(self, cfg: EngineConfig, size: int) -> float:
        """Send and stamp ``size`` timers two days ahead (chunks of 1M); seconds taken."""
        started = time.monotonic()
        if size:
            at = SystemClock().now() + timedelta(days=2)
            chunk = 1_000_000
            for offset in range(0, size, chunk):
                n = min(chunk, size - offset)
                far = load_frame(self.spark, n, "parked", 1, at, timer_share=1.0).withColumn(
                    "body", F.lit("parked")
                )
                send_df(self.spark, cfg, far)
            stamper = Engine(self.spark, cfg, out=lambda line: log.info(line))
            try:
                stamper.open().stamp_available()
            finally:
                stamper.stop()  # releases the lease: the measured engine starts at once
        return round(time.monotonic() - started, 1)

    def aging(self) -> list[dict[str, Any]]:
        """The same load for minutes on one engine, in segments: does a round slow down as
        the tables gain versions and files (one topic commit per round, one ``schedule``
        commit per stamping batch)?"""
        segments, seconds = self.plan.aging
        rate = self.plan.fanout_rate
        cfg = self.cfg("aging")
        self.say(f"aging: {rate} msg/s for {segments} x {seconds} s on one engine")
        runs = []
        with self.engine(cfg) as engine:
            started = time.monotonic()
            for i in range(segments):
                run = self.load(engine, cfg, rate, seconds, f"aging-{i}")
                run.update(
                    segment=i,
                    age_s=round(time.monotonic() - started),
                    topic_versions=ArrowDelta(layout(cfg).topic("bench_0")).latest(),
                    schedule_versions=ArrowDelta(layout(cfg).schedule).latest(),
                )
                runs.append(run)
                self.say(
                    f"  at {run['age_s']} s ({run['topic_versions']} topic versions): "
                    + _brief(run)
                )
        return runs

    def restart(self) -> list[dict[str, Any]]:
        """A new engine process on 0 .. N timers pending days ahead: launch to first round.

        Before the launch, :data:`RESTART_DUE` messages due now are sent but not stamped (as
        a crash leaves them), so the first round needs a stamping batch first, with the
        deduplication index rebuilt from ``schedule``. The backlog workload's lakehouses are
        reused when it ran first. The engine runs as ``make engine`` runs it (``spark-submit``
        with the default driver memory) and gets SIGTERM once all of them are visible; its exit
        code and peak memory are recorded.
        """
        runs = []
        for size in self.plan.backlogs:
            self.say(f"restart: {size:,} timers 2 days ahead, {RESTART_DUE:,} due; new engine")
            if table_exists(f"{self.lake_root}/backlog-{size}/schedule"):  # the backlog run's
                cfg, loaded = self.cfg(f"backlog-{size}", fresh=False), None
            else:
                cfg = self.cfg(f"restart-{size}")
                loaded = self.preload(cfg, size)
            due = load_frame(self.spark, RESTART_DUE, "restart", 1, SystemClock().now(), 1.0)
            send_df(self.spark, cfg, due.withColumn("deliver_at", F.current_timestamp()))
            run = self._launch_until_delivered(cfg, "bench_0", RESTART_DUE)
            run.update(backlog=size, preload_seconds=loaded)
            run.update(lateness(visible_rows(self.spark, cfg, "restart"), RESTART_DUE))
            runs.append(run)
            self.say(
                f"  first round {run['first_round_s']} s after launch (session ready "
                f"{run['session_s']} s), all {run['delivered']:,} visible {run['all_visible_s']} s"
                f" | early {run['early']} dup {run['duplicates']} missing {run['missing']} | "
                f"exit {run['exit_code']}, peak RSS {run['peak_rss_mb']} MB"
            )
        return runs

    def _launch_until_delivered(
        self,
        cfg: EngineConfig,
        topic: str,
        rows: int,
        *,
        extra: Sequence[str] = (),
        tag: str = "restart",
        watch: Callable[[int], None] | None = None,
        timeout: float = RESTART_TIMEOUT_S,
    ) -> dict[str, Any]:
        """Launch ``jobs/delay_engine.py`` on ``cfg``, stop it once ``rows`` are in ``topic``.

        ``extra`` is more of the job's arguments; ``watch`` is called with the
        process's pid at each look (every 0.2 s); ``tag`` picks the rows whose visibility is
        timed."""
        from engine.lakehouse.catalog.session import REPO_ROOT

        submit = Path(sys.executable).parent / "spark-submit"
        command = [
            str(submit if submit.exists() else "spark-submit"),
            "--properties-file",
            str(REPO_ROOT / ".jars" / "spark-defaults.conf"),
            str(REPO_ROOT / "jobs" / "delay_engine.py"),
            "--max-seconds",
            str(int(timeout)),
            *self.engine_args,
            "--set",
            f"lakehouse.path={cfg.lakehouse_path}",
            "--set",
            f"levels.delays={BENCH_LEVELS}",
            "--set",
            "sql.register_tables=false",
            "--set",
            f"lakehouse.database={cfg.database}",
            *extra,
        ]
        log_dir = Path(layout(cfg).topic(topic)) / "_delta_log"
        before = set(log_dir.glob("*.json")) if log_dir.exists() else set()
        log_path = self.out_dir / f"{self.stamp}-{Path(cfg.lakehouse_path).name}-engine.log"
        launched_ms = int(time.time() * 1000)
        started = time.monotonic()
        with log_path.open("w") as engine_log:
            process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=engine_log,
                text=True,
                cwd=REPO_ROOT,
                env=_absolute_python(os.environ),
            )
            lines: list[tuple[float, str]] = []
            reader = threading.Thread(
                target=lambda: lines.extend(
                    (time.monotonic() - started, line.rstrip()) for line in process.stdout or ()
                ),
                daemon=True,
            )
            reader.start()
            peak_rss = 0.0
            delivered = False
            try:
                while process.poll() is None and time.monotonic() - started < timeout:
                    peak_rss = max(peak_rss, _tree_rss_mb(process.pid))
                    if watch is not None:
                        watch(process.pid)  # (may raise: the engine is stopped all the same)
                    if _delivered_rows(log_dir, before) >= rows:
                        delivered = True
                        break
                    time.sleep(0.2)
            finally:
                process.send_signal(signal.SIGTERM)
                try:
                    exit_code = process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    process.kill()
                    exit_code = process.wait()
                reader.join(timeout=10)
        if not delivered:
            self.say(f"  the engine did not deliver them; its output: {log_path}")
        commits = [
            ms for ms in commit_times(layout(cfg).topic(topic)).values() if ms >= launched_ms
        ]
        visible = [pc.max(visible_rows(self.spark, cfg, tag)["visible_ms"]).as_py()]
        session = next((t for t, line in lines if line.startswith("delayq: lakehouse")), None)
        return {
            "first_round_s": round((min(commits) - launched_ms) / 1000, 2) if commits else None,
            "all_visible_s": (
                round((visible[0] - launched_ms) / 1000, 2) if visible and visible[0] else None
            ),
            "session_s": round(session, 2) if session is not None else None,
            "launched_ms": launched_ms,
            "exit_code": exit_code,
            "peak_rss_mb": round(peak_rss),
            "driver_memory": "spark-submit default",
            "engine_output": [f"{t:7.2f} s  {line}" for t, line in lines[:30]],
        }

    def scale(self) -> list[dict[str, Any]]:
        """On a standalone cluster this workload starts: N messages in ``commitlog``, all due
        at one instant, then an engine process on the cluster, stopped once all are visible.

        The messages are sent :data:`SCALE_WARM_S` after the engine's executors are up (the
        JVMs' start is not what is measured; those seconds are the *idle* phase, the engine's
        cost with nothing to do). Its two phases are timed and their CPU seconds
        split between the driver (the ``spark-submit`` JVM, and the driver's Python and its
        children) and the executors (their JVMs, Python daemons and workers): *stamp* from the
        send's commit to the last ``schedule`` commit of the backlog, *deliver* from then (or
        from 30 s before the instant, when the spike's files can be written ahead, if that is
        later) to the last row visible. The instant is set from the previous size's times (the
        first: a guess), so that stamping ends before it; ``stamped_before_instant`` says
        whether it did.
        """
        from jobs.tools.cluster import read_state, start, stop

        home = (self.out_dir / f"cluster-{self.stamp}").resolve()
        ports = {"port": _free_port(), "ui_port": _free_port()}
        self.say(f"scale: a cluster of {SCALE_WORKERS} workers x {SCALE_CORES} cores ({home})")
        cluster = start(home, SCALE_WORKERS, SCALE_CORES, SCALE_WORKER_MEMORY, **ports)
        on_cluster = [
            "--set", f"spark.master={cluster.master_url}",
            "--set", f"spark.conf.spark.executor.memory={SCALE_EXECUTOR_MEMORY}",
            "--set", f"spark.conf.spark.cores.max={SCALE_WORKERS * SCALE_CORES}",
        ]  # fmt: skip

        def apps() -> list[dict[str, Any]]:
            state = read_state(home, ports["ui_port"])
            return list(state.apps) if state is not None else []

        runs: list[dict[str, Any]] = []
        earlier: list[str] = []
        try:
            for size in sorted(self.plan.scale):
                runs.append(self._scale_run(size, on_cluster, apps, runs[-1:], earlier))
        finally:
            stop(home)
            if not self.keep:
                shutil.rmtree(home, ignore_errors=True)
        if len(runs) > 1 and runs[0]["driver_rss_peak_mb"]:
            ratio = runs[-1]["driver_rss_peak_mb"] / runs[0]["driver_rss_peak_mb"]
            for run in runs:
                run["driver_rss_vs_smallest"] = round(
                    run["driver_rss_peak_mb"] / runs[0]["driver_rss_peak_mb"], 2
                )
            self.say(f"  driver peak RSS, largest / smallest size: {ratio:.2f}x")
        return runs

    def _scale_run(
        self,
        size: int,
        on_cluster: Sequence[str],
        apps: Callable[[], list[dict[str, Any]]],
        before: list[dict[str, Any]],
        earlier_apps: list[str],
    ) -> dict[str, Any]:
        """One ``scale`` size (see :meth:`scale`); ``apps`` lists the cluster's applications,
        ``earlier_apps`` the ids of the earlier sizes' engines (this run adds its own)."""
        cfg = self.cfg(f"scale-{size}")
        schedule_log = Path(layout(cfg).schedule) / "_delta_log"
        if before and before[-1]["stamp"]["seconds"]:  # the previous size's, with room
            prev = before[-1]
            took = prev["send_seconds"] + prev["stamp"]["seconds"]
            lead = 35 + 1.2 * took * size / prev["size"]
        else:
            lead = 45 + 60 * size / 1_000_000
        samples: list[Sample] = []
        app: list[str] = []
        ready: list[float] = []
        sent: dict[str, Any] = {}
        driver_cpu, executor_cpu = CpuTracker(), CpuTracker()

        def send() -> None:
            instant = SystemClock().now().replace(microsecond=0) + timedelta(seconds=round(lead))
            sent["instant_ms"] = to_millis(instant)
            sent["start_ms"] = time.time() * 1000
            started = time.monotonic()
            try:
                send_df(self.spark, cfg, self.spark.range(size).select(
                    F.lit("bench_scale").alias("topic"), F.lit("scale").alias("body"),
                    F.lit("scale").alias("tags"), F.lit(instant).alias("deliver_at"),
                ))  # fmt: skip
            except Exception as err:  # the run stops at the next look, naming it
                sent["error"] = err
                return
            sent["seconds"] = round(time.monotonic() - started, 1)
            sent["ms"] = time.time() * 1000

        sender = threading.Thread(target=send, name="scale-send", daemon=True)

        def watch(pid: int) -> None:
            if "error" in sent:
                raise RuntimeError(f"sending the messages failed: {sent['error']}")
            if not app:  # the engine's application on the cluster, once it registered
                ids = [a["id"] for a in apps() if a.get("name") == cfg.app_name]
                app.extend(sorted(set(ids) - set(earlier_apps))[-1:])
            executors = _executors(app[0]) if app else []
            if not ready and executors and schedule_log.exists():
                ready.extend((time.monotonic(), time.time() * 1000))
            if ready and sender.ident is None and time.monotonic() - ready[0] >= SCALE_WARM_S:
                self.say(f"  sending {size:,} to the running engine, due {round(lead)} s from now")
                sender.start()
            driver_cpu.look([pid])
            executor_cpu.look(executors)
            samples.append(Sample(
                time.time() * 1000, driver_cpu.total(lambda p: p != pid),
                driver_cpu.total(lambda p: p == pid), executor_cpu.total(),
                _delivered_rows(schedule_log, set(), tag=None),
            ))  # fmt: skip

        self.say(f"scale: {size:,} messages due at one instant, sent to an engine on the cluster")
        run = self._launch_until_delivered(
            cfg, "bench_scale", size, extra=on_cluster, tag="scale", watch=_every(1.0, watch),
            timeout=SCALE_TIMEOUT_S,
        )  # fmt: skip
        if sender.ident is not None:
            sender.join(timeout=60)
        earlier_apps.extend(app)
        stamped_ms = next((s.ms for s in samples if s.stamped >= size), None)
        visible_ms = run["launched_ms"] + 1000 * (run["all_visible_s"] or 0)
        instant_ms = sent.get("instant_ms", 0)
        result = {
            "size": size,
            "send_seconds": sent.get("seconds"),
            "cores": SCALE_WORKERS * SCALE_CORES,
            "stamped_before_instant": bool(stamped_ms and stamped_ms < instant_ms),
            "idle": _cpu_share(samples, ready[1] if ready else None, sent.get("start_ms")),
            "stamp": _cpu_share(samples, sent.get("ms"), stamped_ms),
            "deliver": _cpu_share(
                samples,
                max(stamped_ms, instant_ms - 1000 * HORIZON_S) if stamped_ms else None,
                visible_ms if run["all_visible_s"] else None,
            ),
            "last_visible_after_instant_s": (
                round((visible_ms - instant_ms) / 1000, 2) if run["all_visible_s"] else None
            ),
            "driver_rss_peak_mb": run["peak_rss_mb"],
            "exit_code": run["exit_code"],
            "engine_output": run["engine_output"],
        }
        result.update(lateness(visible_rows(self.spark, cfg, "scale"), size))
        shares = {p: result[p]["executor_cpu_share"] for p in ("stamp", "deliver")}
        result["executor_cpu_share"] = shares
        self.say(
            f"  stamped in {result['stamp']['seconds']} s (executors' share {shares['stamp']}), "
            f"delivered in {result['deliver']['seconds']} s ({shares['deliver']}); last row "
            f"{result['last_visible_after_instant_s']} s after the instant | early "
            f"{result['early']} dup {result['duplicates']} missing {result['missing']} | driver "
            f"peak RSS {result['driver_rss_peak_mb']} MB"
        )
        return result

    def spike(self) -> dict[str, Any]:
        """``spike`` messages due at one instant T, and 1,000 due at T + 1 s."""
        size = self.plan.spike
        cfg = self.cfg("spike")
        with self.engine(cfg) as engine:
            first_round = len(engine.stats.recent)
            self.memory.reset()
            lead = 10 + 40 * size // 1_000_000  # time to send and stamp the spike
            instant = SystemClock().now().replace(microsecond=0) + timedelta(seconds=lead)
            self.say(f"spike: {size:,} messages due at one instant ({lead} s from now)")
            spike = self.spark.range(size).select(
                F.lit("bench_spike").alias("topic"),
                F.lit("spike").alias("body"),
                F.lit("spike").alias("tags"),
                F.lit(instant).alias("deliver_at"),
            )
            sent_at = time.monotonic()
            send_df(self.spark, cfg, spike)
            send_seconds = time.monotonic() - sent_at
            after = self.spark.range(1000).select(
                F.lit("bench_after").alias("topic"),
                F.lit("after").alias("body"),
                F.lit("after").alias("tags"),
                F.lit(instant + timedelta(seconds=1)).alias("deliver_at"),
            )
            send_df(self.spark, cfg, after)
            stamped_by = None
            while SystemClock().now() < instant + timedelta(seconds=self.plan.drain_seconds):
                status = engine.status()
                if stamped_by is None and status.unstamped == 0:
                    stamped_by = SystemClock().now()
                if status.idle:
                    break
                time.sleep(0.5)
            rows = visible_rows(self.spark, cfg, "spike")
            last = [pc.max(rows["visible_ms"]).as_py()]
            result: dict[str, Any] = {
                "size": size,
                "send_seconds": round(send_seconds, 1),
                "stamped_before_instant": bool(stamped_by and stamped_by < instant),
                "last_visible_after_instant_s": (
                    round((last[0] - to_millis(instant)) / 1000, 2) if last[0] else None
                ),
                "spike": lateness(rows, size),
                "after_1s": lateness(visible_rows(self.spark, cfg, "after"), 1000),
                "delivery": round_stats(engine, first_round),
                "memory_peak": self.memory.reset(),
            }
        self.say(
            f"  last spike row visible {result['last_visible_after_instant_s']} s after the "
            f"instant; messages due 1 s later: p99 {result['after_1s']['late_p99_ms']} ms"
        )
        return result

    def recurring(self) -> dict[str, Any]:
        """Recurring schedules, each firing every minute (cron ``* * * * *``): every occurrence
        of the measured minutes once, and how late (visible after its minute). They are made
        in one commit early in a minute, so that the engine has read them (seconds for
        100,000) before the first falls due: the minutes measured are steady firing."""
        count, minutes = self.plan.recurring
        cfg = self.cfg("recurring")
        with self.engine(cfg) as engine:
            self.memory.reset()
            specs = [
                {"name": f"r{i:06d}", "topic": "bench_recurring", "body": "tick",
                 "tags": "recurring", "cron": "* * * * *"}
                for i in range(count)
            ]  # fmt: skip
            self.say(f"recurring: {count:,} schedules firing every minute, {minutes} minute(s)")
            while not 5 <= SystemClock().now().second < 15:  # (see the docstring)
                time.sleep(0.5)
            began = time.monotonic()
            made = create_schedules(cfg, specs)
            create_s = time.monotonic() - began
            created = made[0].effective
            last = created.replace(second=0, microsecond=0) + timedelta(minutes=minutes)
            expected = {s.message_id(t) for s in made for t in s.recurrence.between(created, last)}
            wanted = pa.array(sorted(expected))
            deadline = last + timedelta(seconds=self.plan.drain_seconds)
            while True:  # (the schedules go on firing: wait for the measured minutes' rows)
                time.sleep(2)
                engine.check_queries()
                if SystemClock().now() < last:
                    continue
                rows = visible_rows(self.spark, cfg, "recurring")
                rows = rows.filter(pc.is_in(rows["msg_id"], wanted))
                if rows.num_rows >= len(expected) or SystemClock().now() > deadline:
                    break
            timings = [t for t in engine.recurring.timings if t[0]]
            result: dict[str, Any] = {
                "schedules": count,
                "minutes": minutes,
                "create_seconds": round(create_s, 1),
                **lateness(rows, len(expected)),
                "fire_batch_max_s": round(max((t for _, t in timings), default=0.0), 2),
                "fire_batches": [(n, round(t, 2)) for n, t in timings],
                "skipped": engine.recurring.skipped,
                "memory_peak": self.memory.reset(),
            }
        self.say(
            f"  {result['delivered']:,} of {len(expected):,} occurrences: p50/p99 "
            f"{result['late_p50_ms']}/{result['late_p99_ms']} ms late, {result['early']} early, "
            f"{result['duplicates']} twice; largest firing batch {result['fire_batch_max_s']} s"
        )
        return result

    def smoothing(self) -> dict[str, Any]:
        """``size`` messages due at one instant T into a topic capped at ``rate`` a second
        (``topics.bench_capped.max_rate``), and other topics' messages due every millisecond
        over the time the capped ones take (``size / rate`` seconds from T), uncapped: the
        capped ones should take that time, the others stay on time."""
        size, rate = self.plan.smoothing
        cfg = self.cfg("smoothing").with_overrides(topic_rates={"bench_capped": float(rate)})
        span_ms = 1000 * size // rate
        others = min(span_ms * 10, 200_000)
        with self.engine(cfg) as engine:
            first_round = len(engine.stats.recent)
            self.memory.reset()
            lead = 10 + 40 * size // 1_000_000  # time to send and stamp them
            instant = SystemClock().now().replace(microsecond=0) + timedelta(seconds=lead)
            self.say(
                f"smoothing: {size:,} due at one instant ({lead} s from now) into a topic "
                f"capped at {rate:,}/s; {others:,} others due over the {span_ms / 1000:.0f} s after"
            )
            capped = self.spark.range(size).select(
                F.lit("bench_capped").alias("topic"),
                F.lit("capped").alias("body"),
                F.lit("capped").alias("tags"),
                F.lit(instant).alias("deliver_at"),
            )
            send_df(self.spark, cfg, capped)
            spread = self.spark.range(others).select(
                F.concat(F.lit("bench_other_"), (F.col("id") % 10).cast("string")).alias("topic"),
                F.lit("other").alias("body"),
                F.lit("other").alias("tags"),
                F.timestamp_millis(
                    F.lit(to_millis(instant)) + F.floor(F.col("id") * span_ms / others).cast("long")
                ).alias("deliver_at"),
            )
            send_df(self.spark, cfg, spread)
            forecast = None
            while SystemClock().now() < instant + timedelta(
                milliseconds=span_ms, seconds=self.plan.drain_seconds
            ):
                engine.check_queries()
                status = engine.status()
                if forecast is None and SystemClock().now() > instant + timedelta(seconds=1):
                    state = engine.delivery.progress.rates.get("bench_capped")
                    clears = state.clears_us() if state else None
                    forecast = None if clears is None else clears / 1e6 - to_millis(instant) / 1e3
                if status.idle:
                    break
                time.sleep(0.5)
            rows = visible_rows(self.spark, cfg, "capped")
            first, last = pc.min(rows["visible_ms"]).as_py(), pc.max(rows["visible_ms"]).as_py()
            took = None if last is None else round((last - to_millis(instant)) / 1000, 2)
            result: dict[str, Any] = {
                "size": size,
                "max_rate": rate,
                "expected_seconds": size / rate,
                "last_visible_after_instant_s": took,
                "off_by_pct": None if took is None else round(100 * (took * rate / size - 1), 1),
                "rate_achieved": (
                    None if not last or last == first else round(size / ((last - first) / 1000))
                ),
                "forecast_clear_after_instant_s": None if forecast is None else round(forecast, 2),
                "capped": lateness(rows, size),
                "others": lateness(visible_rows(self.spark, cfg, "other"), others),
                "delivery": round_stats(engine, first_round),
                "memory_peak": self.memory.reset(),
            }
        c, o = result["capped"], result["others"]
        self.say(
            f"  capped: last row visible {took} s after the instant ({result['off_by_pct']}% "
            f"off {size / rate:.0f} s), {result['rate_achieved']}/s, forecast at T+1 s: clears "
            f"{result['forecast_clear_after_instant_s']} s after T | early {c['early']} dup "
            f"{c['duplicates']} missing {c['missing']} | others p50/p99 {o['late_p50_ms']}/"
            f"{o['late_p99_ms']} ms, early {o['early']} dup {o['duplicates']} missing "
            f"{o['missing']}"
        )
        return result

    def fanout(self) -> list[dict[str, Any]]:
        """The same rate over 1, 10 and 100 topics."""
        runs = []
        for topics in self.plan.fanouts:
            cfg = self.cfg(f"fanout-{topics}")
            self.say(f"fanout: {self.plan.fanout_rate} msg/s over {topics} topic(s)")
            with self.engine(cfg) as engine:
                run = self.load(
                    engine,
                    cfg,
                    self.plan.fanout_rate,
                    self.plan.step_seconds,
                    f"fanout-{topics}",
                    topics,
                )
            runs.append(run)
            self.say("  " + _brief(run))
        return runs

    def wakeup(self) -> dict[str, Any]:
        """How soon a waiting consumer poll returns after the commit that delivers to it.

        One message at a time, not delayed: a consumer waits in ``poll`` (15 s timeout),
        the message is sent, and the time from its topic commit (Delta history) to the
        poll's return is the wake-up latency.
        """
        from engine.consume.consumer import Consumer
        from engine.produce.send import send

        class TimedConsumer(Consumer):
            """Records when a waiting poll saw the new commit (before it reads the rows)."""

            woke_at: float | None = None

            def _wait_for_commit(self, deadline: float) -> bool:
                woke = super()._wait_for_commit(deadline)
                if woke:
                    self.woke_at = time.time()
                return woke

        cfg = self.cfg("wakeup")
        topic = "bench_wakeup"
        self.say(f"wakeup: {self.plan.wakeups} messages to a waiting consumer poll")
        returned: list[tuple[int, int]] = []  # (delivery_round, wall ms at return)
        woke: list[int] = []  # wall ms when the waiting poll saw the commit
        sent_ms: list[int] = []
        with self.engine(cfg) as engine:
            send(self.spark, cfg, topic, "first")
            consumer = TimedConsumer(self.spark, cfg, "bench", [topic]).open()
            if not self.drain(engine, self.plan.drain_seconds):
                raise RuntimeError("wakeup: the first message was not delivered")
            consumer.poll(timeout=30)
            consumer.ack()
            consumer.commit()

            def wait(into: list[Any]) -> None:
                into.extend(consumer.poll(timeout=30))

            for i in range(self.plan.wakeups):
                got: list[Any] = []
                waiter = threading.Thread(target=wait, args=(got,))
                waiter.start()
                time.sleep(1.0)  # the poll is waiting
                sent_ms.append(int(time.time() * 1000))
                send(self.spark, cfg, topic, f"m{i}")
                waiter.join()
                done_ms = int(time.time() * 1000)
                if got:
                    returned.append((got[0].delivery_round, done_ms))
                    woke.append(int((consumer.woke_at or 0) * 1000))
                    consumer.ack()
                    consumer.commit()
        commits = commit_times(layout(cfg).topic(topic))
        wake = [done - commits[rnd] for rnd, done in returned if rnd in commits]
        noticed = [
            seen - commits[rnd]
            for (rnd, _), seen in zip(returned, woke, strict=True)
            if rnd in commits
        ]
        total = [done - sent for (_, done), sent in zip(returned, sent_ms, strict=False)]
        result = {
            "messages": self.plan.wakeups,
            "returned": len(returned),
            "noticed_ms_p50": _pct(noticed, 0.5),
            "noticed_ms_max": max(noticed) if noticed else None,
            "wake_ms_p50": _pct(wake, 0.5),
            "wake_ms_p95": _pct(wake, 0.95),
            "wake_ms_max": max(wake) if wake else None,
            "send_to_poll_ms_p50": _pct(total, 0.5),
            "send_to_poll_ms_max": max(total) if total else None,
        }
        self.say(
            f"  a waiting poll saw the commit {result['noticed_ms_p50']} ms (p50), "
            f"{result['noticed_ms_max']} ms (max) after it, and returned its rows "
            f"{result['wake_ms_p50']} ms (p50), {result['wake_ms_max']} ms (max) after it; "
            f"send to poll return p50 {result['send_to_poll_ms_p50']} ms"
        )
        return result

    def idle(self) -> list[dict[str, Any]]:
        """What the driver spends while nothing is sent: an engine started and warm, left
        alone (after ``IDLE_SETTLE_S``) for ``plan.idle_seconds``, with
        ``delivery.idle_interval`` and ``stamp.idle_wait`` as configured, then both off. The
        CPU seconds of the driver's processes (spark-submit's JVM, this Python, the Python
        processes the JVM starts: the sources' planners) and the delivery batches Spark ran."""
        configured = (self.base.idle_interval_ms, self.base.stamp_idle_wait_ms)
        settings = [configured] + ([(0, 0)] if any(configured) else [])
        root = _driver_root()
        runs = []
        for hold, wait in settings:
            # (a lakehouse each: Spark keeps a deleted table's log in its cache)
            cfg = self.cfg(f"idle-{hold}-{wait}").with_overrides(
                idle_interval_ms=hold, stamp_idle_wait_ms=wait
            )
            self.say(
                f"idle: {self.plan.idle_seconds} s with delivery.idle_interval = {hold} ms, "
                f"stamp.idle_wait = {wait} ms"
            )
            with self.engine(cfg) as engine:
                time.sleep(IDLE_SETTLE_S)
                tracker = CpuTracker()
                tracker.look([root])
                before, batches = tracker.total(), _batch_id(engine)
                started = time.monotonic()
                while time.monotonic() - started < self.plan.idle_seconds:
                    time.sleep(1.0)
                    tracker.look([root])  # (a process that exits keeps its last figure)
                    engine.check_queries()
                seconds = time.monotonic() - started
                cpu = tracker.total() - before
                ran = _batch_id(engine) - batches
            run = {
                "idle_interval_ms": hold,
                "stamp_idle_wait_ms": wait,
                "seconds": round(seconds, 1),
                "driver_cpu_s": round(cpu, 1),
                "driver_cores": round(cpu / seconds, 3),
                "delivery_batches": ran,
            }
            self.say(
                f"  driver CPU {run['driver_cpu_s']} s in {run['seconds']} s "
                f"({run['driver_cores']} of a core); {ran} delivery batches"
            )
            runs.append(run)
        return runs

    def members(self) -> dict[str, Any]:
        """Messages handled per second by a group of 1, 2 or 4 members (SimpleConsumer
        threads: receive 32, acknowledge them).

        One topic, not delayed, all sent before the members start; each member loops on
        ``receive`` and ``ack`` until the group has acknowledged every message. An ack returns
        once it is recorded (``wait=0``: the cancel is in ``commands``, as RocketMQ's ack
        returns once the broker has it); the engine applies it in a later round, before the
        invisible time (60 s) is over. Acks that wait for that round are measured apart
        (``decided``: the members of 1 acknowledging with ``wait``).
        """
        count, sizes = self.plan.members
        results = [self._group_of(size, count) for size in sizes]
        decided = self._group_of(1, min(count, 500), wait=60.0)
        return {"groups": results, "decided": decided}

    def _group_of(self, size: int, count: int, wait: float = 0.0) -> dict[str, Any]:
        """One group of ``size`` members handling ``count`` messages (see :meth:`members`)."""
        from engine.control.simple_consumer import SimpleConsumer
        from engine.core.config import GroupConfig

        cfg = self.cfg(f"members-{size}{'-decided' if wait else ''}")
        acks = f"acks waiting up to {wait:g} s for the engine" if wait else "acks recorded"
        self.say(f"members: {count:,} messages, a group of {size}, {acks}")
        ids = set(send_many(self.spark, cfg, [Message("jobs", f"m{i}") for i in range(count)]))
        acked: list[str] = []
        lock = threading.Lock()
        done = threading.Event()
        settings = GroupConfig(poll_timeout_ms=1000)

        def member(name: str) -> None:
            simple = SimpleConsumer(
                self.spark, cfg, f"g{size}", ["jobs"], invisible=60, settings=settings, name=name
            )
            while not done.is_set():
                batch = simple.receive(max_messages=32, timeout=1)
                if batch:
                    simple.ack(*batch, wait=wait)
                    with lock:
                        acked.extend(m.origin_msg_id for m in batch)
                        if set(acked) >= ids:
                            done.set()

        with self.engine(cfg) as engine:
            if not self.drain(engine, self.plan.drain_seconds):
                raise RuntimeError(f"members: {count} messages were not delivered")
            started = time.monotonic()
            threads = [
                threading.Thread(target=member, args=(f"m{i}",), daemon=True) for i in range(size)
            ]
            for thread in threads:
                thread.start()
            finished = done.wait(600)
            took = time.monotonic() - started
            done.set()
            for thread in threads:
                thread.join(120)
        row = {
            "members": size,
            "ack_wait_s": wait,
            "messages": count,
            "handled": len(set(acked)),
            "twice": len(acked) - len(set(acked)),
            "seconds": round(took, 1),
            "msg_per_s": round(len(set(acked)) / took, 1) if finished else None,
        }
        self.say(
            f"  {size} members: {row['handled']:,} handled in {row['seconds']} s "
            f"({row['msg_per_s']} msg/s), {row['twice']} twice"
        )
        return row

    def cli(self) -> dict[str, Any]:
        """``delayq`` commands carried out by a running engine, against each command starting
        a Spark of its own (``--local``), run in turn as a user's shell runs them.

        An engine (``delayq run``) runs on a lakehouse holding 5 delivered messages and 200
        waiting an hour; each command runs ``cli_runs`` times each way (cancel and reschedule
        each take a message of their own every run). Figures are whole-process wall times.
        """
        from engine.control.endpoint import endpoint_file
        from engine.lakehouse.catalog.session import REPO_ROOT

        fast_n, local_n = self.plan.cli_runs
        cfg = self.cfg("cli")
        later = [Message("orders", f"later {i}", keys=[f"k{i}"], delay=timedelta(hours=1))
                 for i in range(200)]  # fmt: skip
        ids = send_many(self.spark, cfg, later)
        ids_now = send_many(self.spark, cfg, [Message("orders", f"now {i}") for i in range(5)])
        delayq = str(Path(sys.executable).with_name("delayq"))
        common = ["--set", f"lakehouse.path={cfg.lakehouse_path}", "--set",
                  f"lakehouse.database={cfg.database}", "--set", f"levels.delays={BENCH_LEVELS}",
                  "--set", "spark.log_level=ERROR", *self.engine_args]  # fmt: skip
        # Not this job's JVM: spark-submit hands its gateway to the driver's environment.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY_")}
        env["SPARK_LOCAL_IP"] = os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")
        log_path = self.out_dir / f"{self.stamp}-cli-engine.log"
        with log_path.open("w") as engine_log:
            engine = subprocess.Popen(
                [delayq, "run", *common], stdout=engine_log, stderr=subprocess.STDOUT,
                cwd=REPO_ROOT, env=env, start_new_session=True,
            )  # fmt: skip
        results: dict[str, Any] = {"runs": {"engine": fast_n, "local": local_n}}
        try:
            deadline = time.monotonic() + 300
            while not os.path.exists(endpoint_file(cfg)) and time.monotonic() < deadline:
                if engine.poll() is not None:
                    raise RuntimeError(f"the engine stopped; its output: {log_path}")
                time.sleep(0.5)
            time.sleep(30)  # the engine has run its warm-up commands (its first table reads)
            spare = iter(ids[100:])
            commands: dict[str, Callable[[], list[str]]] = {
                "status": lambda: ["status"],
                "pending": lambda: ["pending", "--topic", "orders", "--limit", "5"],
                "forecast": lambda: ["forecast", "--minutes", "90"],
                "history": lambda: ["history", "--id", ids_now[0]],
                "topics": lambda: ["topics"],
                "lag": lambda: ["lag"],
                "dlq list": lambda: ["dlq", "list", "--group", "billing"],
                "cancel": lambda: ["cancel", "--id", next(spare), "--wait", "20"],
                "reschedule": lambda: [
                    "reschedule",
                    "--id",
                    next(spare),
                    "--delay",
                    "2h",
                    "--wait",
                    "20",
                ],
                "send": lambda: ["send", "--topic", "orders", "--body", "x", "--delay", "1h"],
            }
            for name, make in commands.items():
                times: dict[str, list[float]] = {"engine": [], "local": []}
                codes: dict[str, set[int]] = {"engine": set(), "local": set()}
                for i in range(max(fast_n, local_n)):
                    for way, runs, extra in (
                        ("engine", fast_n, []),
                        ("local", local_n, ["--local"]),
                    ):
                        if i >= runs:
                            continue
                        words = make()
                        words = [*words[:2], *common, *words[2:]] if words[0] == "dlq" else [
                            words[0], *common, *words[1:]]  # fmt: skip
                        started = time.monotonic()
                        done = subprocess.run(
                            [delayq, *words, *extra], capture_output=True, text=True,
                            cwd=REPO_ROOT, env=env, timeout=600,
                        )  # fmt: skip
                        times[way].append(time.monotonic() - started)
                        codes[way].add(done.returncode)
                row: dict[str, Any] = {"exit_codes": {w: sorted(c) for w, c in codes.items()}}
                for way, values in times.items():
                    if values:
                        row[f"{way}_p50_s"] = _pct(values, 0.5)
                        row[f"{way}_p95_s"] = _pct(values, 0.95)
                results[name] = row
                self.say(
                    f"  {name:<11} engine p50 {row.get('engine_p50_s')} s p95 "
                    f"{row.get('engine_p95_s')} s | local p50 {row.get('local_p50_s')} s "
                    f"p95 {row.get('local_p95_s')} s | exit {row['exit_codes']}"
                )
        finally:
            if engine.poll() is None:
                os.killpg(engine.pid, signal.SIGINT)
                try:
                    engine.wait(120)
                except subprocess.TimeoutExpired:
                    os.killpg(engine.pid, signal.SIGKILL)
        return results

    def kafka(self) -> dict[str, Any]:
        """Kafka topic -> ingest -> delay (level 1) -> delivery to a Kafka topic, end to end.

        Starts a broker of its own (``.kafka/lib``) and the engine. First
        ``kafka_warm_messages`` records go the whole way, timed but not the measure (``warm_up``:
        the JVM compiles the Kafka reader's and sender's code then, as a running engine has
        long done). Then the measured records are written with Spark (``write_to_kafka_s``)
        while the ingest is stopped, and the clock runs from the ingest's start until the
        output topic's end offsets hold every record (asked every 50 ms, so the measuring
        client does not compete with the engine for the cores); then the output is read with
        kafka-python and checked: every record once.
        """
        return self._kafka(
            "kafka",
            self.plan.kafka_messages,
            exactly_once=False,
            warm=self.plan.kafka_warm_messages,
        )

    def kafka_eos(self) -> dict[str, Any]:
        """The cost of exactly-once delivery to Kafka: the same records through the default
        sink (Spark's Kafka writer, at least once) and through ``kafka.exactly_once`` (one
        transaction per round and topic, kafka-python's transactional producer), one after
        the other, each on a fresh broker and lakehouse. The output is read back
        ``read_committed``."""
        size = self.plan.kafka_eos_messages
        runs = {
            "at_least_once": self._kafka("kafka-alo", size, exactly_once=False),
            "exactly_once": self._kafka("kafka-eos", size, exactly_once=True),
        }
        alo, eos = runs["at_least_once"], runs["exactly_once"]
        topic_s = [r["delivery"].get("stage_mean_s", {}).get("topics") for r in (alo, eos)]
        runs["throughput_ratio"] = round(eos["msg_per_s"] / max(alo["msg_per_s"], 1), 3)
        if None not in topic_s:
            runs["topic_stage_ratio"] = round(topic_s[1] / max(topic_s[0], 1e-9), 2)
        self.say(
            f"  exactly once / at least once: {runs['throughput_ratio']}x the msg/s, "
            f"{runs.get('topic_stage_ratio')}x the topic stage per round"
        )
        return runs

    def _kafka(self, name: str, size: int, *, exactly_once: bool, warm: int = 0) -> dict[str, Any]:
        from kafka import KafkaConsumer, TopicPartition

        from engine.lakehouse.catalog.session import REPO_ROOT
        from engine.produce.kafka_ingest import start_ingest
        from jobs.tools.broker import start as start_broker
        from jobs.tools.broker import stop as stop_broker

        home = self.out_dir / f"lakehouse-{self.stamp}" / f"{name}-broker"
        broker = start_broker(home, 19092, 19093, lib=REPO_ROOT / ".kafka" / "lib")
        sink = "exactly once" if exactly_once else "at least once"
        self.say(
            f"{name}: broker up in {broker.started_in:.1f} s; {size:,} records end to end, {sink}"
        )
        base = self.cfg(name)
        cfg = base.with_overrides(
            kafka_bootstrap=broker.bootstrap_servers,
            kafka_ingest_topics=("bench_in",),
            kafka_sinks={"bench_out": "kafka"},
            kafka_exactly_once=exactly_once,
        )

        def records(count: int, prefix: str) -> DataFrame:
            return self.spark.range(count).select(
                F.lit("bench_in").alias("topic"),
                F.concat(F.lit(prefix), F.col("id").cast("string")).alias("value"),
                F.array(
                    F.struct(
                        F.lit("REAL_TOPIC").alias("key"),
                        F.encode(F.lit("bench_out"), "UTF-8").alias("value"),
                    ),
                    F.struct(
                        F.lit("DELAY").alias("key"), F.encode(F.lit("1"), "UTF-8").alias("value")
                    ),
                ).alias("headers"),
            )

        def write(rows: DataFrame) -> float:
            began = time.monotonic()
            rows.write.format("kafka").option(
                "kafka.bootstrap.servers", broker.bootstrap_servers
            ).save()
            return time.monotonic() - began

        warm_up: dict[str, Any] = {}
        try:
            consumer = KafkaConsumer(
                bootstrap_servers=broker.bootstrap_servers,
                auto_offset_reset="earliest",
                group_id=None,
                consumer_timeout_ms=2000,
                isolation_level="read_committed",
            )

            def arrived() -> int:
                parts = consumer.partitions_for_topic("bench_out") or set()
                ends = consumer.end_offsets([TopicPartition("bench_out", p) for p in parts])
                return int(sum(ends.values()))

            def run_until(count: int) -> float:
                began = time.monotonic()
                ingest = start_ingest(self.spark, cfg)
                try:
                    deadline = time.monotonic() + self.plan.drain_seconds + count / 1000
                    while arrived() < count and time.monotonic() < deadline:
                        time.sleep(0.05)
                        engine.check_queries()
                        if ingest.exception() is not None:
                            raise RuntimeError(f"the ingest failed: {ingest.exception()}")
                    return time.monotonic() - began
                finally:
                    ingest.stop()

            with self.engine(cfg) as engine:
                if warm:
                    write(records(warm, "w"))
                    took = run_until(warm)
                    warm_up = {
                        "messages": warm,
                        "seconds": round(took, 2),
                        "msg_per_s": round(warm / max(took, 1e-9)),
                    }
                    self.say(f"  warm-up (not measured): {warm:,} records in {took:.1f} s")
                # The input is written first: producers run elsewhere in a deployment, and on
                # 2 cores a load generator's Spark job would take its share from the engine.
                written = write(records(size, "m"))
                pids = {"spark_jvm": self.memory.jvm_pid, "python": os.getpid()}
                pids["broker"] = broker.pid
                cpu_before = {proc: _cpu_s(pid) for proc, pid in pids.items()}
                since = len(engine.stats.recent)
                elapsed = run_until(warm + size)
                cpu = {n: round(_cpu_s(pid) - cpu_before[n], 1) for n, pid in pids.items()}
                # The records are readable before the round that wrote them is recorded.
                settle = time.monotonic() + 10
                while time.monotonic() < settle and size > sum(
                    r.delivered for r in list(engine.stats.recent)[since:]
                ):
                    time.sleep(0.05)
                rounds = round_stats(engine, since)
            reading = time.monotonic()
            consumer.subscribe(["bench_out"])
            values = [record.value for record in consumer]
            read_s = time.monotonic() - reading
            consumer.close()
        finally:
            stop_broker(home)
            # Spark keeps its Kafka producers for minutes; they would log a failed reconnect
            # to the stopped broker every second through the workloads that follow.
            log4j = jvm(self.spark).org.apache.logging.log4j
            log4j.core.config.Configurator.setLevel(
                "org.apache.kafka.clients.NetworkClient", log4j.Level.ERROR
            )
        values = [v for v in values if not v.startswith(b"w")]
        seen = set(values)
        result = {
            "messages": size,
            "delivered": len(seen),
            "duplicates": len(values) - len(seen),
            "broker_start_s": round(broker.started_in or 0.0, 2),
            "write_to_kafka_s": round(written, 2),
            "end_to_end_s": round(elapsed, 2),
            "msg_per_s": round(len(seen) / max(elapsed, 1e-9)),
            "check_read_s": round(read_s, 2),
            "cpu_s": cpu,  # CPU seconds per process while measured (2 cores: 2 s per second)
            "delay_level": 1,
            "levels": BENCH_LEVELS,
            "exactly_once": exactly_once,
            "delivery": rounds,
        }
        if warm_up:
            result["warm_up"] = warm_up
        self.say(
            f"  {len(seen):,}/{size:,} back in {elapsed:.1f} s: {result['msg_per_s']:,} msg/s "
            f"end to end (1 s delay included), {result['duplicates']} duplicates; CPU s "
            + ", ".join(f"{proc} {used}" for proc, used in cpu.items())
            + f"; round {rounds.get('round_mean_s')} s"
        )
        return result

    def run(self, workloads: Sequence[str]) -> dict[str, Any]:
        """Run the workloads, write JSON and PNG, and return the results."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        self.results = {"settings": self.settings(), "workloads": {}}
        try:
            self.warm_up()
            for name in workloads:
                if self.base.on_object_store and name in LOCAL_ONLY:
                    self.say(f"{name}: skipped (it watches the lakehouse's files on this disk)")
                    self.results["workloads"][name] = {"skipped": "local lakehouse only"}
                    continue
                try:
                    self.results["workloads"][name] = getattr(self, name)()
                except Exception as err:  # one failing workload must not lose the others
                    log.exception("workload %s failed", name)
                    self.say(f"{name}: failed: {type(err).__name__}: {str(err)[:300]}")
                    self.results["workloads"][name] = {"error": f"{type(err).__name__}: {err}"}
        finally:
            self.memory.stop()
            self.results["seconds"] = round(time.monotonic() - started)
            self.write()
        return self.results

    def settings(self) -> dict[str, Any]:
        """Versions and settings of this run."""
        import delta
        import pyspark

        view = jvm(self.spark)
        return {
            "mode": self.plan.mode,
            "plan": asdict(self.plan),
            "started_utc": self.stamp,
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "pyspark": pyspark.__version__,
            "delta_spark": getattr(delta, "__version__", "see pip"),
            "java": str(view.java.lang.System.getProperty("java.version")),
            "spark_master": self.spark.sparkContext.master,
            "driver_memory": self.spark.conf.get("spark.driver.memory", "1g"),
            "levels": BENCH_LEVELS,
            "stamp_interval_ms": self.base.stamp_interval_ms,
            "poll_interval_ms": self.base.poll_interval_ms,
            "stamp_max_rows_per_file": self.base.stamp_file_rows,
            "spark_conf": dict(self.base.spark_conf),
        }

    def write(self) -> None:
        """Write ``<stamp>-<mode>.json`` and ``.png``; remove the bench lakehouses unless kept."""
        stem = self.out_dir / f"{self.stamp}-{self.plan.mode}"
        Path(f"{stem}.json").write_text(json.dumps(self.results, indent=2, default=str))
        try:
            chart(self.results, Path(f"{stem}.png"))
        except Exception:  # a chart must not lose the figures
            log.exception("chart failed")
        if self.keep or self.base.on_object_store:
            self.say(f"\nlakehouses kept in {self.lake_root}")
        if not self.keep:  # (the local folder: the lakehouses, or only the brokers' files)
            shutil.rmtree(self.out_dir / f"lakehouse-{self.stamp}", ignore_errors=True)
        self.say(f"\nresults: {stem}.json\nchart:   {stem}.png")


def _brief(r: dict[str, Any]) -> str:
    return (
        f"sent {r['sent']:,} at {r['rate_achieved']:,}/s | delivered {r['delivered']:,} | "
        f"late p50/p99/max {r['late_p50_ms']}/{r['late_p99_ms']}/{r['late_max_ms']} ms | "
        f"early {r['early']} dup {r['duplicates']} missing {r['missing']} | "
        f"round {r['delivery'].get('round_mean_s')} s"
    )


# --------------------------------------------------------------------------- report


def table(results: dict[str, Any]) -> str:
    """The short table printed at the end."""
    lines = [
        f"{'workload':<22}{'msg/s':>8}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'max ms':>9}"
        f"{'early':>6}{'dup':>5}{'miss':>6}{'round s':>9}{'files':>7}{'heap MB':>9}{'live MB':>9}"
    ]
    work = _succeeded(results["workloads"])
    rows: list[tuple[str, dict[str, Any]]] = []
    rows += [(f"steady {r['rate_target']:,}/s", r) for r in work.get("steady", [])]
    rows += [(f"ahead {r['rate_target']:,}/s", r) for r in work.get("ahead", [])]
    rows += [(f"backlog {r['backlog']:,}", r) for r in work.get("backlog", [])]
    rows += [(f"fanout {r['topics']} topics", r) for r in work.get("fanout", [])]
    rows += [(f"aging at {r['age_s']} s", r) for r in work.get("aging", [])]
    for name, r in rows:
        d = r["delivery"]
        lines.append(
            f"{name:<22}{r['rate_achieved']:>8,}{_n(r['late_p50_ms']):>9}{_n(r['late_p95_ms']):>9}"
            f"{_n(r['late_p99_ms']):>9}{_n(r['late_max_ms']):>9}{r['early']:>6}"
            f"{r['duplicates']:>5}{r['missing']:>6}{_n(d.get('round_mean_s')):>9}"
            f"{_n(d.get('files_read_mean')):>7}{_n(r['memory_peak'].get('jvm_heap_used_mb')):>9}"
            f"{_n(r['memory_peak'].get('jvm_heap_live_mb')):>9}"
        )
    recurring = work.get("recurring")
    if recurring:
        r = recurring
        lines.append(
            f"recurring {r['schedules']:,} every minute x {r['minutes']}: p50/p99 "
            f"{r['late_p50_ms']}/{r['late_p99_ms']} ms (early {r['early']}, dup "
            f"{r['duplicates']}, missing {r['missing']}); largest firing batch "
            f"{r['fire_batch_max_s']} s"
        )
    smooth = work.get("smoothing")
    if smooth:
        c, o = smooth["capped"], smooth["others"]
        lines.append(
            f"smoothing {smooth['size']:,} at {smooth['max_rate']:,}/s: last row visible "
            f"{smooth['last_visible_after_instant_s']} s after the instant (expected "
            f"{smooth['expected_seconds']:.0f} s; early {c['early']}, dup {c['duplicates']}, "
            f"missing {c['missing']}); other topics p50/p99 {o['late_p50_ms']}/"
            f"{o['late_p99_ms']} ms (early {o['early']}, dup {o['duplicates']}, missing "
            f"{o['missing']})"
        )
    spike = work.get("spike")
    if spike:
        s = spike["spike"]
        lines.append(
            f"spike {spike['size']:,}: last row visible {spike['last_visible_after_instant_s']} s "
            f"after the instant (early {s['early']}, dup {s['duplicates']}, missing "
            f"{s['missing']}); due 1 s later: p50/p99 {spike['after_1s']['late_p50_ms']}/"
            f"{spike['after_1s']['late_p99_ms']} ms"
        )
    kafka = work.get("kafka")
    if kafka:
        lines.append(
            f"kafka: {kafka['delivered']:,}/{kafka['messages']:,} records Kafka -> Kafka in "
            f"{kafka['end_to_end_s']} s ({kafka['msg_per_s']:,} msg/s, level 1 delay included), "
            f"{kafka.get('duplicates', 0)} duplicates; "
            f"broker started in {kafka['broker_start_s']} s"
        )
    eos = work.get("kafka_eos")
    if eos and "exactly_once" in eos:
        alo, once = eos["at_least_once"], eos["exactly_once"]
        lines.append(
            f"kafka exactly once vs at least once, {once['messages']:,} records: "
            f"{once['msg_per_s']:,} vs {alo['msg_per_s']:,} msg/s "
            f"({eos['throughput_ratio']}x); topic stage per round "
            f"{once['delivery'].get('stage_mean_s', {}).get('topics')} vs "
            f"{alo['delivery'].get('stage_mean_s', {}).get('topics')} s; duplicates "
            f"{once['duplicates']} / {alo['duplicates']} (read_committed)"
        )
    commands = work.get("cli")
    if commands:
        lines.append("delayq commands, whole-process wall seconds p50/p95 (engine | --local):")
        for name, row in commands.items():
            if name != "runs":
                lines.append(
                    f"  {name:<11} {row.get('engine_p50_s')}/{row.get('engine_p95_s')} | "
                    f"{row.get('local_p50_s')}/{row.get('local_p95_s')}"
                )
    members = work.get("members") or {}
    for r in [*members.get("groups", []), *filter(None, [members.get("decided")])]:
        acks = "acks waiting for the engine" if r.get("ack_wait_s") else "acks recorded"
        lines.append(
            f"members: a group of {r['members']} handled {r['handled']:,}/{r['messages']:,} in "
            f"{r['seconds']} s ({r['msg_per_s']} msg/s), {r['twice']} twice; {acks}"
        )
    for r in work.get("scale", []):
        share = r["executor_cpu_share"]
        lines.append(
            f"scale {r['size']:,} on {r['cores']} executor cores: executors' share of the CPU "
            f"stamping {share['stamp']}, delivering {share['deliver']}; driver peak RSS "
            f"{r['driver_rss_peak_mb']:,} MB; last row {r['last_visible_after_instant_s']} s after "
            f"the instant (early {r['early']}, dup {r['duplicates']}, missing {r['missing']})"
        )
    idle = work.get("idle", [])
    for r in idle:
        wait = r.get("stamp_idle_wait_ms")  # (not recorded before it existed)
        lines.append(
            f"idle, delivery.idle_interval {r['idle_interval_ms']} ms"
            + ("" if wait is None else f", stamp.idle_wait {wait} ms")
            + f": driver {r['driver_cores']} of a core over {r['seconds']} s, "
            f"{r['delivery_batches']} delivery batches"
        )
    if len(idle) == 2 and idle[1]["driver_cores"]:
        ratio = idle[0]["driver_cores"] / idle[1]["driver_cores"]
        lines.append(f"idle: driver CPU as configured / both off: {ratio:.2f}")
    wake = work.get("wakeup")
    if wake:
        lines.append(
            f"wakeup: a waiting poll saw the commit {wake['noticed_ms_p50']} ms (p50), "
            f"{wake['noticed_ms_max']} ms (max) after it; returned the rows "
            f"{wake['wake_ms_p50']} ms (p50), {wake['wake_ms_p95']} ms (p95), "
            f"{wake['wake_ms_max']} ms (max) after it ({wake['returned']}/{wake['messages']})"
        )
    for r in work.get("restart", []):
        lines.append(
            f"restart with {r['backlog']:,} pending: first round {r['first_round_s']} s after "
            f"launch (session {r['session_s']} s), {r['delivered']:,}/{RESTART_DUE:,} visible "
            f"by {r['all_visible_s']} s (early {r['early']}, dup {r['duplicates']}, missing "
            f"{r['missing']}); exit {r['exit_code']}, peak RSS {r['peak_rss_mb']:,} MB"
        )
    for name, failed in results["workloads"].items():
        if isinstance(failed, dict) and "error" in failed:
            lines.append(f"{name}: failed: {failed['error'][:200]}")
    return "\n".join(lines)


def _succeeded(work: dict[str, Any]) -> dict[str, Any]:
    """The workloads that ran to the end (a failed one holds ``{"error": ...}``)."""
    return {k: v for k, v in work.items() if not (isinstance(v, dict) and "error" in v)}


def _n(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def chart(results: dict[str, Any], path: Path) -> None:
    """A PNG with a panel for each workload that ran and has a figure to draw: steady
    lateness by rate, backlog round time, spike, fan-out, aging, and the delayq commands'
    times (two panels a row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work = _succeeded(results["workloads"])
    panels = _panels(work)
    rows = max(1, math.ceil(len(panels) / 2))
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), squeeze=False)
    settings = results["settings"]
    fig.suptitle(
        f"delayq benchmark ({settings['mode']}, {settings['cpu_count']} cores, "
        f"{settings['started_utc']})"
    )
    places = [ax for row in axes for ax in row]
    for ax, draw in zip(places, panels, strict=False):
        draw(ax)
    for ax in places[len(panels) :]:
        ax.set_axis_off()
    if not panels:
        places[0].text(0.5, 0.5, "no workload with a chart ran", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _lateness_panel(ax: Any, runs: list[dict[str, Any]], x: str, label: str) -> None:
    xs = [r[x] for r in runs]
    for q in ("p50", "p95", "p99"):
        ax.plot(xs, [(r[f"late_{q}_ms"] or 0) / 1000 for r in runs], marker="o", label=q)
    ax.set_xlabel(label)
    ax.set_ylabel("lateness (s)")
    ax.legend()
    ax.grid(alpha=0.3)


def _panels(work: dict[str, Any]) -> list[Callable[[Any], None]]:
    """A drawing function for each panel the workloads in ``work`` have figures for."""
    panels: list[Callable[[Any], None]] = []

    def steady(ax: Any) -> None:
        _lateness_panel(ax, work["steady"], "rate_achieved", "achieved msg/s")
        ax.set_xscale("log")
        ax.set_title("steady: lateness by rate")

    def backlog(ax: Any) -> None:
        runs = work.get("backlog", [])
        xs = [max(r["backlog"], 1) for r in runs]
        rounds = [r["delivery"].get("round_mean_s") or 0 for r in runs]
        ax.plot(xs, rounds, marker="o", label="round mean (s)")
        late = [(r["late_p99_ms"] or 0) / 1000 for r in runs]
        ax.plot(xs, late, marker="o", label="lateness p99 (s)")
        restarts = work.get("restart", [])
        ax.plot(
            [max(r["backlog"], 1) for r in restarts],
            [r["first_round_s"] or 0 for r in restarts],
            marker="s",
            label="restart: launch to first round (s)",
        )
        ax.set_xscale("log")
        ax.set_xlabel("messages waiting days ahead")
        ax.set_title("backlog: flat is good")
        ax.legend()
        ax.grid(alpha=0.3)

    def spike(ax: Any) -> None:
        s = work["spike"]
        labels = ["spike: last row", "due +1 s: p50", "due +1 s: p99"]
        values = [
            s["last_visible_after_instant_s"] or 0,
            (s["after_1s"]["late_p50_ms"] or 0) / 1000,
            (s["after_1s"]["late_p99_ms"] or 0) / 1000,
        ]
        ax.bar(labels, values, color=["tab:red", "tab:blue", "tab:blue"])
        ax.set_ylabel("seconds after due")
        ax.set_title(f"spike: {s['size']:,} due at one instant")

    def fanout(ax: Any) -> None:
        _lateness_panel(ax, work["fanout"], "topics", "topics")
        ax.set_xscale("log")
        ax.set_title("fan-out: lateness by topic count")

    def aging_stages(ax: Any) -> None:
        runs = work["aging"]
        xs = [r["age_s"] for r in runs]
        for stage in ("scan", "topics", "commit"):
            ys = [r["delivery"].get("stage_mean_s", {}).get(stage, 0) * 1000 for r in runs]
            ax.plot(xs, ys, marker="o", label=f"round: {stage}")
        ys = [r["stamping"].get("stage_mean_s", {}).get("write", 0) * 1000 for r in runs]
        ax.plot(xs, ys, marker="s", label="stamping: write")
        ax.plot(xs, [r["send_mean_s"] * 1000 for r in runs], marker="^", label="send")
        ax.set_xlabel("engine age (s)")
        ax.set_ylabel("ms (mean)")
        ax.set_title("aging: flat is good")
        ax.legend()
        ax.grid(alpha=0.3)

    def aging_lateness(ax: Any) -> None:
        _lateness_panel(ax, work["aging"], "age_s", "engine age (s)")
        ax.set_title("aging: lateness")

    def cli(ax: Any) -> None:
        timed = {k: v for k, v in work["cli"].items() if k != "runs"}
        places = np.arange(len(timed))
        for offset, way, color in ((-0.2, "engine", "tab:green"), (0.2, "local", "tab:gray")):
            ax.bar(places + offset, [r.get(f"{way}_p50_s") or 0 for r in timed.values()], 0.4,
                   color=color, label=f"{way} p50")  # fmt: skip
            ax.scatter(places + offset, [r.get(f"{way}_p95_s") or 0 for r in timed.values()],
                       color="black", marker="_", s=200)  # fmt: skip
        ax.set_xticks(places, list(timed), rotation=45, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("seconds (bar p50, tick p95)")
        ax.set_title("delayq commands: through the running engine vs --local")
        ax.legend()

    def scale(ax: Any) -> None:
        runs = work["scale"]
        places = np.arange(len(runs))
        for offset, phase, color in ((-0.2, "stamp", "tab:blue"), (0.2, "deliver", "tab:green")):
            shares = [r["executor_cpu_share"][phase] or 0 for r in runs]
            ax.bar(places + offset, shares, 0.4, color=color, label=f"{phase}: executors' share")
        ax.axhline(0.8, color="black", linestyle="--", linewidth=1, label="target 0.8")
        ax.set_xticks(places, [f"{r['size']:,}" for r in runs])
        ax.set_ylim(0, 1)
        ax.set_xlabel("messages (backlog, then due at one instant)")
        ax.set_ylabel("executors' CPU / application's CPU")
        rss = ", ".join(f"{r['driver_rss_peak_mb']:,}" for r in runs)
        ax.set_title(f"scale on a cluster (driver peak RSS {rss} MB)")
        ax.legend()

    wanted = (
        ("steady", steady),
        ("backlog", backlog),
        ("restart", backlog),
        ("spike", spike),
        ("fanout", fanout),
        ("aging", aging_stages),
        ("aging", aging_lateness),
        ("cli", cli),
        ("scale", scale),
    )
    for name, draw in wanted:
        if work.get(name) and draw not in panels:
            panels.append(draw)
    return panels


WORKLOADS = (
    "steady",
    "ahead",
    "backlog",
    "restart",
    "spike",
    "fanout",
    "aging",
    "wakeup",
    "members",
    "kafka",
    "kafka_eos",
    "cli",
    "scale",
    "idle",
    "recurring",
    "smoothing",
)

__all__ = ["FULL", "PLANS", "QUICK", "WORKLOADS", "Bench", "BenchPlan", "chart", "table"]
