"""Where the lakehouse's files live: a local folder or an S3 bucket, behind one small API.

Every file the engine reads or writes outside Spark goes through a :class:`Store`: the
Delta log entries its appenders commit and its readers follow, the data files they write,
the delayOffset log, stamping's plans, the lease and the engine's address files. A store
knows the one operation the exactly-once protocol rests on, :meth:`Store.create`:
put-if-absent, of writers racing for one name exactly one wins, and a reader sees the file
whole or not at all. A local folder does it with a hard link (or ``renameat2`` with
``RENAME_NOREPLACE``); S3 with a conditional ``PUT`` (``If-None-Match: *``), which Amazon S3
and S3-compatible servers such as S3Proxy honour.

A location is what :class:`~engine.lakehouse.storage.layout.Layout` gives: a local path, a
``file:`` URI, or ``s3a://bucket/key`` (Spark's scheme; ``s3://`` is taken too).
:func:`engine.lakehouse.storage.location.store_for` says which store holds a location.

Example:
    >>> LocalStore().exists("/nowhere/at/all")
    False
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import DeltaTable

from engine.core.errors import SetupError

#: Schemes of an S3 location (Spark's Hadoop connector is ``s3a``).
S3_SCHEMES = ("s3a", "s3")


def local_path(location: str) -> str | None:
    """The path on this machine of a plain path or ``file:`` URI, else ``None``.

    Example:
        >>> local_path("file:///lake/x"), local_path("/lake/x"), local_path("s3a://b/x")
        ('/lake/x', '/lake/x', None)
    """
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return parsed.path
    return location if parsed.scheme == "" else None


def split_s3(location: str) -> tuple[str, str] | None:
    """``(bucket, key)`` of an ``s3a://`` or ``s3://`` location, else ``None``.

    Example:
        >>> split_s3("s3a://delayq/lh/schedule"), split_s3("/lake")
        (('delayq', 'lh/schedule'), None)
    """
    parsed = urlparse(location)
    if parsed.scheme.lower() not in S3_SCHEMES or not parsed.netloc:
        return None
    return parsed.netloc, parsed.path.lstrip("/")


@dataclass(frozen=True)
class S3Settings:
    """How to reach an S3 bucket; empty fields fall back to the ``AWS_*`` environment.

    Attributes:
        endpoint: the service's URL (``http://127.0.0.1:9000``); empty: AWS's own, or
            ``AWS_ENDPOINT_URL``.
        region: the bucket's region (``AWS_REGION``, else ``us-east-1``).
        access_key: the access key id (``AWS_ACCESS_KEY_ID``).
        secret_key: the secret key (``AWS_SECRET_ACCESS_KEY``).
        path_style: address buckets in the path (``http://host/bucket/key``), as S3Proxy
            and most S3-compatible servers need, instead of as a host name.
        session_token: the session token of temporary credentials (``AWS_SESSION_TOKEN``).
    """

    endpoint: str = ""
    region: str = ""
    access_key: str = ""
    secret_key: str = field(default="", repr=False)
    path_style: bool = True
    session_token: str = field(default="", repr=False)

    def resolved(self) -> S3Settings:
        """These settings with the environment filling what is empty.

        Example:
            >>> S3Settings(region="eu-west-1").resolved().region
            'eu-west-1'
        """
        env = os.environ
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL", "")
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        return S3Settings(
            endpoint=self.endpoint or endpoint,
            region=self.region or region,
            access_key=self.access_key or env.get("AWS_ACCESS_KEY_ID", ""),
            secret_key=self.secret_key or env.get("AWS_SECRET_ACCESS_KEY", ""),
            path_style=self.path_style,
            session_token=self.session_token
            or ("" if self.access_key else env.get("AWS_SESSION_TOKEN", "")),
        )


class Store(ABC):
    """Small files and data files of one filesystem or bucket.

    Paths are locations as :class:`~engine.lakehouse.storage.layout.Layout` gives them. Every
    method is safe to call from several threads.
    """

    def check(self, root: str) -> None:
        """Fail with one clear line when ``root`` cannot be reached (no bucket, refused
        credentials, no server); a local folder is made when first written.

        Raises:
            SetupError: naming what is missing and where.
        """
        return None

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file is at ``path``."""

    @abstractmethod
    def read(self, path: str) -> bytes | None:
        """The whole file, or ``None`` when there is none."""

    @abstractmethod
    def write(self, path: str, data: bytes) -> None:
        """Write the file whole, replacing any: a reader sees the old bytes or the new."""

    @abstractmethod
    def create(self, path: str, data: bytes, *, durable: bool = True) -> bool:
        """Create the file unless one exists (put-if-absent); whether this call made it.

        Of writers racing for one name exactly one gets ``True``; a reader sees the file
        whole or not at all. On S3 a ``PUT`` retried after its answer was lost finds its
        own object: an object that holds exactly ``data`` counts as this call's there (the
        engine's files carry what makes them unique: an engine id, a commit time, data
        files named by UUID; the one exception, a stamping plan, means the same batch
        whoever wrote it). On a local disk the file is linked from a hidden copy, and a
        link an NFS client sent again finds the name already pointing at that copy: it
        counts as this call's. ``durable``: on a local disk, flush it to the device first.
        """

    @abstractmethod
    def names(self, folder: str) -> list[str]:
        """Names of the files directly in ``folder`` (not hidden: no leading ``.`` or
        ``_``), sorted; none when it does not exist."""

    @abstractmethod
    def folders(self, folder: str) -> list[str]:
        """Names of the folders directly in ``folder``, sorted."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Delete the file; nothing when there is none."""

    @abstractmethod
    def identity(self, path: str) -> tuple[Any, ...] | None:
        """Something that changes whenever the file is written again (``None``: no file)."""

    @abstractmethod
    def write_parquet(self, path: str, rows: pa.Table, *, durable: bool = True) -> int:
        """Write ``rows`` as one Snappy Parquet file (not in any table until committed);
        its size in bytes. ``durable``: on a local disk, flush it to the device before
        returning, so that a commit naming it never outlives its bytes (a power cut)."""

    @property
    @abstractmethod
    def filesystem(self) -> pafs.FileSystem:
        """Arrow's filesystem for reading data files (with :meth:`arrow_path`)."""

    @abstractmethod
    def arrow_path(self, path: str) -> str:
        """``path`` as :attr:`filesystem` names it."""

    @abstractmethod
    def delta_uri(self, path: str) -> str:
        """``path`` as delta-rs names it."""

    @property
    @abstractmethod
    def delta_options(self) -> dict[str, str] | None:
        """delta-rs's ``storage_options`` for this store."""

    def delta_table(self, path: str, version: int | None = None) -> DeltaTable:
        """The Delta table at ``path`` (its latest version, or ``version``), read by delta-rs.

        Raises:
            deltalake.exceptions.TableNotFoundError: no Delta table there.

        Example:
            >>> LocalStore().delta_table("/lake/schedule").version()  # doctest: +SKIP
            41
        """
        return DeltaTable(self.delta_uri(path), version=version, storage_options=self.delta_options)


class LocalStore(Store):
    """This machine's filesystem (a folder, or a shared filesystem mounted everywhere);
    methods documented on :class:`Store`."""

    def exists(self, path: str) -> bool:
        return os.path.exists(_local(path))

    def read(self, path: str) -> bytes | None:
        try:
            with open(_local(path), "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            return None

    def write(self, path: str, data: bytes) -> None:
        final = _local(path)
        os.replace(_hidden_copy(final, data, durable=True), final)

    def create(self, path: str, data: bytes, *, durable: bool = True) -> bool:
        final = _local(path)
        temp = _hidden_copy(final, data, durable=durable)
        try:
            os.link(temp, final)
            return True
        except FileExistsError:
            # Taken: by another writer, or by this very link, sent again by an NFS client
            # whose first answer was lost. The name then points at our own copy.
            return _same_file(temp, final)
        except OSError as err:
            if err.errno not in _NO_LINKS:
                raise
            return _rename_noreplace(temp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)

    def names(self, folder: str) -> list[str]:
        try:
            entries = list(os.scandir(_local(folder)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e.name for e in entries if not e.name.startswith((".", "_")) and e.is_file())

    def folders(self, folder: str) -> list[str]:
        try:
            entries = list(os.scandir(_local(folder)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e.name for e in entries if e.is_dir())

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(_local(path))

    def identity(self, path: str) -> tuple[Any, ...] | None:
        try:
            found = os.stat(_local(path))
        except FileNotFoundError:
            return None
        return found.st_ino, found.st_mtime_ns, found.st_ctime_ns, found.st_size

    def write_parquet(self, path: str, rows: pa.Table, *, durable: bool = True) -> int:
        # Encoded in memory, then written with one open: a delivery round writes a small
        # file per topic, and pyarrow's own file opening cost more than the encoding.
        data = parquet_bytes(rows)
        _write_new(_local(path), data, exclusive=False, durable=durable)
        return len(data)

    @property
    def filesystem(self) -> pafs.FileSystem:
        return _LOCAL_FS

    def arrow_path(self, path: str) -> str:
        return _local(path)

    def delta_uri(self, path: str) -> str:
        return _local(path)

    @property
    def delta_options(self) -> dict[str, str] | None:
        return None


_LOCAL_FS = pafs.LocalFileSystem()
#: What ``link`` says on a filesystem without hard links.
_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _hidden_copy(final: str, data: bytes, *, durable: bool) -> str:
    """``data`` in a new hidden file beside ``final`` (flushed to the device if ``durable``);
    its path."""
    temp = os.path.join(os.path.dirname(final), f".tmp-{uuid.uuid4().hex}")
    _write_new(temp, data, exclusive=True, durable=durable)
    return temp


def _same_file(one: str, other: str) -> bool:
    """Whether both names are one file (a hard link of the other)."""
    try:
        return os.path.samefile(one, other)
    except FileNotFoundError:
        return False


def _write_new(path: str, data: bytes | memoryview, *, exclusive: bool, durable: bool) -> None:
    """Write ``data`` as the file ``path`` (its folder made if missing); ``exclusive``: fail
    with ``FileExistsError`` rather than replace one. Plain ``os`` calls: a topic commit writes
    two small files, and Python's buffered file objects cost more than the writes."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, flags, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _local(location: str) -> str:
    path = local_path(location)
    assert path is not None, f"{location} is not a local path"
    return path


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
        "without replacing, which the lakehouse's commits, lease and delayOffset log need"
    )


def parquet_bytes(rows: pa.Table) -> bytes:
    """``rows`` encoded as one Snappy Parquet file.

    Example:
        >>> parquet_bytes(pa.table({"n": [1]}))[:4]
        b'PAR1'
    """
    buffer = pa.BufferOutputStream()
    pq.write_table(rows, buffer, compression="snappy")
    data: bytes = buffer.getvalue().to_pybytes()
    return data


__all__ = ["LocalStore", "S3Settings", "Store", "local_path", "parquet_bytes", "split_s3"]
