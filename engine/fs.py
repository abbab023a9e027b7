"""Files through Hadoop's FileSystem, so the same code serves local disks, HDFS and S3."""

from __future__ import annotations

from typing import Any

from pyspark.sql import SparkSession


def jvm(spark: SparkSession) -> Any:
    """The session's JVM view (classic Spark; Spark Connect has none)."""
    view = spark.sparkContext._jvm
    assert view is not None, "the Spark session has no JVM (Spark Connect is not supported)"
    return view


def hadoop_path(spark: SparkSession, location: str) -> tuple[Any, Any]:
    """A Hadoop ``Path`` for ``location`` and its ``FileSystem``."""
    path = jvm(spark).org.apache.hadoop.fs.Path(location)
    return path, path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
