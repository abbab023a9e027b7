"""The Sparks delayq starts map the class archive `make jars` wrote (a quicker start)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from engine.lakehouse.catalog.session import CLASS_ARCHIVE, REPO_ROOT

pytestmark = pytest.mark.integration


def test_a_sessions_driver_maps_the_class_archive(spark: SparkSession) -> None:
    archive = (REPO_ROOT / ".jars" / CLASS_ARCHIVE).resolve()
    assert archive.is_file(), f"make jars writes {archive} (see .jars/class-archive.log)"
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    arguments = list(
        jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()
    )
    assert f"-XX:SharedArchiveFile={archive}" in arguments
    # The archive holds for this driver's class path: with -Xshare:on a JVM that cannot map
    # it refuses to start (the drivers run with -Xshare:auto, and would start slower).
    classpath = jvm.java.lang.System.getProperty("java.class.path")
    java = str(Path(jvm.java.lang.System.getProperty("java.home")) / "bin" / "java")
    done = subprocess.run(
        [java, "-Xshare:on", f"-XX:SharedArchiveFile={archive}", "-cp", classpath, "-version"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
