"""Stamping as a pure transform on Arrow: ``commitlog`` rows -> ``schedule`` or ``quarantine``.

A stamped row keeps every message column and gains ``queue_id`` (the clamped level,
0 = not delayed, -1 = timer), ``deliver_ts = store_ts + delay(level)`` (RocketMQ's
tagsCode; ``store_ts`` counted in whole milliseconds) or ``deliver_at`` for a timer message,
the ``stamp_batch`` that wrote it, and ``msg_id_hash`` (Spark's ``xxhash64(msg_id)``, the
deduplication index's key). Rows that break a rule
(:func:`engine.core.arrow_checks.rejection_reasons`) go to ``quarantine`` with the reason.

Example:
    >>> scheduled, quarantined = stamp(rows, cfg, batch_id=7, now=clock.now())  # doctest: +SKIP
"""

from __future__ import annotations

from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.core.arrow_checks import rejection_reasons, window_property
from engine.core.config import EngineConfig
from engine.core.levels import LevelTable
from engine.core.message import MAX_WINDOW_MS, WINDOW_CHARS
from engine.stamp.id_hash import xxh64
from schemas import COMMITLOG, QUARANTINE, SCHEDULE, column_names

#: The queue of timer messages (an absolute deliver time instead of a level).
TIMER_QUEUE = -1
#: Spark's ``xxhash64`` seeds XXH64 with 42.
HASH_SEED = 42
_TS = pa.timestamp("us", tz="UTC")


def queue_of(levels: LevelTable, level: pa.Array) -> np.ndarray:
    """The queue each requested level lands in: 0 when not delayed, else clamped to 1..max.

    Example:
        >>> import pyarrow as pa
        >>> from engine.core.levels import parse_levels
        >>> queue_of(parse_levels("1s 2s 3s"), pa.array([None, -1, 2, 9])).tolist()
        [0, 0, 2, 3]
    """
    asked = pc.fill_null(pc.cast(level, pa.int64()), 0).to_numpy(zero_copy_only=False)
    clipped: np.ndarray = np.clip(asked, 0, levels.max_level).astype(np.int32)
    return clipped


def delay_ms_of(levels: LevelTable, queue: np.ndarray) -> np.ndarray:
    """The delay in milliseconds of each queue id (0 for queue 0; ids past the table use
    the max).

    Example:
        >>> import numpy as np
        >>> from engine.core.levels import parse_levels
        >>> delay_ms_of(parse_levels("1s 2s 3s"), np.array([0, 1, 3, 7])).tolist()
        [0, 1000, 3000, 3000]
    """
    table = np.array((0, *levels.delays_ms), dtype=np.int64)
    delays: np.ndarray = table[np.clip(queue, 0, levels.max_level)]
    return delays


def id_hashes(msg_ids: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Spark's ``xxhash64`` of each id (null for a null id), as the signed 64-bit value.

    Example:
        >>> import pyarrow as pa
        >>> id_hashes(pa.array(["order-1:paid"])).to_pylist()
        [1610227572590971149]
    """
    return xxh64(msg_ids, HASH_SEED)


def window_offsets_us(properties: pa.Array, hashes: pa.Array) -> np.ndarray:
    """How far each row's delivery window moves its deliver time (microseconds): its id's
    hash modulo the window (``DELAYQ_WINDOW_MS``), in whole milliseconds; 0 without one.

    Messages due at one instant with a window thus spread evenly over it, and a message
    stamped again (a replay) gets the same time.

    Example:
        >>> import pyarrow as pa
        >>> props = pa.array([[("DELAYQ_WINDOW_MS", "1000")], None],
        ...                  pa.map_(pa.string(), pa.string()))
        >>> window_offsets_us(props, id_hashes(pa.array(["a", "b"]))).tolist()
        [332000, 0]
    """
    n = len(hashes)
    if not pa.types.is_map(properties.type) or properties.null_count == n:
        return np.zeros(n, dtype=np.int64)
    text = window_property(properties)
    valid = pc.match_substring_regex(text, f"^{WINDOW_CHARS}$")
    window = pc.cast(pc.if_else(pc.fill_null(valid, False), text, "0"), pa.int64())
    ms = np.minimum(window.to_numpy(zero_copy_only=False), MAX_WINDOW_MS)
    unsigned = pc.fill_null(hashes, 0).to_numpy(zero_copy_only=False).view(np.uint64)
    spread = np.where(ms > 0, unsigned % np.maximum(ms, 1).astype(np.uint64), 0)
    offsets: np.ndarray = spread.astype(np.int64) * 1000
    return offsets


def stamped(rows: pa.Table, cfg: EngineConfig, batch_id: int, now: datetime) -> pa.Table:
    """Every row with its stamp: the ``schedule`` columns and ``reason`` (null for a valid
    row; a refused row's stamp columns mean nothing, it goes to ``quarantine``).

    Args:
        rows: ``commitlog`` rows (missing columns count as null).
        cfg: the level table and the validation limits.
        batch_id: the stamping batch, recorded as ``stamp_batch``.
        now: the stamping time, recorded as ``stamped_ts``.

    Example:
        >>> stamped(rows, cfg, 7, clock.now())["deliver_ts"]  # doctest: +SKIP
    """
    n = rows.num_rows
    columns = {}
    for name in column_names(COMMITLOG):
        if name in rows.column_names:
            columns[name] = rows[name].combine_chunks()
        else:
            columns[name] = pa.nulls(n)
    reason = rejection_reasons(rows, cfg)
    timer = pc.is_valid(columns["deliver_at"]).to_numpy(zero_copy_only=False)
    level_queue = queue_of(cfg.levels, columns["delay_level"])
    queue = np.where(timer, TIMER_QUEUE, level_queue).astype(np.int32)
    store = pc.cast(pc.cast(columns["store_ts"], _TS), pa.int64())
    store_ms = pc.fill_null(pc.divide(store, 1000), 0).to_numpy(zero_copy_only=False)
    delayed = (store_ms + delay_ms_of(cfg.levels, level_queue)) * 1000
    deliver_at = pc.cast(pc.cast(columns["deliver_at"], _TS), pa.int64())
    deliver_us = np.where(
        timer, pc.fill_null(deliver_at, 0).to_numpy(zero_copy_only=False), delayed
    )
    hashes = id_hashes(columns["msg_id"])
    deliver_us = deliver_us + window_offsets_us(columns["properties"], hashes)
    # A refused row may lack the times its stamp needs: its deliver time stays null.
    unknown = pc.and_kleene(pc.is_valid(reason), pc.is_null(columns["store_ts"]))
    deliver = pc.if_else(unknown, pa.scalar(None, pa.int64()), pa.array(deliver_us, pa.int64()))
    columns.update(
        queue_id=pa.array(queue, pa.int32()),
        deliver_ts=pc.cast(deliver, _TS),
        stamp_batch=pa.array(np.full(n, batch_id, dtype=np.int64)),
        stamped_ts=pa.repeat(pa.scalar(now, _TS), n),
        revision=pa.array(np.zeros(n, dtype=np.int32)),
        msg_id_hash=hashes,
        reason=reason,
    )
    return pa.table(columns)


def stamp(
    rows: pa.Table, cfg: EngineConfig, batch_id: int, now: datetime
) -> tuple[pa.Table, pa.Table]:
    """Split ``commitlog`` rows into stamped ``schedule`` rows and ``quarantine`` rows.

    Args:
        rows: rows with the ``commitlog`` columns.
        cfg: supplies the level table and the validation limits.
        batch_id: the stamping batch, recorded as ``stamp_batch``.
        now: the stamping time, recorded as ``stamped_ts`` / ``quarantined_ts``.

    Returns:
        ``(scheduled, quarantined)`` with the ``schedule`` and ``quarantine`` columns.

    Example:
        >>> scheduled, quarantined = stamp(rows, cfg, 7, clock.now())  # doctest: +SKIP
    """
    return split(stamped(rows, cfg, batch_id, now))


def split(rows: pa.Table) -> tuple[pa.Table, pa.Table]:
    """:func:`stamped` rows split by ``reason``: ``(schedule rows, quarantine rows)``.

    Example:
        >>> scheduled, quarantined = split(stamped(rows, cfg, 7, now))  # doctest: +SKIP
    """
    refused = pc.is_valid(rows["reason"])
    scheduled = rows.filter(pc.invert(refused)).select(column_names(SCHEDULE))
    refused_rows = rows.filter(refused)
    quarantined = refused_rows.append_column("quarantined_ts", refused_rows["stamped_ts"])
    return scheduled, quarantined.select(column_names(QUARANTINE))
