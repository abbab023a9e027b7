"""An append-only table as a source: the files each new version adds, read as Arrow without
Spark. ``commitlog`` is read so by stamping, ``schedule_requests`` by the engine's
:mod:`~engine.recur.requests` (the same rules; there, a version stamping would stop at is
ignored, with an outcome that says so).

Stamping follows ``commitlog``'s Delta log as Spark's Delta streaming source does, from the
driver: a :class:`Position` is a version and the index of the next data file that version
added (in the order of its log entry). :meth:`CommitlogSource.changes` takes the files from
a position on, up to a file and byte budget; committed versions never change, so the files
between two positions are the same whenever they are read again (a replayed batch).

What a version holds:

* files it adds with ``dataChange`` (a producer's append, Spark's or delta-rs's): stamped;
* files it adds or removes without ``dataChange`` (``OPTIMIZE``): nothing new, skipped;
* data a ``DELETE`` removes (with the rest of each file it touches added back): ignored, as
  Delta's ``ignoreDeletes`` does;
* rows an ``UPDATE`` rewrites: stamped already, so the version is skipped with a warning;
* any other commit that removes data while adding some (``MERGE``, an overwrite,
  ``RESTORE``): stamping cannot tell new messages from old ones and stops with
  :class:`~engine.core.errors.CheckpointError` naming the version (``commitlog`` is
  append-only; Spark's Delta stream fails there too).

Example:
    >>> source = CommitlogSource("/lake/commitlog")  # doctest: +SKIP
    >>> start = Position(0, 0)
    >>> files, end = source.changes(start, max_files=1000, max_bytes=1 << 24)  # doctest: +SKIP
    >>> rows = source.read(files)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as ds
from pyspark.sql.pandas.types import to_arrow_schema

from engine.core.errors import CheckpointError
from engine.lakehouse.delta.arrow_delta import READ_OPTIONS, data_file
from engine.lakehouse.storage.location import store_for
from engine.lakehouse.storage.store import Store
from schemas import COMMITLOG

log = logging.getLogger(__name__)

_ARROW_COMMITLOG = to_arrow_schema(COMMITLOG, timezone="UTC")


@dataclass(frozen=True, order=True)
class Position:
    """Where stamping is in ``commitlog``: the next data file is file ``index`` of ``version``.

    Example:
        >>> Position(3, 0) < Position(3, 2) < Position(4, 0)
        True
    """

    version: int
    index: int


@dataclass(frozen=True)
class Added:
    """A data file a ``commitlog`` version added."""

    version: int
    index: int
    path: str
    size: int


class CommitlogSource:
    """The data files ``commitlog`` versions add, and their rows.

    Args:
        path: the ``commitlog`` table.
    """

    def __init__(self, path: str) -> None:
        self.path = path.rstrip("/")
        self._log = f"{self.path}/_delta_log"
        self._store: Store | None = None
        self._schema: pa.Schema | None = None
        self._files: dict[int, list[Added]] = {}  # version -> its data files (recent ones)

    @property
    def store(self) -> Store:
        """The store holding ``commitlog``, looked up on first use."""
        if self._store is None:
            self._store = store_for(self.path)
        return self._store

    def _entry(self, version: int) -> str:
        return f"{self._log}/{version:020d}.json"

    def exists(self, version: int) -> bool:
        """Whether ``version`` is committed (its log entry is there)."""
        return self.store.exists(self._entry(version))

    def files(self, version: int) -> list[Added]:
        """The data files ``version`` added for producers' rows (none for other commits).

        Raises:
            CheckpointError: the version's log entry is gone (removed by log retention
                while stamping was stopped): stamping cannot know what it added.
        """
        cached = self._files.get(version)
        if cached is not None:
            return cached
        data = self.store.read(self._entry(version))
        if data is None:
            raise CheckpointError(
                f"{self.path} version {version} is not in its Delta log any more (removed "
                "after delta.logRetentionDuration while nothing stamped it): stamping cannot "
                "tell which messages it added"
            )
        actions = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
        adds = [a["add"] for a in actions if "add" in a and a["add"].get("dataChange", True)]
        removes = [a["remove"] for a in actions if "remove" in a]
        if any("metaData" in a for a in actions):
            self._schema = None  # columns added: read the schema again
        changed = [r for r in removes if r.get("dataChange", True)]
        if adds and changed:
            info: dict[str, object] = next(
                (a["commitInfo"] for a in actions if "commitInfo" in a), {}
            )
            operation = str(info.get("operation", "unknown"))
            if operation not in ("DELETE", "UPDATE"):
                raise CheckpointError(
                    f"{self.path} version {version} ({operation}) removes rows and adds "
                    "others: commitlog is append-only, and stamping cannot tell new messages "
                    "from ones stamped before"
                )
            log.warning(
                "%s version %d (%s) rewrites rows already stamped; they are not stamped again",
                self.path,
                version,
                operation,
            )
            adds = []
        for add in adds:
            if add.get("deletionVector") or add.get("partitionValues"):
                raise CheckpointError(
                    f"{self.path} version {version} adds a file with deleted rows or in a "
                    "partition: commitlog must stay an unpartitioned append-only table"
                )
        found = [
            Added(version, i, data_file(self.path, add["path"]), int(add.get("size") or 0))
            for i, add in enumerate(adds)
        ]
        if len(self._files) > 64:
            self._files.pop(min(self._files))
        self._files[version] = found
        return found

    def changes(
        self, start: Position, max_files: int, max_bytes: int
    ) -> tuple[list[Added], Position]:
        """The data files from ``start`` on, and the position after them.

        Takes whole files in log order until ``max_files`` or ``max_bytes`` (at least one
        file, so a large file is never stuck), up to the latest version.

        Example:
            >>> files, end = source.changes(Position(7, 0), 1000, 16 << 20)  # doctest: +SKIP
        """
        taken: list[Added] = []
        size = 0
        version, index = start.version, start.index
        while self.exists(version):
            for added in self.files(version)[index:]:
                if taken and (len(taken) >= max_files or size + added.size > max_bytes):
                    return taken, Position(added.version, added.index)
                taken.append(added)
                size += added.size
            version, index = version + 1, 0
        return taken, Position(version, 0)

    def between(self, start: Position, end: Position) -> list[Added]:
        """The data files from ``start`` up to (not including) ``end``: a batch read again.

        Example:
            >>> source.between(Position(7, 0), Position(9, 0))  # doctest: +SKIP
        """
        taken: list[Added] = []
        for version in range(start.version, end.version + 1):
            first = start.index if version == start.version else 0
            last = end.index if version == end.version else None
            if version == end.version and not end.index:
                break
            taken.extend(self.files(version)[first:last])
        return taken

    def schema(self) -> pa.Schema:
        """The table's Arrow schema (its newest columns)."""
        if self._schema is None:
            self._schema = pa.schema(self.store.delta_table(self.path).schema().to_arrow())
        return self._schema

    def read(self, files: list[Added]) -> pa.Table:
        """The rows of ``files``, in the table's schema (columns a file lacks are null).

        Example:
            >>> source.read(files).num_rows  # doctest: +SKIP
            1000
        """
        schema = self.schema()
        if not files:
            return schema.empty_table()
        fmt = ds.ParquetFileFormat(read_options=READ_OPTIONS)
        paths = [self.store.arrow_path(f.path) for f in files]
        return ds.dataset(
            paths, schema=schema, format=fmt, filesystem=self.store.filesystem
        ).to_table()


def read_file(path: str) -> pa.Table:
    """The rows of one ``commitlog`` data file in the ``commitlog`` columns (columns the file
    lacks are null): what a Spark task of the stamping query reads.

    Example:
        >>> read_file("/lake/commitlog/part-0.parquet").num_rows  # doctest: +SKIP
        1000
    """
    store = store_for(path)
    return ds.dataset(
        store.arrow_path(path),
        schema=_ARROW_COMMITLOG,
        format=ds.ParquetFileFormat(read_options=READ_OPTIONS),
        filesystem=store.filesystem,
    ).to_table()
