"""The lakehouse in an S3 bucket: Amazon S3, or any server that speaks its API (S3Proxy).

Small files (Delta log entries, the delayOffset log, plans, the lease) go through
``obstore`` (Rust's ``object_store``), whose ``put(mode="create")`` is S3's conditional
``PUT`` (``If-None-Match: *``): of two writers of one name exactly one wins, and the other
gets ``412 Precondition Failed``. A ``PUT`` is atomic, so a reader sees an object whole or
not at all: no temporary file, no rename. Data files are read by Arrow's own S3 filesystem
(:attr:`S3Store.filesystem`) and written as one ``PUT`` each. delta-rs gets the same settings
as ``storage_options`` and commits with the same conditional ``PUT``.

A ``PUT`` that fails after the server stored the object (the answer lost on the way back)
is indistinguishable from a lost race when it is tried again: :meth:`S3Store.create` reads
the object back and counts it as its own when the bytes are the ones it wrote.

Example:
    >>> store = S3Store("delayq", S3Settings(endpoint="http://127.0.0.1:9000"))  # doctest: +SKIP
    >>> store.create("s3a://delayq/lh/_engine/lease/1.json", b"{}")  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import obstore
import pyarrow as pa
import pyarrow.fs as pafs
from obstore.exceptions import AlreadyExistsError, BaseError, NotFoundError, PreconditionError
from obstore.store import S3Store as _Client

from engine.core.errors import SetupError
from engine.lakehouse.storage.store import S3Settings, Store, parquet_bytes, split_s3

#: Tries of a request that failed on the way (the client retries transient errors itself).
_CLIENT_RETRIES = 3
_TIMEOUT = timedelta(seconds=30)


class S3Store(Store):
    """One S3 bucket (methods documented on :class:`~engine.lakehouse.storage.store.Store`).

    Nothing is sent until the first call.

    Args:
        bucket: the bucket's name.
        settings: how to reach it (resolved: the environment already applied).
    """

    def __init__(self, bucket: str, settings: S3Settings) -> None:
        self.bucket = bucket
        self.settings = settings
        self._client: _Client | None = None
        self._arrow: pafs.S3FileSystem | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ clients

    @property
    def client(self) -> _Client:
        """The ``obstore`` client of the bucket, made on first use."""
        with self._lock:
            if self._client is None:
                s = self.settings
                config: dict[str, Any] = {
                    "region": s.region,
                    "virtual_hosted_style_request": not s.path_style,
                    "conditional_put": "etag",
                }
                if s.endpoint:
                    config["endpoint"] = s.endpoint
                if s.access_key:
                    config["access_key_id"] = s.access_key
                    config["secret_access_key"] = s.secret_key
                if s.session_token:
                    config["token"] = s.session_token
                self._client = _Client(
                    self.bucket,
                    config=config,  # type: ignore[arg-type]
                    client_options={
                        "allow_http": s.endpoint.startswith("http://"),
                        "timeout": _TIMEOUT,
                    },
                    retry_config={"max_retries": _CLIENT_RETRIES},
                )
            return self._client

    @property
    def filesystem(self) -> pafs.FileSystem:
        with self._lock:
            if self._arrow is None:
                s = self.settings
                options: dict[str, Any] = {"region": s.region}
                if s.endpoint:
                    parsed = urlparse(s.endpoint)
                    options["endpoint_override"] = parsed.netloc
                    options["scheme"] = parsed.scheme
                if s.access_key:
                    options["access_key"] = s.access_key
                    options["secret_key"] = s.secret_key
                if s.session_token:
                    options["session_token"] = s.session_token
                options["force_virtual_addressing"] = not s.path_style
                self._arrow = pafs.S3FileSystem(**options)
            return self._arrow

    # ------------------------------------------------------------------ paths

    def key(self, path: str) -> str:
        """The object key of a location in this bucket.

        Example:
            >>> S3Store("b", S3Settings()).key("s3a://b/lh/schedule/x.parquet")
            'lh/schedule/x.parquet'
        """
        found = split_s3(path)
        if found is None or found[0] != self.bucket:
            raise ValueError(f"{path} is not in bucket {self.bucket}")
        return found[1]

    def arrow_path(self, path: str) -> str:
        return f"{self.bucket}/{self.key(path)}"

    def delta_uri(self, path: str) -> str:
        return f"s3://{self.bucket}/{self.key(path)}"

    @property
    def delta_options(self) -> dict[str, str] | None:
        s = self.settings
        options = {
            "AWS_REGION": s.region,
            "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": str(not s.path_style).lower(),
            # delta-rs commits with a conditional PUT (If-None-Match), as the engine does;
            # never AWS_S3_ALLOW_UNSAFE_RENAME.
            "AWS_CONDITIONAL_PUT": "etag",
        }
        if s.endpoint:
            options["AWS_ENDPOINT_URL"] = s.endpoint
            options["AWS_ALLOW_HTTP"] = str(s.endpoint.startswith("http://")).lower()
        if s.access_key:
            options["AWS_ACCESS_KEY_ID"] = s.access_key
            options["AWS_SECRET_ACCESS_KEY"] = s.secret_key
        if s.session_token:
            options["AWS_SESSION_TOKEN"] = s.session_token
        return options

    def check(self, root: str) -> None:
        """Reach the bucket, and make sure its server honours conditional writes: a server
        that ignored ``If-None-Match`` would let two writers both commit one version."""
        where = self.settings.endpoint or "AWS"
        try:
            obstore.list_with_delimiter(self.client, self.key(root).rstrip("/") + "/")
        except Exception as err:  # obstore's errors carry the server's answer
            text = str(err)
            if "NoSuchBucket" in text or isinstance(err, NotFoundError | FileNotFoundError):
                problem = f"no bucket {self.bucket}"
            elif "403" in text or "AccessDenied" in text or "SignatureDoesNotMatch" in text:
                problem = "the credentials were refused (storage.s3.access_key/secret_key, or "
                problem += "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
            else:
                problem = text.strip().splitlines()[0][:200]
            raise SetupError(f"{root} cannot be reached at {where}: {problem}") from None
        probe = f"{root.rstrip('/')}/_engine/.put-if-absent-{uuid.uuid4().hex}"
        try:
            first = self.create(probe, b"first")
            second = self.create(probe, b"second")
        finally:
            self.delete(probe)
        if not first or second:
            raise SetupError(
                f"{root}: the S3 server at {where} does not honour conditional writes "
                "(If-None-Match: *), which every commit here needs; use Amazon S3, S3Proxy 4 "
                "or another server that does"
            )

    # ------------------------------------------------------------------ files

    def exists(self, path: str) -> bool:
        with _failures(path):
            try:
                obstore.head(self.client, self.key(path))
                return True
            except (NotFoundError, FileNotFoundError):
                return False

    def read(self, path: str) -> bytes | None:
        with _failures(path):
            try:
                return bytes(obstore.get(self.client, self.key(path)).bytes())
            except (NotFoundError, FileNotFoundError):
                return None

    def write(self, path: str, data: bytes) -> None:
        with _failures(path):
            obstore.put(self.client, self.key(path), data)

    def create(self, path: str, data: bytes, *, durable: bool = True) -> bool:
        with _failures(path):
            try:
                obstore.put(self.client, self.key(path), data, mode="create")
                return True
            except (AlreadyExistsError, PreconditionError, FileExistsError):
                pass
        # Taken: by another writer, or by this very PUT whose answer was lost and which the
        # client sent again. Only the bytes can tell (see Store.create).
        return self.read(path) == data

    def names(self, folder: str) -> list[str]:
        prefix = self.key(folder).rstrip("/") + "/"
        with _failures(folder):
            listed = obstore.list_with_delimiter(self.client, prefix)
        found = (meta["path"][len(prefix) :] for meta in listed["objects"])
        return sorted(n for n in found if n and "/" not in n and not n.startswith((".", "_")))

    def folders(self, folder: str) -> list[str]:
        prefix = self.key(folder).rstrip("/") + "/"
        with _failures(folder):
            listed = obstore.list_with_delimiter(self.client, prefix)
        return sorted(p[len(prefix) :].rstrip("/") for p in listed["common_prefixes"])

    def delete(self, path: str) -> None:
        with _failures(path), contextlib.suppress(NotFoundError, FileNotFoundError):
            obstore.delete(self.client, self.key(path))

    def identity(self, path: str) -> tuple[Any, ...] | None:
        with _failures(path):
            try:
                meta = obstore.head(self.client, self.key(path))
            except (NotFoundError, FileNotFoundError):
                return None
        return meta["e_tag"], meta["last_modified"], meta["size"]

    def write_parquet(self, path: str, rows: pa.Table, *, durable: bool = True) -> int:
        data = parquet_bytes(rows)
        self.write(path, data)
        return len(data)


@contextlib.contextmanager
def _failures(path: str) -> Iterator[None]:
    """The S3 client's failures (the server unreachable, an error answer) as ``OSError``,
    as a local disk's are: callers that retry a storage failure retry these too."""
    try:
        yield
    except BaseError as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise OSError(f"{path}: {first}") from err


__all__ = ["S3Store"]
