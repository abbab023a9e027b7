"""A large stamping batch stamped and written by Spark tasks: its rows never reach the driver.

The stamping query (:mod:`engine.stamp.query`) hands a batch over ``stamp.driver_batch_bytes``
to :func:`stamp_on_executors`, which runs it in Spark jobs over the batch's DataFrame: its
rows are the batch's ``commitlog`` data files, a partition per group of about equal bytes
(:class:`~engine.stamp.query.CommitlogReader`), and each task reads its files with pyarrow
(no row passes through the JVM):

1. **keys**: each task stamps its rows (:func:`~engine.stamp.transform.stamped`, the batch's
   stamping time fixed on the driver) and sends back only what deduplication needs of each
   valid row: where it is (``file``, ``row``), its id hash and two times (:data:`KEYS`,
   about 40 bytes a row, as Arrow IPC);
2. **suspects**, only when an id hash comes twice or was stamped before: the full stamp of
   those few rows, for :meth:`~engine.stamp.writer.StampWriter.refusals` to decide the
   duplicates as the driver path does;
3. **files**: each task stamps its rows again (the same rows, the same stamp), refuses the
   duplicates, sorts the valid rows by queue and deliver time and writes ``schedule`` and
   ``quarantine`` data files (:func:`~engine.lakehouse.delta.log_append.write_files`), sending back
   their ``add`` actions.

The driver then commits each table's files in one commit under the batch's ``txn``
(:meth:`~engine.stamp.writer.StampWriter.adopt`): files of a batch that fails before its
commit are never part of a table (``VACUUM`` removes them), and a batch run again finds its
``txn`` and writes nothing twice.

Example:
    >>> stamp_on_executors(frame, writer, 12)  # doctest: +SKIP
    (99990, 10)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame

from engine.lakehouse.delta.appends import read_file
from engine.lakehouse.delta.log_append import FileLayout, write_files
from engine.lakehouse.state.lease import unfenced
from engine.lakehouse.storage.location import arrive, carried
from engine.stamp.dedup import FIRST
from engine.stamp.transform import split, stamped
from engine.stamp.writer import ID_HASH, ElsewhereBatch, StampWriter, with_reasons

log = logging.getLogger(__name__)

_TS = pa.timestamp("us", tz="UTC")
#: What a task sends back of each valid row for deduplication (phase 1).
KEYS = pa.schema(
    [
        ("file", pa.int64()),
        ("row", pa.int64()),
        (ID_HASH, pa.int64()),
        ("store_ts", _TS),
        ("deliver_ts", _TS),
    ]
)
#: The columns of a suspect row (phase 2): what :func:`~engine.stamp.dedup.duplicate_reasons`
#: reads, and where the row is.
SUSPECT_COLUMNS = ["file", "row", ID_HASH, "deliver_ts", *(name for name, _ in FIRST)]
#: Tasks answer in one binary column: Arrow IPC streams (keys, suspects) or JSON (adds).
_PACKED = "packed binary"
_SCHEDULE, _QUARANTINE = "schedule", "quarantine"


def stamp_on_executors(
    frame: DataFrame,
    writer: StampWriter,
    batch_id: int,
    fence: Callable[[], None] = unfenced,
) -> tuple[int, int]:
    """Stamp the files of ``frame`` (a stamping batch) in Spark tasks and commit them.

    Args:
        frame: the batch's ``commitlog`` data files (``index``, ``path``, ``size``): the
            ``foreachBatch`` DataFrame of the stamping query.
        writer: the stamping writer (deduplication memory, commits).
        batch_id: the stamping batch.
        fence: called again before the driver commits (the tasks take seconds): raises once
            this engine no longer holds the lakehouse.

    Returns:
        How many rows went to ``schedule`` and to ``quarantine``. (A table that takes no
        files written elsewhere gets the batch's rows through the driver instead.)

    Example:
        >>> stamp_on_executors(frame, writer, 12)  # doctest: +SKIP
        (99990, 10)
    """
    planned = writer.plan_elsewhere(batch_id)
    settings = carried(writer.layout.commitlog)
    if planned is None:  # a table with a Delta feature the log appender leaves to delta-rs
        paths = [r["path"] for r in frame.orderBy("index").collect()]
        rows = [read_file(p) for p in paths]
        return writer(pa.concat_tables(rows) if rows else pa.table({}), batch_id)
    batch: ElsewhereBatch = planned
    if batch.schedule is None and batch.quarantine is None:
        return 0, 0  # a replay of a batch both tables hold
    started = time.monotonic()
    keys = _unpacked(frame.mapInArrow(_keys_task(batch, settings), _PACKED).toArrow(), KEYS)
    keyed = time.monotonic()

    def fetch(at: pa.Table) -> pa.Table:
        wanted: dict[int, list[int]] = {}
        for file, row in zip(at["file"].to_pylist(), at["row"].to_pylist(), strict=True):
            wanted.setdefault(int(file), []).append(int(row))
        task = _suspects_task(batch, wanted, settings)
        return _unpacked(frame.mapInArrow(task, _PACKED).toArrow(), None)

    refused = writer.refusals(batch, keys, fetch)
    decided = dataclasses.replace(batch, refused=refused)
    checked = time.monotonic()
    answers = frame.mapInArrow(_files_task(decided, settings), _PACKED).toArrow()
    adds = [
        (writer.layout.schedule if table == _SCHEDULE else writer.layout.quarantine, add)
        for table, add in (json.loads(bytes(v)) for v in answers.column(0).to_pylist())
    ]
    written = time.monotonic()
    fence()
    counts = writer.adopt(decided, adds, keys, refused)
    log.debug(
        "stamping batch %d in Spark tasks: keys %.2f s, duplicates %.2f s, files %.2f s, "
        "commit %.2f s", batch_id, keyed - started, checked - keyed, written - checked,
        time.monotonic() - written,
    )  # fmt: skip
    return counts


def _files(
    batches: Iterator[pa.RecordBatch], settings: dict[str, Any] | None
) -> Iterator[tuple[int, pa.Table]]:
    """Each file of this task's partition: its index in the batch and its rows (the same
    rows in the same order on every pass over the batch)."""
    for listed in batches:
        for index, path in zip(
            listed.column(0).to_pylist(), listed.column(1).to_pylist(), strict=True
        ):
            arrive(path, settings)
            yield int(index), read_file(path)


def _packed(table: pa.Table) -> pa.RecordBatch:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as stream:
        stream.write_table(table)
    return pa.RecordBatch.from_arrays([pa.array([sink.getvalue().to_pybytes()])], ["packed"])


def _unpacked(answers: pa.Table, schema: pa.Schema | None) -> pa.Table:
    """The tables the tasks packed, as one (``schema`` when no task sent any)."""
    tables = [pa.ipc.open_stream(bytes(v)).read_all() for v in answers.column(0).to_pylist()]
    if not tables:
        return schema.empty_table() if schema is not None else pa.table({})
    return pa.concat_tables(tables)


def _keys_task(
    batch: ElsewhereBatch, settings: dict[str, Any] | None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for index, rows in _files(batches, settings):
            if rows.num_rows == 0:
                continue
            stamp = stamped(rows, batch.cfg, batch.batch, batch.now)
            keys = pa.table(
                {
                    "file": pa.array(np.full(rows.num_rows, index, dtype=np.int64)),
                    "row": pa.array(np.arange(rows.num_rows, dtype=np.int64)),
                    ID_HASH: stamp[ID_HASH],
                    "store_ts": pc.cast(stamp["store_ts"], _TS),
                    "deliver_ts": pc.cast(stamp["deliver_ts"], _TS),
                },
                schema=KEYS,
            ).filter(pc.is_null(stamp["reason"]))
            yield _packed(keys)

    return run


def _suspects_task(
    batch: ElsewhereBatch, wanted: dict[int, list[int]], settings: dict[str, Any] | None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for index, rows in _files(
            (b.filter(pc.is_in(b.column(0), pa.array(list(wanted), pa.int64()))) for b in batches),
            settings,
        ):
            at = pa.array(wanted[index], pa.int64())
            stamp = stamped(rows.take(at), batch.cfg, batch.batch, batch.now)
            stamp = stamp.append_column("file", pa.array(np.full(len(at), index, np.int64)))
            yield _packed(stamp.append_column("row", at).select(SUSPECT_COLUMNS))

    return run


def _files_task(
    batch: ElsewhereBatch, settings: dict[str, Any] | None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        refused: dict[int, list[tuple[int, str]]] = {}
        for (file, row), why in batch.refused.items():
            refused.setdefault(file, []).append((row, why))
        stamps = []
        for index, rows in _files(batches, settings):
            stamp = stamped(rows, batch.cfg, batch.batch, batch.now)
            mine = refused.get(index)
            if mine:
                stamp = with_reasons(stamp, np.array([r for r, _ in mine]), [w for _, w in mine])
            stamps.append(stamp)
        if not stamps:
            return
        scheduled, quarantined = split(pa.concat_tables(stamps))
        # One sorted run per queue in each file, as the driver path writes them.
        scheduled = scheduled.sort_by([("queue_id", "ascending"), ("deliver_ts", "ascending")])
        answers = [
            *_written(_SCHEDULE, batch.schedule, scheduled, batch.cfg.stamp_file_rows, settings),
            *_written(_QUARANTINE, batch.quarantine, quarantined, 0, settings),
        ]
        if answers:
            yield pa.RecordBatch.from_arrays([pa.array(answers, pa.binary())], ["packed"])

    return run


def _written(
    table: str,
    target: FileLayout | None,
    rows: pa.Table,
    file_rows: int,
    settings: dict[str, Any] | None,
) -> list[bytes]:
    """Write ``rows`` as data files of ``target`` (none when it holds the batch already);
    each file's ``[table, add]`` as JSON."""
    if target is None or rows.num_rows == 0:
        return []
    arrive(target.path, settings)
    return [json.dumps([table, add]).encode() for add in write_files(target, rows, file_rows)]


__all__ = ["KEYS", "SUSPECT_COLUMNS", "stamp_on_executors"]
