"""Stamp a batch of ``commitlog`` rows and append them to ``schedule`` / ``quarantine``.

On the driver (a small batch, or the driver path) there is no Spark job: the rows come as
Arrow (:mod:`engine.lakehouse.delta.appends`), are checked and stamped with pyarrow
(:mod:`engine.stamp.transform`), and the valid rows, sorted by queue and deliver time, go to
``schedule`` and the refused ones to ``quarantine``, each in one commit
(:mod:`engine.lakehouse.delta.arrow_delta`), about 20 ms where a Spark Delta write takes about a
second here.

Both writes are idempotent per batch: each commit records the batch as the ``txn`` version
of ``delayq-stamp`` (Spark's ``txnAppId``/``txnVersion``), and a batch is written to a table
only if its id is above the one the table holds (tables stamped before the ``txn`` was
recorded answer with their highest ``stamp_batch``), so a replayed batch stores nothing twice.

A large batch of the stamping query stays on Spark's executors (:mod:`engine.stamp.tasks`):
the writer then decides its duplicates from the rows' keys (:meth:`StampWriter.refusals`)
and commits the files the tasks wrote (:meth:`StampWriter.adopt`).

Example:
    >>> writer = StampWriter(cfg, lay, clock)  # doctest: +SKIP
    >>> writer(source.read(files), batch_id=12)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.core.clock import Clock
from engine.core.config import EngineConfig
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.delta.log_append import FileLayout
from engine.lakehouse.storage.layout import Layout
from engine.stamp.dedup import SeenIds, Taken, duplicate_reasons, from_micros, taken_until
from engine.stamp.transform import id_hashes, split, stamped
from schemas import QUARANTINE, SCHEDULE, column_names

log = logging.getLogger(__name__)

STAMP_APP_ID = "delayq-stamp"
#: The 64-bit hash of ``msg_id`` (a ``schedule`` column): the deduplication index's key.
ID_HASH = "msg_id_hash"
#: Ids are kept this long past the window, for rows stored a while before they are stamped
#: (older ones make the writer read the ids back from ``schedule``).
EXPIRY_SLACK = timedelta(minutes=15)
#: Longest a held read of the taken ids (:meth:`StampWriter.warm`) waits for its batch.
HOLD_S = 10.0


class StampWriter:
    """Stamp a batch of ``commitlog`` rows, then append them idempotently.

    Example:
        >>> writer = StampWriter(cfg, lay, clock)  # doctest: +SKIP
        >>> writer(rows, 12)  # doctest: +SKIP
        >>> writer(rows, 12)  # a replay: nothing is written twice  # doctest: +SKIP
    """

    def __init__(self, cfg: EngineConfig, layout: Layout, clock: Clock) -> None:
        self.cfg = cfg
        self.layout = layout
        self.clock = clock
        self._tables = {
            layout.schedule: ArrowDelta(layout.schedule),
            layout.quarantine: ArrowDelta(layout.quarantine),
        }
        self._written: dict[str, int] = {}  # table path -> highest batch it holds
        self._seen: SeenIds | None = None  # ids stamped in the dedup window, read when needed
        self._warming: _Warming | None = None  # the same, being read for a first batch

    def warm(self, batch_id: int, hold: bool = False) -> None:
        """Start reading the taken ids back from ``schedule`` in the background, for
        ``batch_id`` as the next batch: a restart's first batch then finds them read (or
        waits for the rest) instead of starting to read them, while the streaming queries
        start meanwhile. Used only if that batch is the next one this writer stamps.

        Args:
            batch_id: the next batch.
            hold: start reading only once that batch has looked up its own ids (at most
                :data:`HOLD_S` later): for a batch stamped right away, whose lookup of its
                own ids then reads alone instead of beside millions of others.

        Example:
            >>> writer.warm(12)  # doctest: +SKIP
        """
        if self.cfg.dedup_window_ms <= 0 or self._seen is not None or self._warming is not None:
            return
        window = timedelta(milliseconds=self.cfg.dedup_window_ms)
        since = self.clock.now() - window - EXPIRY_SLACK  # what `_seen_since` reads then
        # A table object of its own: the batch's thread may use the writer's meanwhile.
        self._warming = _Warming(ArrowDelta(self.layout.schedule), batch_id, since, hold)

    def tables(self) -> list[ArrowDelta]:
        """The tables a batch is written to."""
        return list(self._tables.values())

    def __call__(self, rows: pa.Table, batch_id: int) -> tuple[int, int]:
        """Stamp one batch of ``commitlog`` rows; safe to call again with the same batch.

        Returns:
            How many rows went to ``schedule`` and to ``quarantine``.
        """
        try:
            return self._stamp(rows, batch_id)
        except BaseException:
            # A retried batch must decide duplicates as the first try did: rebuild the ids
            # from `schedule` (batches before this one) instead of trusting the memory.
            self._seen = None
            raise
        finally:
            if self._warming is not None:
                self._warming.go()  # (held for this batch, whatever it looked up)

    def _stamp(self, batch: pa.Table, batch_id: int) -> tuple[int, int]:
        now = self.clock.now()
        rows = stamped(batch, self.cfg, batch_id, now)
        dedup = self.cfg.dedup_window_ms > 0
        if dedup:
            rows = self._mark_duplicates(rows, batch_id, now)
        scheduled, quarantined = split(rows)
        # One sorted run per queue: each file then spans a narrow deliver_ts range, which
        # the rounds' file skipping exploits.
        scheduled = scheduled.sort_by([("queue_id", "ascending"), ("deliver_ts", "ascending")])
        self._append(scheduled, self.layout.schedule, batch_id, self.cfg.stamp_file_rows)
        if dedup:
            taken = scheduled[ID_HASH].to_numpy(), taken_until(scheduled)
            if self._seen is not None:
                self._seen.add(*taken)
            elif self._warming is not None and not self._warming.carry(batch_id, *taken):
                self._warming = None  # (another batch than it reads for: read again later)
        self._append(quarantined, self.layout.quarantine, batch_id)
        return scheduled.num_rows, quarantined.num_rows

    def _mark_duplicates(self, rows: pa.Table, batch_id: int, now: datetime) -> pa.Table:
        """``rows`` with each later copy of an already stamped ``msg_id`` refused as a duplicate."""
        valid = pc.is_null(rows["reason"])
        candidates = rows.filter(valid)
        if candidates.num_rows == 0:
            return rows
        window = timedelta(milliseconds=self.cfg.dedup_window_ms)
        # Only copies taken until this or later can make a row of the batch a duplicate.
        needed = pc.min(candidates["store_ts"]).as_py() - window
        reasons = duplicate_reasons(
            candidates,
            candidates[ID_HASH].to_numpy(),
            self._seen_since(batch_id, needed, now, candidates[ID_HASH].to_numpy()),
            lambda ids: self._last_stored(ids, batch_id, needed),
            window,
        )
        if reasons.null_count == len(reasons):
            return rows
        # Put each candidate's reason back at its row (refused rows keep their own).
        positions = np.flatnonzero(valid.to_numpy(zero_copy_only=False))
        return with_reasons(rows, positions, reasons.to_pylist())

    def _seen_since(
        self, batch_id: int, needed: datetime, now: datetime, hashes: np.ndarray | None = None
    ) -> SeenIds:
        """The ids taken by earlier batches, complete from ``needed`` on (read back from
        ``schedule`` when the memory does not reach that far, expired now and then).

        While they are being read ahead (:meth:`warm`), a batch that gives its ``hashes``
        gets only those ids' entries (all a batch asks), read from the one column, instead
        of waiting for the rest: a restart's first batch among millions of taken ids.
        """
        window = timedelta(milliseconds=self.cfg.dedup_window_ms)
        # Never forget what this batch needs; keep some slack for rows stamped late.
        bound = min(needed, now - window - EXPIRY_SLACK)
        warming = self._warming
        reading = warming is not None and warming.batch_id == batch_id and not warming.done()
        if self._seen is None and reading and hashes is not None:
            assert warming is not None
            try:
                found = seen_ids(self._tables[self.layout.schedule], batch_id, bound, hashes)
            finally:
                warming.go()  # (held until now: it would have read beside this lookup)
            if found is not None:
                return found
        if self._seen is None and self._warming is not None:
            warming, self._warming = self._warming, None
            self._seen = warming.result(batch_id)
        if self._seen is None or needed < self._seen.complete_from:
            # A restart, a retried batch, or rows stored long before the batch: read the
            # taken ids back from `schedule`, so the decision is the one the data gives.
            self._seen = seen_ids(self._tables[self.layout.schedule], batch_id, bound)
        elif bound > self._seen.complete_from + window / 8:
            self._seen.expire(bound)  # now and then: it goes through every id
        return self._seen

    # -------------------------------------------- batches whose rows stay on Spark's executors

    def plan_elsewhere(self, batch_id: int) -> ElsewhereBatch | None:
        """What Spark tasks need to stamp ``batch_id`` where its rows are and write its data
        files (:mod:`engine.stamp.tasks`); ``None`` when a table it goes to takes appends
        only through the driver (a Delta feature the log appender does not honour).

        Example:
            >>> writer.plan_elsewhere(12).schedule.path  # doctest: +SKIP
            '/lake/schedule'
        """
        targets: dict[str, FileLayout | None] = {}
        for path, schema in (
            (self.layout.schedule, SCHEDULE),
            (self.layout.quarantine, QUARANTINE),
        ):
            if self._holds(path, batch_id):
                targets[path] = None  # a replay: this table has the batch already
                continue
            targets[path] = self._tables[path].file_layout(column_names(schema))
            if targets[path] is None:
                return None
        return ElsewhereBatch(
            self.cfg,
            batch_id,
            self.clock.now(),
            targets[self.layout.schedule],
            targets[self.layout.quarantine],
        )

    def refusals(
        self, batch: ElsewhereBatch, keys: pa.Table, fetch: Callable[[pa.Table], pa.Table]
    ) -> dict[tuple[int, int], str]:
        """The duplicates among a batch's valid rows, by ``(file, row)``, with their reasons.

        Args:
            batch: the batch.
            keys: one row per valid row of the batch (:data:`engine.stamp.tasks.KEYS`).
            fetch: the stamped rows at some ``(file, row)`` locations, with those columns
                (the :data:`~engine.stamp.dedup.FIRST` columns, ``deliver_ts`` and
                ``msg_id_hash``): called only for rows whose id hash comes twice or was
                seen before, usually none.

        Example:
            >>> writer.refusals(batch, keys, fetch)  # doctest: +SKIP
            {(0, 17): 'duplicate: msg_id A was already stored at 2026-01-01 00:00:00.000 UTC'}
        """
        if self.cfg.dedup_window_ms <= 0 or keys.num_rows == 0:
            return {}
        try:
            window = timedelta(milliseconds=self.cfg.dedup_window_ms)
            needed = pc.min(keys["store_ts"]).as_py() - window
            seen = self._seen_since(batch.batch, needed, batch.now)
            hashes = np.asarray(keys[ID_HASH].to_numpy(), dtype=np.int64)
            values, counts = np.unique(hashes, return_counts=True)
            suspect = seen.contains(hashes) | np.isin(hashes, values[counts > 1])
            if not suspect.any():
                return {}
            rows = fetch(keys.filter(pa.array(suspect)).select(["file", "row"]))
            # In the batch's order, as the driver path reads it: copies that tie on every
            # column of FIRST keep it, whichever tasks read their files.
            rows = rows.sort_by([("file", "ascending"), ("row", "ascending")])
            reasons = duplicate_reasons(
                rows,
                rows[ID_HASH].to_numpy(),
                seen,
                lambda ids: self._last_stored(ids, batch.batch, needed),
                window,
            ).to_pylist()
        except BaseException:
            self._seen = None
            raise
        return {
            (int(file), int(row)): why
            for file, row, why in zip(
                rows["file"].to_pylist(), rows["row"].to_pylist(), reasons, strict=True
            )
            if why is not None
        }

    def adopt(
        self,
        batch: ElsewhereBatch,
        adds: Sequence[tuple[str, dict[str, Any]]],
        keys: pa.Table,
        refused: Mapping[tuple[int, int], str],
    ) -> tuple[int, int]:
        """Commit the data files Spark tasks wrote for a batch, each table's in one commit
        under the batch's ``txn``, and remember the ids it stamped.

        Args:
            batch: the batch.
            adds: ``(table path, add action)`` of each file written.
            keys: the batch's valid rows (:data:`engine.stamp.tasks.KEYS`).
            refused: the duplicates among them (:meth:`refusals`).

        Returns:
            How many rows went to ``schedule`` and to ``quarantine``.

        Example:
            >>> writer.adopt(batch, adds, keys, refused)  # doctest: +SKIP
            (9990, 10)
        """
        counts = {self.layout.schedule: 0, self.layout.quarantine: 0}
        try:
            for path, target in (
                (self.layout.schedule, batch.schedule),
                (self.layout.quarantine, batch.quarantine),
            ):
                files = [add for table, add in adds if table == path]
                counts[path] = sum(json.loads(a["stats"])["numRecords"] for a in files)
                if target is None or not files:
                    continue
                self._written.pop(path, None)  # known again after the commit
                self._tables[path].commit_files(
                    files,
                    counts[path],
                    target,
                    txn=Txn(STAMP_APP_ID, batch.batch),
                    metadata=f"{STAMP_APP_ID} batch {batch.batch}",
                )
                self._written[path] = batch.batch
        except BaseException:
            self._seen = None
            raise
        # (also when `schedule` held the batch already: a memory rebuilt for this replay
        # holds the batches before it only)
        if self._seen is not None and keys.num_rows:
            taken = keys.filter(pa.array(~located(keys, refused)))
            self._seen.add(taken[ID_HASH].to_numpy(), taken_until(taken))
        return counts[self.layout.schedule], counts[self.layout.quarantine]

    def _last_stored(self, ids: Sequence[str], batch_id: int, needed: datetime) -> dict[str, Taken]:
        """Each id's latest copy stamped by an earlier batch and taken until ``needed`` or
        later (ids without one are left out)."""
        table = self._tables[self.layout.schedule]
        version = table.latest()
        if version < 0 or not ids:
            return {}
        store, deliver = pc.field("store_ts"), pc.field("deliver_ts")
        found = table.dataset(version).to_table(
            columns=["msg_id", "store_ts", "deliver_ts"],
            # The time bounds change no answer; they let the files' statistics skip the rest.
            filter=pc.field("msg_id").isin(pa.array(list(ids), pa.string()))
            & (pc.field("stamp_batch") < batch_id)
            & (pc.field("revision").is_null() | (pc.field("revision") == 0))
            & ((store >= needed) | (deliver >= needed)),
        )
        until = pa.array(taken_until(found), pa.int64())
        latest = (
            found.append_column("until", until)
            .group_by("msg_id")
            .aggregate([("store_ts", "max"), ("until", "max")])
        )
        return {
            msg_id: Taken(stored, from_micros(int(us)))
            for msg_id, stored, us in zip(
                latest["msg_id"].to_pylist(),
                latest["store_ts_max"].to_pylist(),
                latest["until_max"].to_pylist(),
                strict=True,
            )
        }

    def _holds(self, path: str, batch_id: int) -> bool:
        """Whether the table already holds this batch (a replay of a batch it received)."""
        if path not in self._written:
            self._written[path] = highest_batch(self._tables[path])
        return batch_id <= self._written[path]

    def _append(self, rows: pa.Table, path: str, batch_id: int, file_rows: int = 0) -> None:
        if rows.num_rows == 0 or self._holds(path, batch_id):
            return  # nothing to store, or a replayed batch that reached this table before
        try:
            self._tables[path].append(
                rows,
                txn=Txn(STAMP_APP_ID, batch_id),
                metadata=f"{STAMP_APP_ID} batch {batch_id}",
                file_rows=file_rows,
            )
        except BaseException:
            # The commit may have landed although the call failed: look it up again.
            self._written.pop(path, None)
            raise
        self._written[path] = batch_id


@dataclass(frozen=True)
class ElsewhereBatch:
    """A stamping batch whose rows are stamped and written by Spark tasks: what each task
    needs (:mod:`engine.stamp.tasks`), the same on every task and every pass.

    Attributes:
        cfg: the levels and limits.
        batch: the stamping batch.
        now: its stamping time.
        schedule: how to write ``schedule`` files (``None``: the table holds the batch).
        quarantine: how to write ``quarantine`` files (``None``: it holds the batch).
        refused: the duplicates, by ``(file, row)`` (:meth:`StampWriter.refusals`).
    """

    cfg: EngineConfig
    batch: int
    now: datetime
    schedule: FileLayout | None
    quarantine: FileLayout | None
    refused: Mapping[tuple[int, int], str] = field(default_factory=dict)


def located(keys: pa.Table, at: Iterable[tuple[int, int]]) -> np.ndarray:
    """Whether each row of ``keys`` (``file``, ``row`` columns) is at one of ``at``.

    Example:
        >>> keys = pa.table({"file": [0, 0, 1], "row": [0, 1, 0]})
        >>> located(keys, [(0, 1), (1, 0)]).tolist()
        [False, True, True]
    """

    def code(file: np.ndarray, row: np.ndarray) -> np.ndarray:
        return (np.asarray(file, dtype=np.int64) << 40) | np.asarray(row, dtype=np.int64)

    wanted = np.array(list(at), dtype=np.int64).reshape(-1, 2)
    files = keys["file"].to_numpy()
    rows = keys["row"].to_numpy()
    found: np.ndarray = np.isin(code(files, rows), code(wanted[:, 0], wanted[:, 1]))
    return found


def with_reasons(rows: pa.Table, positions: np.ndarray, reasons: Sequence[str | None]) -> pa.Table:
    """``rows`` with the ``reason`` at each of ``positions`` replaced (where not null).

    Example:
        >>> rows = pa.table({"reason": pa.array([None, None], pa.string())})
        >>> with_reasons(rows, np.array([1]), ["duplicate: x"])["reason"].to_pylist()
        [None, 'duplicate: x']
    """
    merged = np.array(rows["reason"].to_pylist(), dtype=object)
    for at, why in zip(positions.tolist(), reasons, strict=True):
        if why is not None:
            merged[at] = why
    index = rows.column_names.index("reason")
    return rows.set_column(index, "reason", pa.array(merged.tolist(), pa.string()))


class _Warming:
    """:func:`seen_ids` for one batch, read by a thread of its own; batches stamped meanwhile
    (each deciding from the entries of its own ids) are carried into it. Held, it waits for
    :meth:`go` (at most :data:`HOLD_S`) before reading."""

    def __init__(self, table: ArrowDelta, batch_id: int, since: datetime, hold: bool) -> None:
        self.batch_id = batch_id
        self._seen: SeenIds | None = None
        self._carried: list[tuple[np.ndarray, np.ndarray]] = []
        self._go = threading.Event()
        if not hold:
            self._go.set()
        self._thread = threading.Thread(
            target=self._read,
            args=(table, batch_id, since),
            name="delayq-stamp-dedup",
            daemon=True,
        )
        self._thread.start()

    def _read(self, table: ArrowDelta, batch_id: int, since: datetime) -> None:
        self._go.wait(HOLD_S)
        try:
            # (the batch it was started for: carry() moves `batch_id` on meanwhile)
            self._seen = seen_ids(table, batch_id, since)
        except Exception as err:  # the batch reads them itself, and fails there if it must
            log.warning("reading the taken ids ahead of batch %d: %s", batch_id, err)

    def go(self) -> None:
        """Start reading now, if held."""
        self._go.set()

    def done(self) -> bool:
        """Whether the reading has ended."""
        return not self._thread.is_alive()

    def carry(self, batch_id: int, hashes: np.ndarray, until: np.ndarray) -> bool:
        """Add batch ``batch_id``'s taken ids (stamped while this reads the batches before
        it); the ids are then for the batch after it. False for another batch."""
        if batch_id != self.batch_id:
            return False
        self._carried.append((hashes, until))
        self.batch_id += 1
        return True

    def result(self, batch_id: int) -> SeenIds | None:
        """The ids, once read, if they were read for ``batch_id`` (else ``None``)."""
        if batch_id != self.batch_id:
            return None  # another batch first (batches before it differ): read again
        self._go.set()
        self._thread.join()
        if self._seen is not None:
            for hashes, until in self._carried:
                self._seen.add(hashes, until)
            self._carried = []
        return self._seen


@overload
def seen_ids(table: ArrowDelta, batch_id: int, since: datetime) -> SeenIds: ...


@overload
def seen_ids(
    table: ArrowDelta, batch_id: int, since: datetime, only: np.ndarray
) -> SeenIds | None: ...


def seen_ids(
    table: ArrowDelta, batch_id: int, since: datetime, only: np.ndarray | None = None
) -> SeenIds | None:
    """The ids stamped by batches before ``batch_id`` and taken until ``since`` or later.

    Read with delta-rs from ``msg_id_hash`` and the two times (24 bytes a row); rows stamped
    before the column existed are hashed here from their ``msg_id``. With ``only`` (hashes),
    just the entries of those hashes, found in the hash column alone (usually none; ``None``
    when some rows have no hash, as rows stamped before the column existed).

    Example:
        >>> since = clock.now() - timedelta(hours=2)
        >>> table = ArrowDelta(lay.schedule)  # doctest: +SKIP
        >>> len(seen_ids(table, 12, since))  # doctest: +SKIP
        4200
    """
    seen = SeenIds(complete_from=since)
    version = table.latest()
    if version < 0:
        return seen
    store, deliver, revision = pc.field("store_ts"), pc.field("deliver_ts"), pc.field("revision")
    at = pa.scalar(since, pa.timestamp("us", tz="UTC"))
    chosen = (
        (pc.field("stamp_batch") < batch_id)
        & (revision.is_null() | (revision == 0))
        & ((store >= at) | (deliver >= at))
    )
    snapshot = table.dataset(version)
    if only is not None:
        column = snapshot.to_table(columns=[ID_HASH])[ID_HASH]
        if column.null_count:
            return None
        wanted = pa.array(np.unique(np.asarray(only, dtype=np.int64)), pa.int64())
        found = column.filter(pc.is_in(column, value_set=wanted))
        if len(found) == 0:
            return seen  # the usual: no id of the batch was taken
        chosen = chosen & pc.field(ID_HASH).isin(pc.unique(found))
    rows = snapshot.to_table(columns=[ID_HASH, "store_ts", "deliver_ts"], filter=chosen)
    if rows[ID_HASH].null_count:  # rows stamped by an older version: hash them here
        older = snapshot.to_table(
            columns=["msg_id", "store_ts", "deliver_ts"],
            filter=chosen & pc.field(ID_HASH).is_null(),
        )
        hashed = rows.filter(pc.is_valid(rows[ID_HASH]))
        rehashed = pa.table(
            {
                ID_HASH: id_hashes(older["msg_id"]),
                "store_ts": older["store_ts"],
                "deliver_ts": older["deliver_ts"],
            }
        )
        rows = pa.concat_tables([hashed, rehashed.cast(rows.schema)])
    seen.add(np.asarray(rows[ID_HASH].to_numpy(), dtype=np.int64), taken_until(rows))
    return seen


def highest_batch(table: ArrowDelta) -> int:
    """The highest stamping batch a table holds (-1 when none): its ``delayq-stamp`` txn, or
    for rows stamped before that was recorded, the files' ``stamp_batch`` statistics.

    Example:
        >>> highest_batch(ArrowDelta(lay.schedule))  # doctest: +SKIP
        41
    """
    recorded = table.txn_version(STAMP_APP_ID)
    return max(-1 if recorded is None else recorded, table.max_of("stamp_batch"))
