"""Files through Hadoop's FileSystem, so the same code serves local disks, HDFS and S3.

Example:
    >>> read_text(spark, "/lake/_checkpoints/stamp/metadata")  # doctest: +SKIP
    '{"id":"4c1b..."}'
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import uuid
from typing import Any
from urllib.parse import urlparse

from pyspark.sql import SparkSession

from engine.core.errors import SetupError


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


def local_path(location: str) -> str | None:
    """The path on this machine's filesystem of a plain path or ``file:`` URI, else ``None``.

    Example:
        >>> local_path("file:///lake/x"), local_path("/lake/x"), local_path("s3a://b/x")
        ('/lake/x', '/lake/x', None)
    """
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return parsed.path
    return location if parsed.scheme == "" else None


def put_if_absent(spark: SparkSession, location: str, data: bytes) -> bool:
    """Create the file ``location`` holding ``data``, unless it exists; whether it did.

    Atomic: of writers racing for one name exactly one creates it, and a reader sees the
    file whole or not at all. The data goes to a hidden temporary file that is then
    hard-linked to its name (``link`` fails when the name exists), or, on a filesystem
    without hard links, renamed with ``RENAME_NOREPLACE``.

    Example:
        >>> put_if_absent(spark, "/lake/_engine/lease/00000000000000000001.json", b"{}")
        ... # doctest: +SKIP
        True

    Raises:
        SetupError: ``location`` is not on this machine's filesystem (object stores are not
            supported yet), or the filesystem can neither link nor rename without replacing.
    """
    local = local_path(location)
    if local is None:
        raise SetupError(
            f"{location}: only a local folder (or file:// URI) can hold the lakehouse for now"
        )
    folder = os.path.dirname(local)
    os.makedirs(folder, exist_ok=True)
    temp = os.path.join(folder, f".tmp-{uuid.uuid4().hex}")
    with open(temp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    try:
        os.link(temp, local)
        return True
    except FileExistsError:
        return False
    except OSError as err:
        if err.errno not in _NO_LINKS:
            raise
        return _rename_noreplace(temp, local)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


#: What ``link`` says on a filesystem without hard links.
_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _rename_noreplace(temp: str, final: str) -> bool:
    """``renameat2(temp, final, RENAME_NOREPLACE)``; whether it renamed (False: exists)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        done = renameat2(
            _AT_FDCWD, os.fsencode(temp), _AT_FDCWD, os.fsencode(final), _RENAME_NOREPLACE
        )
        if done == 0:
            return True
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            return False
        if code not in (errno.EINVAL, errno.ENOSYS, *_NO_LINKS):
            raise OSError(code, os.strerror(code), final)
    raise SetupError(
        f"{os.path.dirname(final)}: this filesystem can neither make hard links nor rename "
        "without replacing, which the lakehouse's lease and delayOffset log need"
    )


def write_text(spark: SparkSession, location: str, text: str) -> None:
    """Write a small file whole, replacing it (a reader sees the old text or the new)."""
    local = local_path(location)
    if local is not None:
        os.makedirs(os.path.dirname(local), exist_ok=True)
        temp = os.path.join(os.path.dirname(local), f".tmp-{uuid.uuid4().hex}")
        with open(temp, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temp, local)
        return
    path, fs = hadoop_path(spark, location)
    stream = fs.create(path, True)  # an object store's PUT replaces the object whole
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()


def stream_query_id(spark: SparkSession, checkpoint: str) -> str:
    """The id of the streaming query that owns ``checkpoint`` (kept across restarts).

    A new checkpoint means a new id: batch ids start again from 0 there, so writes made
    idempotent per batch id name their ``txnAppId`` after this id, not after the query.
    """
    text = read_text(spark, f"{checkpoint}/metadata")
    if text is None:
        raise FileNotFoundError(f"{checkpoint}/metadata: the query has not started")
    return str(json.loads(text.splitlines()[0])["id"])
