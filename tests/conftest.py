"""Shared fixtures: one Delta-enabled Spark session, a temporary lakehouse, a fake clock."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.core.levels import parse_levels
from engine.lakehouse.session import build_spark
from engine.run.report import LOG_DIR_ENV
from jobs.tools.objectstore import Server
from tests.support.lakehouse import START, TEST_SPARK_CONF
from tests.support.objectstore import s3_cfg, s3_server


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
        }
        settings.update(changes)
        return EngineConfig(**settings)  # type: ignore[arg-type]

    return make


@pytest.fixture
def cfg(make_cfg: object) -> EngineConfig:
    """A config on a fresh lakehouse with levels ``1s 2s 3s``."""
    return make_cfg()  # type: ignore[operator, no-any-return]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real S3 server (S3Proxy) for the module's tests."""
    yield from s3_server(tmp_path_factory)


@pytest.fixture(params=["local", "s3"])
def any_cfg(request: pytest.FixtureRequest, make_cfg: object, s3: Server) -> EngineConfig:
    """A fresh lakehouse (levels ``1s 2s 3s``) in a local folder, then in an S3 bucket."""
    if request.param == "local":
        return make_cfg()  # type: ignore[operator, no-any-return]
    return s3_cfg(make_cfg, s3)
