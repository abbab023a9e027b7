"""Stamping as a pure transform: ``commitlog`` rows -> ``schedule`` rows or ``quarantine`` rows.

A stamped row keeps every message column and gains ``queue_id`` (the clamped level,
0 = not delayed, -1 = timer), ``deliver_ts = store_ts + delay(level)`` (RocketMQ's
tagsCode) or ``deliver_at`` for a timer message, and the ``stamp_batch`` that wrote it.
Rows that break a rule (:func:`engine.core.message.rejection_reason`) go to ``quarantine``
with the reason.

Example:
    >>> scheduled, quarantined = stamp(batch, cfg, batch_id=7, now=clock.now())  # doctest: +SKIP
"""

from __future__ import annotations

from datetime import datetime

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from engine.core.config import EngineConfig
from engine.core.levels import LevelTable
from engine.core.message import rejection_reason
from schemas import COMMITLOG, SCHEDULE, column_names

#: The queue of timer messages (an absolute deliver time instead of a level).
TIMER_QUEUE = -1


def queue_of(levels: LevelTable, level: Column) -> Column:
    """The queue a requested level lands in: 0 when not delayed, else clamped to 1..max."""
    return (
        F.when(level.isNull() | (level <= 0), F.lit(0))
        .otherwise(F.least(level, F.lit(levels.max_level)))
        .cast("int")
    )


def delay_ms_of(levels: LevelTable, queue: Column) -> Column:
    """The delay in milliseconds of a queue id (0 for queue 0; ids past the table use the max)."""
    table = F.array(*[F.lit(ms) for ms in (0, *levels.delays_ms)])
    index = F.least(F.greatest(queue, F.lit(0)), F.lit(levels.max_level)) + 1
    return F.element_at(table, index).cast("long")


def check(df: DataFrame, cfg: EngineConfig) -> DataFrame:
    """``commitlog`` rows with ``reason``: why a row is refused, or null when it is valid.

    Example:
        >>> check(batch, cfg).where("reason IS NOT NULL").count()  # doctest: +SKIP
        0
    """
    return df.select(
        *[F.col(c) for c in column_names(COMMITLOG)], rejection_reason(cfg).alias("reason")
    )


def stamped(checked: DataFrame, cfg: EngineConfig, batch_id: int, now: datetime) -> DataFrame:
    """Every row of :func:`check`'s output with its stamp: the ``schedule`` columns and
    ``reason`` (a refused row's stamp columns mean nothing; it goes to ``quarantine``).

    Example:
        >>> stamped(check(batch, cfg), cfg, 7, clock.now()).toArrow()  # doctest: +SKIP
    """
    timer = F.col("deliver_at").isNotNull()
    level_queue = queue_of(cfg.levels, F.col("delay_level"))
    queue = F.when(timer, F.lit(TIMER_QUEUE)).otherwise(level_queue)
    delayed = F.timestamp_millis(F.unix_millis("store_ts") + delay_ms_of(cfg.levels, level_queue))
    deliver = F.when(timer, F.col("deliver_at")).otherwise(delayed)
    return checked.select(
        *[F.col(c) for c in column_names(COMMITLOG)],
        queue.alias("queue_id"),
        deliver.alias("deliver_ts"),
        F.lit(batch_id).cast("long").alias("stamp_batch"),
        F.lit(now).alias("stamped_ts"),
        F.lit(0).alias("revision"),
        F.xxhash64("msg_id").alias("msg_id_hash"),
        F.col("reason"),
    )


def scheduled_rows(
    checked: DataFrame, cfg: EngineConfig, batch_id: int, now: datetime
) -> DataFrame:
    """The valid rows of :func:`check`'s output, stamped (the ``schedule`` schema).

    Example:
        >>> scheduled_rows(check(batch, cfg), cfg, 7, clock.now())  # doctest: +SKIP
    """
    rows = stamped(checked, cfg, batch_id, now)
    return rows.where(F.col("reason").isNull()).select(*column_names(SCHEDULE))


def quarantined_rows(checked: DataFrame, batch_id: int, now: datetime) -> DataFrame:
    """The refused rows of :func:`check`'s output with their reason (``quarantine`` schema).

    Example:
        >>> quarantined_rows(check(batch, cfg), 7, clock.now())  # doctest: +SKIP
    """
    return checked.where(F.col("reason").isNotNull()).select(
        *[F.col(c) for c in column_names(COMMITLOG)],
        F.col("reason"),
        F.lit(batch_id).cast("long").alias("stamp_batch"),
        F.lit(now).alias("quarantined_ts"),
    )


def stamp(
    df: DataFrame, cfg: EngineConfig, batch_id: int, now: datetime
) -> tuple[DataFrame, DataFrame]:
    """Split ``commitlog`` rows into stamped ``schedule`` rows and ``quarantine`` rows.

    Args:
        df: rows with the ``commitlog`` schema.
        cfg: supplies the level table and the validation limits.
        batch_id: the stamping micro-batch, recorded as ``stamp_batch``.
        now: the stamping time, recorded as ``stamped_ts`` / ``quarantined_ts``.

    Returns:
        ``(scheduled, quarantined)`` with the ``schedule`` and ``quarantine`` schemas.
    """
    checked = check(df, cfg)
    return scheduled_rows(checked, cfg, batch_id, now), quarantined_rows(checked, batch_id, now)
