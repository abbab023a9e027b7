"""The embedded metastore: where names are kept, and what a session does when another
process has the metastore open (Derby opens it in one process at a time)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.core.config import EngineConfig
from engine.lakehouse.catalog import metastore
from engine.lakehouse.catalog.metastore import catalog_conf, holder, metastore_path
from tests.support.choosing import choose_together

REPO = Path(__file__).parents[2]
LOCK_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)  # what Derby's FileChannel.tryLock takes, on Linux
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def cfg(tmp_path: Path) -> EngineConfig:
    return EngineConfig(lakehouse=str(tmp_path / "lakehouse"))


@pytest.fixture
def held(cfg: EngineConfig) -> Iterator[int]:
    """The metastore's lock file held by another process, as a running engine holds it."""
    folder = metastore_path(cfg)
    folder.mkdir(parents=True)
    other = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LOCK_HOLDER), str(folder / "dbex.lck")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "locked"
        yield other.pid
    finally:
        other.kill()
        other.wait()


@pytest.fixture(autouse=True)
def _release_claims(cfg: EngineConfig) -> Iterator[None]:
    yield
    metastore._release(metastore_path(cfg).parent)


def test_names_are_kept_in_the_lakehouse_by_default(cfg: EngineConfig) -> None:
    conf = catalog_conf(cfg)
    assert conf["spark.sql.catalogImplementation"] == "hive"
    where = f"{cfg.lakehouse_path}/_metastore/db"
    assert conf["spark.hadoop.javax.jdo.option.ConnectionURL"] == (
        f"jdbc:derby:;databaseName={where};create=true"
    )
    assert conf["spark.sql.warehouse.dir"] == f"{cfg.lakehouse_path}/_warehouse"


def test_memory_and_spark_catalogs(cfg: EngineConfig) -> None:
    memory = catalog_conf(cfg.with_overrides(sql_catalog="memory"))
    assert memory["spark.sql.catalogImplementation"] == "in-memory"
    assert catalog_conf(cfg.with_overrides(sql_catalog="spark")) == {}  # the user's own


def test_the_process_holding_the_metastore_is_found_without_taking_the_lock(
    cfg: EngineConfig, held: int
) -> None:
    assert holder(metastore_path(cfg)) == held
    assert holder(metastore_path(cfg)) == held  # asking twice changes nothing


def test_a_free_or_missing_metastore_has_no_holder(cfg: EngineConfig) -> None:
    assert holder(metastore_path(cfg)) is None
    metastore_path(cfg).mkdir(parents=True)
    (metastore_path(cfg) / "dbex.lck").write_text("")  # left behind by a stopped process
    assert holder(metastore_path(cfg)) is None


def test_a_session_beside_the_holder_names_tables_in_memory_and_says_why(
    cfg: EngineConfig, held: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        conf = catalog_conf(cfg)
    assert conf["spark.sql.catalogImplementation"] == "in-memory"
    assert f"in use by process {held}" in caplog.text
    assert "sql.server.enabled" in caplog.text


def test_two_processes_starting_together_cannot_both_choose_the_metastore(
    cfg: EngineConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # this process and another ask at once: each goes on from its claim (taken or refused)
    # to its choice only once the other has claimed too, then each asks again
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    args = [sys.executable, "-m", "tests.support.choosing", cfg.lakehouse, str(meeting)]
    other = subprocess.Popen(
        [*args, "other", "this"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING):
            here = choose_together(cfg, meeting, "this", "other")
    finally:
        out, err = other.communicate(timeout=120)
    assert other.returncode == 0, err[-2000:]
    assert {"claimed-this", "claimed-other"} <= {f.name for f in meeting.iterdir()}
    there = tuple(out.split())
    # one chose the metastore and, asked again, keeps it; the other names tables in memory,
    # asked again too (while the first still runs)
    assert sorted([here, there]) == [("hive", "hive"), ("in-memory", "in-memory")], (here, there)
    said = caplog.text if here[0] == "in-memory" else err
    assert "in use by another process" in said
