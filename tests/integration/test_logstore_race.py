"""Spark's commits and the log appender's race on one local table, and neither replaces the
other's: Spark's LogStore for ``file:`` (``delayq.fs.LinkLogStore``, build/jvm) creates a
commit put-if-absent with a hard link, as the appender does.

Delta's default there, HDFSLogStore, checks that a version is free and then renames over it:
an appender commit made in between vanishes, its rows and its ``txn`` with it, while the
appender reported it done. Hadoop checks once more inside the rename, so that window is a few
microseconds wide: the many-writers race below keeps the writers colliding on the same versions
and fails on any lost commit, but seldom catches HDFSLogStore in the act. The test after it
holds that window open (``strace`` delays the JVM's renames and links by seconds) and commits
into it, every time: HDFSLogStore loses the appender's commit there, the configured store
does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from engine.core.config import EngineConfig
from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.delta.log_append import ENGINE_INFO, LogAppender
from engine.lakehouse.storage.fs import jvm

pytestmark = pytest.mark.integration

#: Commits of each of the two Spark writers (DataFrame appends, SQL INSERTs).
SPARK_COMMITS = 5
#: Versions the sniping appender may take from under one Spark commit before it lets it
#: through (each one makes Spark's LogStore lose a version and write the next one).
SNIPES_PER_SPARK_COMMIT = 2
#: The steady appender's commits for each of Spark's (as many more as Spark lets it: Spark
#: reads every commit since its last checkpoint on each attempt, and an appender committing
#: at full speed leaves it ever more to read).
STEADY_PER_SPARK_COMMIT = 3
#: Pause between the steady appender's commits.
STEADY_PAUSE = 0.05
#: Each writer's rows: its base plus the txn version of the commit (one row a commit).
BASES = {"spark-df": 1_000_000, "spark-sql": 2_000_000, "steady": 3_000_000, "sniper": 4_000_000}
#: A commit Delta's LogStores (HDFSLogStore, delayq's) are writing: the whole entry, in a
#: temporary file beside its version's name, not yet in place.
IN_FLIGHT = re.compile(r"^\.(\d{20})\.json\.[^.]+\.tmp$")


def test_spark_and_the_log_appender_racing_on_a_local_table_lose_no_commit(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    path = str(Path(cfg.lakehouse) / "race")
    spark.sql(f"CREATE TABLE delta.`{path}` (id BIGINT, writer STRING) USING delta")
    committed: dict[str, list[int]] = {name: [] for name in BASES}  # txn versions reported
    sniped: list[int] = []  # versions the sniper took while Spark was writing them
    spark_done = threading.Event()
    failures: list[BaseException] = []

    def guarded(work: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                work()
            except BaseException as err:  # raised again in the test's thread
                failures.append(err)
                spark_done.set()

        return threading.Thread(target=run)

    def spark_progress() -> int:
        return len(committed["spark-df"]) + len(committed["spark-sql"])

    sparks = [
        guarded(lambda: _spark_appends(spark, path, committed["spark-df"])),
        guarded(lambda: _spark_inserts(spark, path, committed["spark-sql"])),
    ]
    # One appender for the two threads, as the engine keeps one a table (callers lock).
    appender, lock = LogAppender(path), threading.Lock()
    appenders = [
        guarded(
            lambda: _steady_appends(appender, lock, committed["steady"], spark_done, spark_progress)
        ),
        guarded(
            lambda: _snipes(appender, lock, committed["sniper"], sniped, spark_done, spark_progress)
        ),
    ]
    for thread in appenders + sparks:
        thread.start()
    for thread in sparks:
        thread.join()
    spark_done.set()
    for thread in appenders:
        thread.join()
    if failures:
        raise failures[0]

    # Every version is there, each one writer's commit of one row under its one txn.
    log_dir = Path(path) / "_delta_log"
    versions = sorted(int(p.name[:20]) for p in log_dir.glob("*.json"))
    assert versions == list(range(len(versions)))
    assert not [p.name for p in log_dir.iterdir() if p.name.startswith(".") and "tmp" in p.name]
    recorded: dict[tuple[str, int], int] = {}
    spark_versions = []
    spark_reads: dict[int, int] = {}  # Spark's commits: the version each transaction read
    for version in versions[1:]:
        actions = _actions(log_dir / f"{version:020d}.json")
        (txn,) = actions["txn"]
        key = (txn["appId"], int(txn["version"]))
        assert key not in recorded, f"{key} committed at versions {recorded[key]} and {version}"
        recorded[key] = version
        (add,) = actions["add"]
        assert json.loads(add["stats"])["minValues"]["id"] == BASES[key[0]] + key[1], version
        (info,) = actions["commitInfo"]
        assert (info.get("engineInfo") == ENGINE_INFO) != key[0].startswith("spark"), info
        if key[0].startswith("spark"):
            spark_versions.append(version)
            spark_reads[version] = int(info["readVersion"])
    reported = {(name, v) for name, done in committed.items() for v in done}
    lost = sorted(reported - set(recorded))
    assert not lost, f"reported committed, not in the log: {lost} (sniped versions: {sniped})"
    assert set(recorded) == reported, "a commit nobody reported"
    assert len(committed["spark-df"]) == len(committed["spark-sql"]) == SPARK_COMMITS

    # The race was real: the appenders committed between Spark's commits throughout (Spark's
    # two writers often commit back to back) and took versions Spark's transactions were
    # about to commit. (Where an fsync takes a while, the sniper also takes some of the very
    # versions Spark's LogStore is writing, but not on every disk: not asserted.)
    theirs = set(spark_versions)
    after_appends = [v for v in theirs if v - 1 not in theirs and v > 1]
    assert len(after_appends) >= SPARK_COMMITS // 2, f"hardly interleaved: {spark_versions}"
    moved_on = [v for v, read in spark_reads.items() if read < v - 1]
    assert len(moved_on) >= SPARK_COMMITS, f"Spark's reads and commits: {spark_reads}"

    # Spark and delta-rs read the same rows: each reported commit's, once.
    expected = sorted(BASES[name] + v for name, v in reported)
    by_spark = sorted(r.id for r in spark.read.format("delta").load(path).select("id").collect())
    by_delta_rs = DeltaTable(path).to_pyarrow_table(columns=["id"])["id"].to_pylist()
    assert by_spark == expected
    assert sorted(by_delta_rs) == expected


#: Syscalls that put a file in place (rename, link), by machine: their numbers, as
#: ``/proc/<tid>/syscall`` shows the call a thread is in.
PLACING = {"x86_64": {82, 86, 264, 265, 316}, "aarch64": {37, 38, 276}}
#: How long ``strace`` holds each of them (microseconds): the window the test commits in.
HELD_US = 3_000_000


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (in the machine image)")
@pytest.mark.parametrize("store", ["configured", "io.delta.storage.HDFSLogStore"])
def test_a_commit_landing_while_spark_puts_its_own_in_place_is_never_replaced(
    spark: SparkSession, cfg: EngineConfig, store: str
) -> None:
    """The appender commits version 1 while a Spark LogStore, which found it free, is inside
    the call that puts its own version 1 in place. The store the session gives the table
    refuses its commit there (Delta would retry it as version 2), and the appender's stays;
    Delta's HDFSLogStore, as a control, renames over it every time: the window is real and
    this test catches a store that lets it through."""
    assert platform.machine() in PLACING, platform.machine()
    path = str(Path(cfg.lakehouse) / "held")
    spark.sql(f"CREATE TABLE delta.`{path}` (id BIGINT, writer STRING) USING delta")
    view = jvm(spark)
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    lines = view.java.util.ArrayList()
    lines.add(json.dumps({"commitInfo": {"timestamp": 1, "operation": "WRITE", "txnId": "t-1"}}))
    if store == "configured":  # Delta's Scala LogStore, over the class Spark is set up with
        log = view.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path)
        logstore, conf = log.store(), log.newDeltaHadoopConf()
        actions = view.scala.jdk.javaapi.CollectionConverters.asScala(lines.iterator())
    else:  # a Java LogStore
        logstore, actions = view.io.delta.storage.HDFSLogStore(conf), lines.iterator()
    target = Path(path, "_delta_log", f"{1:020d}.json")
    appender = LogAppender(path)
    staged = appender.stage(_row("sniper", 1), txn=Txn("sniper", 1))
    outcome: dict[str, str] = {}

    def spark_commit() -> None:
        entry = view.org.apache.hadoop.fs.Path(target.as_uri())
        try:
            logstore.write(entry, actions, False, conf)
            outcome["spark"] = "written"
        except Exception as err:  # py4j's error: the Java exception's class is in its text
            outcome["spark"] = "refused" if "FileAlreadyExistsException" in str(err) else str(err)

    pid = int(view.java.lang.ProcessHandle.current().pid())
    with _held_placing(pid):
        writer = threading.Thread(target=spark_commit)
        writer.start()
        placing = _placing_thread(pid, writer, target.parent)
        assert placing is not None, f"the LogStore never put version 1 in place: {outcome}"
        assert staged is not None and appender.commit(staged), "version 1 was taken"
        assert appender.version == 1
        writer.join()

    first = _actions(target)
    if store == "configured":
        assert outcome["spark"] == "refused"
        assert [(t["appId"], t["version"]) for t in first["txn"]] == [("sniper", 1)]
    else:  # the control: Spark's write reported done over the appender's reported commit
        assert outcome["spark"] == "written"
        assert "txn" not in first, "HDFSLogStore kept the appender's commit: no window held"


def test_a_commit_written_again_after_a_lost_answer_counts_and_another_is_refused(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    """The LogStore Spark uses for the table: a version that already holds exactly the
    commit being written, naming the same transaction (``commitInfo.txnId``), is that
    write's own (a retry after its answer was lost, as on NFS); one that holds another
    commit, or the same bytes naming no transaction, is refused, and left as it was."""
    path = str(Path(cfg.lakehouse) / "retried")
    spark.sql(f"CREATE TABLE delta.`{path}` (id BIGINT) USING delta")
    view = jvm(spark)
    delta_log = view.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path)

    def write(
        user_metadata: str, txn_id: str | None = "3f6c2a9e-txn-ours", version: int = 1
    ) -> None:
        entry = view.org.apache.hadoop.fs.Path(
            Path(path, "_delta_log", f"{version:020d}.json").as_uri()
        )
        info = {"timestamp": 1, "operation": "WRITE", "userMetadata": user_metadata}
        line = json.dumps({"commitInfo": info | ({"txnId": txn_id} if txn_id else {})})
        lines = view.java.util.ArrayList()
        lines.add(line)
        actions = view.scala.jdk.javaapi.CollectionConverters.asScala(lines.iterator())
        delta_log.store().write(entry, actions, False, delta_log.newDeltaHadoopConf())

    write("ours")
    write("ours")  # the same bytes again: counted as done
    with pytest.raises(Exception) as refused:
        write("theirs")
    # the exception Delta retries on must be the one thrown, not only a cause in the trace
    java = getattr(refused.value, "java_exception", None)
    assert java is not None, refused.value
    assert java.getClass().getName() == "java.nio.file.FileAlreadyExistsException", java
    write("anonymous", txn_id=None, version=2)
    with pytest.raises(Exception, match="FileAlreadyExistsException"):
        write("anonymous", txn_id=None, version=2)  # alike, but no transaction says whose
    # A checksum left by an earlier writer of a version is gone once the version is written
    # (the end state only: that it goes before the name appears is not observed here).
    stale = Path(path, "_delta_log", f".{3:020d}.json.crc")
    stale.write_bytes(b"crc\x00\x00\x00\x02\x00\x00\x00\x00")
    write("after a stale checksum", version=3)
    assert not stale.exists()  # or Hadoop's local filesystem fails every read of version 3
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").where("version in (1, 3)").collect()
    assert sorted(h.userMetadata for h in history) == ["after a stale checksum", "ours"]


def test_checkpoints_are_put_in_place_and_their_pointer_replaced(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    """What the LogStore writes over (``_last_checkpoint``) is replaced whole, and the
    checkpoints Spark writes beside it are read back by Spark and delta-rs."""
    path = str(Path(cfg.lakehouse) / "checkpointed")
    spark.sql(f"CREATE TABLE delta.`{path}` (id BIGINT) USING delta")
    delta_log = jvm(spark).org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path)
    pointer = Path(path, "_delta_log", "_last_checkpoint")
    for version in (1, 2):
        spark.range(version, version + 1).write.format("delta").mode("append").save(path)
        delta_log.checkpoint()
        assert json.loads(pointer.read_text())["version"] == version
    assert Path(path, "_delta_log", f"{2:020d}.checkpoint.parquet").is_file()
    assert sorted(r.id for r in spark.read.format("delta").load(path).collect()) == [1, 2]
    assert sorted(DeltaTable(path).to_pyarrow_table()["id"].to_pylist()) == [1, 2]


def _spark_appends(spark: SparkSession, path: str, done: list[int]) -> None:
    """DataFrame appends with Delta's ``txnAppId``/``txnVersion`` options."""
    for version in range(1, SPARK_COMMITS + 1):
        row = BASES["spark-df"] + version
        frame = spark.range(row, row + 1, numPartitions=1).selectExpr("id", "'spark-df' AS writer")
        frame.write.format("delta").option("txnAppId", "spark-df").option(
            "txnVersion", version
        ).mode("append").save(path)
        done.append(version)


def _spark_inserts(spark: SparkSession, path: str, done: list[int]) -> None:
    """SQL INSERTs, their txn in the SQL settings of a session of their own."""
    session = spark.newSession()
    session.conf.set("spark.databricks.delta.write.txnAppId", "spark-sql")
    for version in range(1, SPARK_COMMITS + 1):
        session.conf.set("spark.databricks.delta.write.txnVersion", str(version))
        session.sql(
            f"INSERT INTO delta.`{path}` VALUES ({BASES['spark-sql'] + version}, 'spark-sql')"
        )
        done.append(version)


def _steady_appends(
    appender: LogAppender,
    lock: threading.Lock,
    done: list[int],
    stop: threading.Event,
    spark_progress: Callable[[], int],
) -> None:
    """Appends at a steady pace, as a delivery round's or a producer's."""
    version = 0
    while not stop.is_set():
        if version >= STEADY_PER_SPARK_COMMIT * (spark_progress() + 1):
            time.sleep(0.01)
            continue
        version += 1
        with lock:
            assert appender.append(_row("steady", version), txn=Txn("steady", version))
        done.append(version)
        time.sleep(STEADY_PAUSE)


def _snipes(
    appender: LogAppender,
    lock: threading.Lock,
    done: list[int],
    sniped: list[int],
    stop: threading.Event,
    spark_progress: Callable[[], int],
) -> None:
    """Appends timed to collide with Spark's: each time Spark's LogStore has written a commit
    beside its version's name, commit that version first (a few times a Spark commit, so
    that Spark keeps committing). Staged beforehand: the commit is one log entry."""
    log_dir = Path(appender.path) / "_delta_log"
    version = 1
    with lock:
        staged = appender.stage(_row("sniper", version), txn=Txn("sniper", version))
    seen_progress, fired = spark_progress(), 0
    while not stop.is_set():
        if spark_progress() != seen_progress:
            seen_progress, fired = spark_progress(), 0
        target = _in_flight(log_dir) if fired < SNIPES_PER_SPARK_COMMIT else None
        if target is None:
            time.sleep(0.0005)
            continue
        with lock:
            assert staged is not None and appender.commit(staged)
            if appender.version == target:
                sniped.append(target)
            done.append(version)
            version += 1
            staged = appender.stage(_row("sniper", version), txn=Txn("sniper", version))
        fired += 1


def _in_flight(log_dir: Path) -> int | None:
    """The version of a commit Spark's LogStore has written whole but not yet put in place."""
    for name in os.listdir(log_dir):
        found = IN_FLIGHT.match(name)
        if found:
            try:
                if os.stat(log_dir / name).st_size > 0:
                    return int(found.group(1))
            except FileNotFoundError:
                pass  # put in place (or given up) meanwhile
    return None


def _row(writer: str, version: int) -> pa.Table:
    return pa.table({"id": pa.array([BASES[writer] + version], pa.int64()), "writer": [writer]})


def _actions(entry: Path) -> dict[str, list[dict[str, Any]]]:
    """A commit's actions, by kind."""
    actions: dict[str, list[dict[str, Any]]] = {}
    for line in entry.read_text().splitlines():
        for kind, action in json.loads(line).items():
            actions.setdefault(kind, []).append(action)
    return actions


@contextlib.contextmanager
def _held_placing(pid: int) -> Iterator[None]:
    """``strace`` attached to the process ``pid`` (every thread), holding each of its renames
    and links :data:`HELD_US` before it runs; detached on exit."""
    calls = "rename,renameat,renameat2,link,linkat"
    inject = f"inject={calls}:delay_enter={HELD_US}"
    command = ["strace", "-f", "-qq", "-o", "/dev/null", "-p", str(pid), "-e", f"trace={calls}"]
    tracer = subprocess.Popen([*command, "-e", inject], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not _all_traced(pid, tracer.pid):
            assert tracer.poll() is None, tracer.communicate()[1].decode()
            assert time.monotonic() < deadline, "strace did not attach to every thread"
            time.sleep(0.05)
        yield
    finally:
        tracer.terminate()
        tracer.wait(timeout=30)


def _all_traced(pid: int, tracer: int) -> bool:
    """Whether every thread of ``pid`` is traced by ``tracer``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # ended meanwhile
        if f"TracerPid:\t{tracer}\n" not in status:
            return False
    return True


def _placing_thread(pid: int, writer: threading.Thread, log_dir: Path) -> str | None:
    """The thread of ``pid`` held inside a rename or link (seen there twice in a row) while
    version 1's commit waits whole beside its name, once one is; None if ``writer`` ends
    first."""
    numbers = PLACING[platform.machine()]
    seen: str | None = None
    while writer.is_alive():
        held = None
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                call = Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()[0]
            except (OSError, IndexError):
                continue
            if call.isdigit() and int(call) in numbers:
                held = tid
        if held is not None and held == seen and _in_flight(log_dir) == 1:
            return held
        seen = held
        time.sleep(0.05)
    return None
