"""Delta tables from the driver without a Spark job: delta-rs reads and appends in Arrow.

A Spark job plus a Delta commit through Spark costs 0.3-1 s on a small machine, and a
delivery round needs a snapshot read and one commit per topic table. delta-rs (the
``deltalake`` package, Delta's Rust implementation) opens a snapshot, prunes its files by
their Delta statistics and appends a commit in about 10-20 ms. It writes the same Delta
protocol: Spark reads what it commits (``DESCRIBE HISTORY`` shows the ``userMetadata``, the
``txn`` action is the one ``txnAppId``/``txnVersion`` record) and the other way round.

Tables are still created by Spark (:mod:`engine.lakehouse.tables`), with the schemas of
:mod:`schemas`; appends are cast to the table's own schema, so a missing or mistyped column
fails instead of changing the table.

Example:
    >>> orders = ArrowDelta("/lake/topics/orders")  # doctest: +SKIP
    >>> orders.append(rows, txn=Txn("delayq-deliver-9f2c", 7))  # doctest: +SKIP
    >>> orders.latest()  # doctest: +SKIP
    12
"""

from __future__ import annotations

import threading

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import (
    CommitProperties,
    DeltaTable,
    PostCommitHookProperties,
    Transaction,
    write_deltalake,
)
from deltalake.exceptions import TableNotFoundError

from engine.lakehouse.delta_log import Txn

#: A checkpoint every this many versions, as Spark's Delta does by default (delta-rs would
#: wait 100): Spark readers of a table delta-rs appends replay at most this many commits.
CHECKPOINT_INTERVAL = 10
_NO_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)


def delta_uri(path: str) -> str:
    """The delta-rs address of a lakehouse path (``file:`` prefixes dropped, ``s3a`` as ``s3``).

    Example:
        >>> delta_uri("file:///lake/schedule"), delta_uri("s3a://bucket/lake/schedule")
        ('/lake/schedule', 's3://bucket/lake/schedule')
    """
    if path.startswith("file://"):
        return path[len("file://") :]
    if path.startswith("file:"):
        return path[len("file:") :]
    if path.startswith("s3a://"):
        return "s3://" + path[len("s3a://") :]
    return path


class ArrowDelta:
    """One Delta table, read and appended from the driver; the latest snapshot is kept open.

    Nothing is read until asked. Safe to share between threads (one lock around the handle).

    Args:
        path: the table (a lakehouse path, as :class:`~engine.lakehouse.layout.Layout` gives).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.uri = delta_uri(path)
        self._table: DeltaTable | None = None
        self._lock = threading.Lock()

    def _latest_table(self) -> DeltaTable | None:
        if self._table is None:
            try:
                self._table = DeltaTable(self.uri)
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

    def snapshot(self, version: int) -> DeltaTable:
        """The table as of ``version`` (the open snapshot when it is that version)."""
        with self._lock:
            if self._table is not None and self._table.version() == version:
                return self._table
        return DeltaTable(self.uri, version=version)

    def dataset(self, version: int) -> ds.FileSystemDataset:
        """The files of ``version`` as an Arrow dataset; each file carries its Delta statistics,
        so a filter skips the files that cannot match.

        Example:
            >>> parts = ArrowDelta("/lake/schedule").dataset(41)  # doctest: +SKIP
            >>> parts.to_table(filter=ds.field("queue_id") == 1).num_rows  # doctest: +SKIP
            1000
        """
        return self.snapshot(version).to_pyarrow_dataset()

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
            txn: recorded with the commit, as Spark's ``txnAppId``/``txnVersion`` are (the
                caller checks :meth:`txn_version` before writing again).
            metadata: the commit's ``userMetadata``.
            file_rows: cut data files at about this many rows (delta-rs cuts by size: the
                size is estimated from the rows in memory, so files may hold more).

        Raises:
            KeyError: a column of the table is missing from ``rows``.
        """
        with self._lock:
            table = self._latest_table()
            if table is None:
                raise FileNotFoundError(f"no Delta table at {self.path}")
            schema = pa.schema(table.schema().to_arrow())
            data = rows.select(schema.names).cast(schema)
            properties = CommitProperties(
                custom_metadata={"userMetadata": metadata} if metadata is not None else None,
                app_transactions=[Transaction(txn.app_id, txn.version)] if txn else None,
            )
            size = None
            if file_rows and data.num_rows:
                size = max(1 << 20, data.nbytes * file_rows // data.num_rows)
            write_deltalake(
                table,
                data,
                mode="append",
                partition_by=table.metadata().partition_columns or None,
                target_file_size=size,
                commit_properties=properties,
                post_commithook_properties=_NO_HOOKS,
            )
            table.update_incremental()
            if table.version() % CHECKPOINT_INTERVAL == 0:
                table.create_checkpoint()
                table.cleanup_metadata()  # log files past delta.logRetentionDuration (30 days)

    def txn_version(self, app_id: str) -> int | None:
        """The highest ``txnVersion`` recorded for ``app_id`` (``None``: none, or no table)."""
        with self._lock:
            table = self._latest_table()
            return None if table is None else table.transaction_version(app_id)

    def committed_with(self, metadata: str, lookback: int) -> bool:
        """Whether one of the last ``lookback`` commits carries ``userMetadata``."""
        with self._lock:
            table = self._latest_table()
            if table is None:
                return False
            return any(c.get("userMetadata") == metadata for c in table.history(lookback))


__all__ = ["ArrowDelta", "delta_uri"]
