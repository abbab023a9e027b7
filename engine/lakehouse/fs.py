"""Files through Hadoop's FileSystem, so the same code serves local disks, HDFS and S3.

Example:
    >>> read_text(spark, "/lake/_checkpoints/stamp/metadata")  # doctest: +SKIP
    '{"id":"4c1b..."}'
"""

from __future__ import annotations

import json
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


def read_lines(view: Any, fs: Any, path: Any) -> list[str]:
    """The lines of a small text file (``path`` a Hadoop ``Path`` on ``fs``)."""
    stream = fs.open(path)
    try:
        reader = view.java.io.BufferedReader(view.java.io.InputStreamReader(stream, "UTF-8"))
        lines = []
        while (line := reader.readLine()) is not None:
            lines.append(line)
        return lines
    finally:
        stream.close()


def read_text(spark: SparkSession, location: str) -> str | None:
    """The whole text of a small file, or ``None`` when it does not exist."""
    path, fs = hadoop_path(spark, location)
    if not fs.exists(path):
        return None
    return "\n".join(read_lines(jvm(spark), fs, path))


def list_files(spark: SparkSession, folder: str, suffix: str = "") -> list[str]:
    """Names of the visible files in ``folder`` ending with ``suffix`` (any filesystem)."""
    path, fs = hadoop_path(spark, folder)
    if not fs.exists(path):
        return []
    return sorted(
        name
        for status in fs.listStatus(path)
        if status.isFile()
        and (name := status.getPath().getName()).endswith(suffix)
        and not name.startswith((".", "_"))
    )


def stream_query_id(spark: SparkSession, checkpoint: str) -> str:
    """The id of the streaming query that owns ``checkpoint`` (kept across restarts).

    A new checkpoint means a new id: batch ids start again from 0 there, so writes made
    idempotent per batch id name their ``txnAppId`` after this id, not after the query.
    """
    text = read_text(spark, f"{checkpoint}/metadata")
    if text is None:
        raise FileNotFoundError(f"{checkpoint}/metadata: the query has not started")
    return str(json.loads(text.splitlines()[0])["id"])
