"""Delta tables from the driver without a Spark job: delta-rs reads and appends in Arrow.

A Spark job plus a Delta commit through Spark costs 0.3-1 s on a small machine, and a
delivery round needs a snapshot read and one commit per topic table. delta-rs (the
``deltalake`` package, Delta's Rust implementation) opens a snapshot, prunes its files by
their Delta statistics and appends a commit in about 10-20 ms. It writes the same Delta
protocol: Spark reads what it commits (``DESCRIBE HISTORY`` shows the ``userMetadata``, the
``txn`` action is the one ``txnAppId``/``txnVersion`` record) and the other way round.

The engine's tables are created by Spark (:mod:`engine.lakehouse.delta.tables`), topic tables by
:func:`create_table`, with the schemas of :mod:`schemas`; appends are cast to the table's own
schema, so a missing or mistyped column fails instead of changing the table.

Example:
    >>> orders = ArrowDelta("/lake/topics/orders")  # doctest: +SKIP
    >>> orders.append(rows, txn=Txn("delayq-deliver-9f2c", 7))  # doctest: +SKIP
    >>> orders.latest()  # doctest: +SKIP
    12
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from deltalake import (
    CommitProperties,
    DeltaTable,
    PostCommitHookProperties,
    Transaction,
    write_deltalake,
)
from deltalake.exceptions import CommitFailedError, TableNotFoundError

from engine.core.errors import CheckpointError, RetryableError
from engine.lakehouse.delta.checkpoints import CHECKPOINTS, checkpoint_interval
from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.delta.log_append import FileLayout, LogAppender, conform
from engine.lakehouse.storage.location import store_for
from engine.lakehouse.storage.store import Store, local_path

log = logging.getLogger(__name__)

_NO_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)
#: Spark writes timestamps as INT96, which Arrow reads as nanoseconds by default: years
#: outside 1677-2262 would fail. Read them as microseconds, Spark's precision.
READ_OPTIONS = ds.ParquetReadOptions(coerce_int96_timestamp_unit="us")
#: Tries of an append whose snapshot another writer's DELETE or OPTIMIZE made stale.
APPEND_ATTEMPTS = 3
#: Rows encoded to estimate the bytes per row of a batch's files.
_SAMPLE_ROWS = 1000


def columns(path: str) -> list[str]:
    """The column names of the Delta table at ``path``, from its log (no Spark job).

    Example:
        >>> columns("/lake/commands")  # doctest: +SKIP
        ['cmd_id', 'action', 'msg_id', ...]
    """
    return [f.name for f in store_for(path).delta_table(path).schema().fields]


def data_file(table: str, path: str) -> str:
    """The location of a data file named in a Delta log entry of ``table`` (the entry's
    ``path`` is URL-encoded, relative to the table or an absolute URI): a local path, or an
    object store URI.

    Example:
        >>> data_file("/lake/schedule", "queue_id=1/part-0%3A1.parquet")
        '/lake/schedule/queue_id=1/part-0:1.parquet'
        >>> data_file("s3a://b/lake/schedule", "part-0.parquet")
        's3a://b/lake/schedule/part-0.parquet'
        >>> data_file("/lake/t", "file:///lake/t/k%3Da%23b/p.parquet")
        '/lake/t/k=a#b/p.parquet'
    """
    if "://" in path or path.startswith("file:"):
        location = unquote(path)
        for prefix in ("file://", "file:"):  # (not a URL parse: a name may hold '#' or '?')
            if location.startswith(prefix):
                return location[len(prefix) :]
        return location
    return f"{local_path(table) or table.rstrip('/')}/{unquote(path)}"


def create_table(path: str, schema: pa.Schema) -> bool:
    """Create an empty, unpartitioned Delta table at ``path`` unless one exists (another
    process may create it at the same moment); ``False`` when it existed before the call
    (``True`` may also mean another process made it a moment before).

    About 10 ms, where Spark's ``CREATE TABLE`` takes a Spark job and a few hundred.

    Example:
        >>> create_table("/lake/topics/orders", schema)  # doctest: +SKIP
        True
    """
    store = store_for(path)
    uri = store.delta_uri(path)
    if DeltaTable.is_deltatable(uri, storage_options=store.delta_options):
        return False
    try:
        DeltaTable.create(uri, schema=schema, mode="ignore", storage_options=store.delta_options)
    except CommitFailedError:
        return False  # another process committed version 0 first
    return True


def missing_table(path: str) -> CheckpointError:
    """The error for a table the engine reads that is not there (version -1).

    Example:
        >>> str(missing_table("/lake/schedule")).split(":")[0]
        'no Delta table at /lake/schedule'
    """
    return CheckpointError(
        f"no Delta table at {path}: it is missing or its _delta_log was deleted while the "
        "lakehouse was in use; restore it, or start on a new lakehouse"
    )


class ArrowDelta:
    """One Delta table, read and appended from the driver; the latest snapshot is kept open.

    Nothing is read until asked. Safe to share between threads (one lock around the handle).

    Args:
        path: the table (a lakehouse path, as
            :class:`~engine.lakehouse.storage.layout.Layout` gives).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._store: Store | None = None
        self._table: DeltaTable | None = None
        self._appender = LogAppender(path)
        self._lock = threading.Lock()

    @property
    def store(self) -> Store:
        """The store holding the table, looked up on first use."""
        if self._store is None:
            self._store = store_for(self.path)
        return self._store

    def _latest_table(self) -> DeltaTable | None:
        if self._table is None:
            try:
                self._table = self.store.delta_table(self.path)
            except TableNotFoundError:
                return None
        else:
            self._table.update_incremental()
        return self._table

    def latest(self) -> int:
        """The latest committed version (-1 while the table does not exist).

        Example:
            >>> ArrowDelta("/lake/schedule").latest()  # doctest: +SKIP
            41
        """
        with self._lock:
            table = self._latest_table()
            return -1 if table is None else int(table.version())

    def schema(self) -> pa.Schema:
        """The table's Arrow schema (as delta-rs reads it).

        Example:
            >>> ArrowDelta("/lake/commitlog").schema().names[:2]  # doctest: +SKIP
            ['msg_id', 'topic']
        """
        with self._lock:
            table = self._table or self._latest_table()
            if table is None:
                raise FileNotFoundError(f"no Delta table at {self.path}")
            return pa.schema(table.schema().to_arrow())

    def dataset(self, version: int) -> ds.FileSystemDataset:
        """The files of ``version`` as an Arrow dataset; each file carries its Delta statistics,
        so a filter skips the files that cannot match.

        Raises:
            CheckpointError: ``version`` is negative: the table is not there.

        Example:
            >>> parts = ArrowDelta("/lake/schedule").dataset(41)  # doctest: +SKIP
            >>> parts.to_table(filter=ds.field("queue_id") == 1).num_rows  # doctest: +SKIP
            1000
        """
        if version < 0:  # (what `latest` answers for a table that is not there)
            raise missing_table(self.path)
        with self._lock:
            if self._table is not None and self._table.version() == version:
                return self._table.to_pyarrow_dataset(parquet_read_options=READ_OPTIONS)
        pinned = self.store.delta_table(self.path, version)
        return pinned.to_pyarrow_dataset(parquet_read_options=READ_OPTIONS)

    def append(
        self,
        rows: pa.Table,
        *,
        txn: Txn | None = None,
        metadata: str | None = None,
        file_rows: int = 0,
    ) -> None:
        """Append ``rows`` in one commit, cast to the table's schema, in its partitions.

        Args:
            rows: the rows; columns the table has, in any order.
            txn: recorded with the commit, as Spark's ``txnAppId``/``txnVersion`` are. Unlike
                Spark's writer (:func:`engine.lakehouse.delta.delta_log.append`), the write does not
                look the pair up first: it is skipped only when the pair turns up while the
                table is read (this handle's first read of it, or a commit this append loses
                a race to). A replay asks :meth:`txn_version` before writing again (as
                ``DeltaTopicSink.written`` does); that lookup reads the table, which the hot
                path of every round should not pay.
            metadata: the commit's ``userMetadata``.
            file_rows: cut data files at this many rows or fewer (about, on tables only
                delta-rs writes: it cuts by size, estimated by encoding a sample of rows).

        Raises:
            KeyError: a column the table requires (not nullable) is missing from ``rows``.
            ValueError: ``rows`` has a column the table does not.
        """
        self.stage(rows, txn=txn, metadata=metadata, file_rows=file_rows)()

    def stage(
        self,
        rows: pa.Table,
        *,
        txn: Txn | None = None,
        metadata: str | None = None,
        file_rows: int = 0,
    ) -> Callable[[], None]:
        """Prepare an append ahead of its commit: the data files are written now, where the
        table takes blind appends from the log appender, and readers see nothing of them
        until the returned function commits (once). Arguments and errors as :meth:`append`.

        Example:
            >>> commit = orders.stage(rows, txn=Txn("delayq-deliver-9f2c", 7))  # doctest: +SKIP
            >>> commit()  # the rows appear in one commit  # doctest: +SKIP
        """
        with self._lock:
            staged = self._appender.stage(rows, txn=txn, metadata=metadata, file_rows=file_rows)
        committed = threading.Event()

        def commit() -> None:
            if committed.is_set():
                raise RuntimeError(f"{self.path}: a staged append is committed once")
            committed.set()
            with self._lock:
                if staged is not None and self._appender.commit(staged):
                    version = self._appender.version
                    interval = self._appender.checkpoint_interval
                else:
                    version = self._append_delta_rs(rows, txn, metadata, file_rows)
                    # the handle _append_delta_rs committed with: no read of the log here
                    table = self._table
                    config = table.metadata().configuration if table is not None else {}
                    interval = checkpoint_interval(config)
            if version % interval == 0:
                CHECKPOINTS.request(self.path)

        return commit

    def file_layout(self, names: list[str]) -> FileLayout | None:
        """How Spark tasks write data files for an append of rows with the columns ``names``
        (:func:`~engine.lakehouse.delta.log_append.write_files`), for :meth:`commit_files`;
        ``None`` when the table takes appends only through :meth:`append`.

        Example:
            >>> ArrowDelta("/lake/schedule").file_layout(["msg_id"]).partitions  # doctest: +SKIP
            ()
        """
        with self._lock:
            return self._appender.layout(names)

    def commit_files(
        self,
        adds: list[dict[str, Any]],
        rows: int,
        layout: FileLayout,
        *,
        txn: Txn | None = None,
        metadata: str | None = None,
    ) -> None:
        """Add data files written for ``layout`` to the table in one commit.

        Args:
            adds: the files' ``add`` actions
                (:func:`~engine.lakehouse.delta.log_append.write_files`).
            rows: how many rows they hold.
            layout: what :meth:`file_layout` gave when they were written.
            txn: recorded with the commit; a commit that finds it recorded already adds
                nothing.
            metadata: the commit's ``userMetadata``.

        Raises:
            RetryableError: the table changed its schema or features since the files were
                written (they are deleted): write them again.

        Example:
            >>> txn = Txn("delayq-stamp", 7)
            >>> schedule.commit_files(adds, 1000, layout, txn=txn)  # doctest: +SKIP
        """
        with self._lock:
            staged = self._appender.adopt(adds, rows, layout, txn=txn, metadata=metadata)
            if not self._appender.commit(staged):
                raise RetryableError(f"{self.path} no longer takes appends of written files")
            version, interval = self._appender.version, self._appender.checkpoint_interval
        if version % interval == 0:
            CHECKPOINTS.request(self.path)

    def _append_delta_rs(
        self, rows: pa.Table, txn: Txn | None, metadata: str | None, file_rows: int
    ) -> int:
        """Append with delta-rs (tables the log appender does not write); the new version."""
        # An open handle needs no refresh: delta-rs commits an append on top of whatever
        # was committed since (appends do not conflict) and moves the handle to its version.
        table = self._table or self._latest_table()
        if table is None:
            raise FileNotFoundError(f"no Delta table at {self.path}")
        custom: dict[str, object] = {"isBlindAppend": True}  # as Spark's appends say
        if metadata is not None:
            custom["userMetadata"] = metadata
        properties = CommitProperties(
            custom_metadata=custom,
            app_transactions=[Transaction(t.app_id, t.version) for t in txn.all()] if txn else None,
        )
        for attempt in range(1, APPEND_ATTEMPTS + 1):
            data = conform(rows, pa.schema(table.schema().to_arrow()), self.path)
            try:
                write_deltalake(
                    table,
                    data,
                    mode="append",
                    partition_by=table.metadata().partition_columns or None,
                    target_file_size=_file_size(data, file_rows),
                    commit_properties=properties,
                    post_commithook_properties=_NO_HOOKS,
                )
                break
            except CommitFailedError:
                # Nothing landed: delta-rs found a conflict with a commit made since this
                # handle's snapshot (seen here after a Spark DELETE or UPDATE). Appended
                # rows do not depend on what was read, so the same append on the new
                # snapshot is right, unless its txn has been recorded by now (another
                # writer of the same batch).
                if attempt == APPEND_ATTEMPTS:
                    raise
                table.update_incremental()
                if txn is not None and txn.recorded_in(table.transaction_version):
                    return int(table.version())
        return int(table.version())

    def table_property(self, name: str) -> str | None:
        """A table property (``TBLPROPERTIES``) of the latest version (``None``: not set, or
        no table).

        Example:
            >>> ArrowDelta("/lake/schedule").table_property("delayq.prunedBefore")  # doctest: +SKIP
            '2026-11-17T09:00:00+00:00'
        """
        with self._lock:
            table = self._latest_table()
            if table is None:
                return None
            value = table.metadata().configuration.get(name)
            return None if value is None else str(value)

    def txn_version(self, app_id: str) -> int | None:
        """The highest ``txnVersion`` recorded for ``app_id`` (``None``: none, or no table)."""
        with self._lock:
            table = self._latest_table()
            return None if table is None else table.transaction_version(app_id)

    def max_of(self, column: str) -> int:
        """The largest value of an integer column (-1 when the table has none), from the
        files' Delta statistics; a file without them is read.

        Example:
            >>> ArrowDelta("/lake/schedule").max_of("stamp_batch")  # doctest: +SKIP
            41
        """
        with self._lock:
            table = self._latest_table()
            if table is None:
                return -1
            actions = pa.table(table.get_add_actions(flatten=True))
        stat = f"max.{column}"
        best = -1
        if stat in actions.column_names:
            found = pc.max(actions[stat]).as_py()
            best = -1 if found is None else int(found)
            # A file whose statistic is null holds only nulls there, or has no statistics.
            actions = actions.filter(pc.is_null(actions[stat]))
        if actions.num_rows:  # files to read
            paths = [
                self.store.arrow_path(data_file(self.path, p)) for p in actions["path"].to_pylist()
            ]
            fmt = ds.ParquetFileFormat(read_options=READ_OPTIONS)
            rows = ds.dataset(paths, format=fmt, filesystem=self.store.filesystem)
            found = pc.max(rows.to_table(columns=[column])[column])
            best = max(best, -1 if found.as_py() is None else int(found.as_py()))
        return best

    def committed_with(self, metadata: str, lookback: int) -> bool:
        """Whether one of the last ``lookback`` commits carries ``userMetadata``."""
        with self._lock:
            table = self._latest_table()
            if table is None:
                return False
            return any(c.get("userMetadata") == metadata for c in table.history(lookback))


def _file_size(rows: pa.Table, file_rows: int) -> int | None:
    """delta-rs's ``target_file_size`` for about ``file_rows`` rows per file (None: no cut).

    delta-rs cuts files by the bytes it has written; the bytes per row are estimated by
    encoding rows taken evenly across the batch. An estimate: on the benchmark's data files
    held 25-35% of ``file_rows``, and rows of very uneven sizes can make them larger.
    """
    if not file_rows or rows.num_rows <= file_rows:
        return None
    step = max(1, rows.num_rows // _SAMPLE_ROWS)
    sample = rows.take(pa.array(range(0, rows.num_rows, step)))
    buffer = io.BytesIO()
    pq.write_table(sample, buffer)
    return max(1, buffer.tell() * file_rows // int(sample.num_rows))


__all__ = ["ArrowDelta", "create_table", "data_file", "missing_table"]
