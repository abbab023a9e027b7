"""Shared fixtures: one Delta-enabled Spark session, a temporary lakehouse, a fake clock.

Tiers come from the folder, so a new file cannot land in the wrong one: ``unit/`` needs no
JVM (``make test-quick``; a unit test asking for ``spark`` is refused at collection),
``integration/`` and ``e2e/`` are marked ``integration``. The whole run is timed against the
suite's budget: a warning line past ``DELAYQ_SUITE_WARN_MINUTES`` (25) and a failure past
``DELAYQ_SUITE_FAIL_MINUTES`` (60), so no change creeps toward CI's 90 minutes unnoticed.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.core.levels import parse_levels
from engine.lakehouse.catalog.session import build_spark
from engine.run.report import LOG_DIR_ENV
from jobs.tools.objectstore import Server
from tests.support.lakehouse import START, TEST_SPARK_CONF
from tests.support.objectstore import s3_cfg, s3_server

TESTS = Path(__file__).parent
#: Every JVM the suite starts (its Spark, each ``delayq`` / ``spark-submit`` process, a
#: cluster's daemons) compiles with C1 only. A test's JVM lives seconds to minutes on small
#: data, where the C2 compiler's threads cost two cores more than its code ever saves: the
#: same Spark start and five small Delta appends took 16-19 CPU-s instead of 31-41.
#: A setting of the JIT alone: what the code does is the same. C1 alone keeps the client
#: VM's 48 MB code cache, which the suite's long-lived Spark fills ("CodeCache is full.
#: Compiler has been disabled": everything after runs interpreted): the tiered default back.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
for _variable in ("SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS", "SPARK_EXECUTOR_OPTS"):
    os.environ.setdefault(_variable, TEST_JVM_OPTIONS)
#: Fixtures that start a JVM: a unit test may use none of them.
JVM_FIXTURES = frozenset({"spark", "s3", "any_cfg", "kafka", "cluster"})
_started = time.monotonic()


def _tier(item: pytest.Item) -> str:
    try:
        return item.path.relative_to(TESTS).parts[0]
    except ValueError:  # a doctest or a file outside tests/
        return "unit"


#: The longest files, longest first: they start first, so that on two workers (`make test`
#: runs ``--dist loadfile --no-loadscope-reorder``) the short ones fill in at the end. Keep it
#: to the top of the suite's ``--durations`` list.
LONGEST_FILES = (
    "e2e/test_readme.py",
    "e2e/test_process.py",
    "integration/test_kafka.py",
    "e2e/test_cluster.py",
    "e2e/test_sql.py",
    "integration/test_consumer.py",
    "e2e/test_streaming_kill.py",
    "integration/test_stamp.py",
    "integration/test_delivery.py",
    "integration/test_control.py",
    "integration/test_commands.py",
    "e2e/test_bench.py",
    "integration/test_readers.py",
    "e2e/test_notebook.py",
)


def _longest_first(item: pytest.Item) -> int:
    name = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
    return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``integration/`` and ``e2e/`` tests; refuse a unit test that starts a JVM; put
    the longest files first (a stable sort: each file keeps its own order)."""
    items.sort(key=_longest_first)
    for item in items:
        tier = _tier(item)
        if tier in ("integration", "e2e"):
            item.add_marker(pytest.mark.integration)
        elif tier == "unit":
            needs = JVM_FIXTURES & set(getattr(item, "fixturenames", ()))
            if needs:
                raise pytest.UsageError(
                    f"{item.nodeid} is in tests/unit/ but uses {sorted(needs)}: "
                    "move it to tests/integration/ (unit tests run without a JVM)"
                )


def _budget(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def pytest_sessionstart(session: pytest.Session) -> None:
    global _started
    _started = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Say how long the tests took against the suite's budget; fail a run past the limit."""
    minutes = (time.monotonic() - _started) / 60
    warn = _budget("DELAYQ_SUITE_WARN_MINUTES", 25)
    fail = _budget("DELAYQ_SUITE_FAIL_MINUTES", 60)
    if minutes > fail:
        terminalreporter.write_line(
            f"error: the tests took {minutes:.1f} min, over the suite's limit of {fail:.0f} min "
            "(CI allows 90 in all): make the slowest tests above faster",
            red=True,
        )
    elif minutes > warn:
        terminalreporter.write_line(
            f"warning: the tests took {minutes:.1f} min, over the suite's budget of {warn:.0f} "
            "min: make the slowest tests above faster before adding more",
            yellow=True,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    minutes = (time.monotonic() - _started) / 60
    if minutes > _budget("DELAYQ_SUITE_FAIL_MINUTES", 60) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def _log_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Log files of the run's programs (and their child processes) in the run's temp folder."""
    os.environ[LOG_DIR_ENV] = str(tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    """The one Spark session of the test run (local[2], Delta enabled)."""
    base = EngineConfig(
        lakehouse=str(tmp_path_factory.mktemp("session-lakehouse")),
        register_tables=False,
        log_level="ERROR",
        spark_conf=TEST_SPARK_CONF,
    )
    session = build_spark(base)
    yield session
    session.stop()


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when a test says so."""
    return FakeClock(START)


@pytest.fixture
def make_cfg(tmp_path: pytest.TempPathFactory) -> object:
    """Factory for configs on a fresh lakehouse with compressed levels ``1s 2s 3s``."""

    def make(levels: str = "1s 2s 3s", **changes: object) -> EngineConfig:
        settings: dict[str, object] = {
            "lakehouse": str(tmp_path / "lakehouse"),  # type: ignore[operator]
            "database": f"t_{uuid.uuid4().hex[:8]}",
            "levels": parse_levels(levels),
            "register_tables": False,
            "log_level": "ERROR",
            "spark_conf": TEST_SPARK_CONF,
            # In-process engines are stepped by hand (Engine.step, run_available): the
            # batches and rounds the driver path runs are the code the queries' small
            # batches and rounds run, without a streaming query's start and stop per step
            # (3x the test time). The queries themselves (the default) are tested by
            # test_streaming_stages.py and by every engine process (tests/support/process.py
            # passes no mode), the kill tests included.
            "stamp_mode": "driver",
            "delivery_mode": "driver",
        }
        settings.update(changes)
        return EngineConfig(**settings)  # type: ignore[arg-type]

    return make


@pytest.fixture
def cfg(make_cfg: object) -> EngineConfig:
    """A config on a fresh lakehouse with levels ``1s 2s 3s``."""
    return make_cfg()  # type: ignore[operator, no-any-return]


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real S3 server (S3Proxy) for the run's tests (each takes buckets of its own)."""
    yield from s3_server(tmp_path_factory)


@pytest.fixture(params=["local", "s3"])
def any_cfg(request: pytest.FixtureRequest, make_cfg: object, s3: Server) -> EngineConfig:
    """A fresh lakehouse (levels ``1s 2s 3s``) in a local folder, then in an S3 bucket."""
    if request.param == "local":
        return make_cfg()  # type: ignore[operator, no-any-return]
    return s3_cfg(make_cfg, s3)
