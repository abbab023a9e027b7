"""Crash injection through the engine's sink seam, not hooks in production classes.

``crash_after_writes()`` builds the real sinks and fails after each topic write: the round
dies after its topic writes and before its progress commit, as a SIGKILL there would leave
it. ``crash_writing("beta")`` fails the write of one table before it happens.
``crash_before_commits()`` lets the Delta sink write every table's data files and fails
before the first commit that would show them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa
from pyspark.sql import SparkSession

from engine.core.config import EngineConfig
from engine.deliver.sinks import DeltaTopicSink, SinkFactory, Sinks, SinkSet, TopicSink
from engine.lakehouse.storage.layout import Layout


class Crash(Exception):
    """The process died here."""


class _CrashingSink:
    def __init__(self, inner: TopicSink, tables: set[str] | None, after: bool) -> None:
        self.inner, self.tables, self.after = inner, tables, after

    def written(self, round_: int, table: str) -> bool:
        return self.inner.written(round_, table)

    def stage(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> Callable[[], None]:
        return lambda: self.write(round_, table, rows, replayed)  # all of it at the commit

    def write(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> None:
        chosen = self.tables is None or table in self.tables
        if chosen and not self.after:
            raise Crash(f"died while writing {table}")
        self.inner.write(round_, table, rows, replayed)
        if chosen:
            raise Crash(f"died after writing {table}, before the progress commit")


class _StagingThenCrashing:
    def __init__(self, inner: DeltaTopicSink) -> None:
        self.inner = inner

    def written(self, round_: int, table: str) -> bool:
        return self.inner.written(round_, table)

    def write(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> None:
        self.stage(round_, table, rows, replayed)()

    def stage(self, round_: int, table: str, rows: pa.Table, replayed: bool) -> Callable[[], None]:
        self.inner.stage(round_, table, rows, replayed)  # the data files, never committed

        def commit() -> None:
            raise Crash(f"died after writing the files of {table}, before its commit")

        return commit


class _StagingSinks:
    def __init__(self, inner: Sinks) -> None:
        self.inner = inner

    def of(self, table: str) -> Sequence[TopicSink]:
        return [_StagingThenCrashing(self.inner.delta)]


class _CrashingSinks:
    def __init__(self, inner: SinkSet, tables: set[str] | None, after: bool) -> None:
        self.inner, self.tables, self.after = inner, tables, after

    def of(self, table: str) -> Sequence[TopicSink]:
        sinks = list(self.inner.of(table))
        # Die after the table's last write, or before its first.
        at = len(sinks) - 1 if self.after else 0
        return [
            _CrashingSink(s, self.tables, self.after) if i == at else s for i, s in enumerate(sinks)
        ]


def _factory(tables: set[str] | None, after: bool) -> SinkFactory:
    def build(spark: SparkSession, cfg: EngineConfig, layout: Layout, checkpoint: str) -> SinkSet:
        return _CrashingSinks(Sinks(spark, cfg, layout, checkpoint), tables, after)

    return build


def crash_after_writes() -> SinkFactory:
    """Sinks that write every table, then die before the round commits."""
    return _factory(None, after=True)


def crash_before_commits() -> SinkFactory:
    """Delta sinks that write every table's data files, then die before committing any."""

    def build(spark: SparkSession, cfg: EngineConfig, layout: Layout, checkpoint: str) -> SinkSet:
        return _StagingSinks(Sinks(spark, cfg, layout, checkpoint))

    return build


def crash_writing(*tables: str) -> SinkFactory:
    """Sinks that die when asked to write one of ``tables`` (others are written)."""
    return _factory(set(tables), after=False)
