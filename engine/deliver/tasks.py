"""A large delivery round read and written by Spark tasks: its rows never reach the driver.

With ``delivery.mode = streaming``, a round whose window's ``schedule`` files hold more than
``delivery.driver_round_rows`` rows (a spike due at one instant, a backlog, catch-up after
downtime) runs its scan and its topic files in one Spark job
(:func:`deliver_on_executors`): the window's files
(:class:`~engine.lakehouse.delta.live_files.Part`) go to the tasks in groups of about equal
rows, and each task

1. reads its files with pyarrow and finds the round's candidates in them, exactly as the
   driver path does (:func:`~engine.deliver.due.read_candidates`: the same window, the same
   rows taken out by cancels and reschedules);
2. shapes the due rows as topic rows (:func:`~engine.deliver.due.to_topic_rows`, with the
   ``delivered_ts`` the driver chose) and writes each topic table's data files
   (:func:`~engine.lakehouse.delta.log_append.write_files`), unseen: no commit adds them yet;
3. sends back what the round's progress needs: its part of the summary (rows per queue,
   highest batch and deliver time), its lateness counts and each file's ``add`` action.

The driver then commits each table's files in one commit under the round's ``txn``, once the
clock has reached the watermark (:class:`~engine.deliver.round.Delivery`), and its progress
after them: the order, and so the exactly-once and never-early rules, of the driver path.
Files of a round that dies before its commits are in no table (``VACUUM`` removes them); the
replay writes its rows again and commits only the tables its ``txn`` does not show.

A task writes a table it has no layout for with the layout every topic table has
(:data:`~schemas.TOPIC`'s, the first time); the driver checks each such table's real layout
before it commits (:class:`Written` ``.guessed``) and has the tasks write again what does not
match.

Example:
    >>> written = deliver_on_executors(spark, job)  # doctest: +SKIP
    >>> written.counts  # doctest: +SKIP
    {'orders': 1000000}
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa
from pyspark.sql import SparkSession

from engine.core.groups import balanced
from engine.deliver.due import Window, read_candidates, to_topic_rows, topic_tables
from engine.deliver.lateness import Lateness
from engine.lakehouse.delta.live_files import Part, files_dataset
from engine.lakehouse.delta.log_append import FileLayout, write_files
from engine.lakehouse.storage.location import arrive, store_for

#: Tasks answer in one binary column (JSON).
_PACKED = "packed binary"
#: What a summary entry is keyed by (:class:`~engine.deliver.due.Candidates`).
_KEY = ("topic", "queue_id", "_due", "_new", "_removed")


@dataclass(frozen=True)
class RoundJob:
    """What the tasks of one round need (pickled into each task).

    Attributes:
        schedule: the ``schedule`` table.
        schema: its Arrow schema at the round's version.
        parts: the window's files.
        window: the round's bounds.
        removed: ``(msg_id, revision)`` of rows cancels and reschedules took out.
        delivered_ts: what the topic rows' ``delivered_ts`` says.
        round: the round (the topic rows' ``delivery_round``).
        layouts: per topic table (lower case), how to write its files.
        topic_path: a topic table's location, from its name.
        template: the layout of a topic table the driver has not given (its path replaced).
        only: write only these tables (a second pass); ``None``: every table.
        settings: what reaches an S3 lakehouse (:func:`~engine.lakehouse.storage.location.carried`).
        tasks: how many tasks (about equal rows each).
    """

    schedule: str
    schema: pa.Schema
    parts: Sequence[Part]
    window: Window
    removed: frozenset[tuple[str, int]]
    delivered_ts: datetime
    round: int
    layouts: Mapping[str, FileLayout]
    topic_path: Callable[[str], str]
    template: FileLayout
    only: frozenset[str] | None = None
    settings: dict[str, Any] | None = None
    tasks: int = 2

    def layout(self, table: str) -> FileLayout:
        """How the tasks write ``table``'s files (given, or the template's)."""
        known = self.layouts.get(table)
        if known is not None:
            return known
        return dataclasses.replace(self.template, path=self.topic_path(table))


@dataclass
class Written:
    """What the tasks did of a round.

    Attributes:
        summary: the round's summary (as :class:`~engine.deliver.due.Candidates` has it).
        files: ``schedule`` files the tasks read (after the window skipped the others).
        rows: rows those files held.
        lateness: the due rows' lateness at ``delivered_ts``.
        adds: per topic table, the ``add`` actions of its files.
        counts: per topic table, the rows its files hold.
        layouts: per topic table, the layout its files were written for.
        guessed: tables written with the template's layout (to check before a commit).
        ahead: written ahead of the round's instant (:mod:`engine.deliver.ahead`).
        mixed: tables whose passes were written for different layouts.
    """

    summary: list[dict[str, Any]]
    files: int
    rows: int
    lateness: Lateness
    adds: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    layouts: dict[str, FileLayout] = field(default_factory=dict)
    guessed: set[str] = field(default_factory=set)
    ahead: bool = False
    mixed: set[str] = field(default_factory=set)

    def absorb(self, other: Written) -> None:
        """Add another pass's rows (other rows of the same round) to this one's.

        Example:
            >>> first.absorb(second)  # doctest: +SKIP
        """
        for table, adds in other.adds.items():
            self.adds.setdefault(table, []).extend(adds)
            self.counts[table] = self.counts.get(table, 0) + other.counts.get(table, 0)
            if self.layouts.setdefault(table, other.layouts[table]) != other.layouts[table]:
                self.mixed.add(table)  # (its files cannot go in one commit)
        self.guessed |= other.guessed
        self.summary = merged(self.summary + other.summary)
        self.files += other.files
        self.rows += other.rows
        self.lateness += other.lateness

    def redo(self, again: Written, tables: set[str]) -> None:
        """Take ``tables``' files from a second pass (``again``) instead of the first's."""
        for table in tables:
            self.adds[table] = again.adds.get(table, [])
            self.counts[table] = again.counts.get(table, 0)
            self.layouts[table] = again.layouts[table]
            self.guessed.discard(table)


def deliver_in_group(spark: SparkSession, job: RoundJob, group: str) -> Written:
    """:func:`deliver_on_executors` in Spark job group ``group`` (cancelled with
    ``cancelJobGroup``), from a thread of its own.

    Example:
        >>> pool.submit(deliver_in_group, spark, job, "delayq-ahead-7")  # doctest: +SKIP
    """
    spark.sparkContext.setJobGroup(group, "delayq: a round written ahead", interruptOnCancel=True)
    try:
        return deliver_on_executors(spark, job)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]


def deliver_on_executors(spark: SparkSession, job: RoundJob) -> Written:
    """Scan a round's window and write its topic files in Spark tasks (see the module).

    Args:
        spark: the engine's session.
        job: the round's files, bounds and layouts.

    Returns:
        The round's summary and the files written per topic table (none committed).

    Example:
        >>> deliver_on_executors(spark, job).files  # doctest: +SKIP
        10
    """
    groups = balanced([p.rows for p in job.parts], job.tasks)
    frame = spark.range(0, len(groups), 1, max(1, len(groups)))
    answers = frame.mapInArrow(_task(job, groups), _PACKED).toArrow()
    found = [json.loads(bytes(v)) for v in answers.column(0).to_pylist()]
    written = Written(
        summary=merged([s for f in found for s in f["summary"]]),
        files=sum(f["files"] for f in found),
        rows=sum(f["rows"] for f in found),
        lateness=sum((Lateness(tuple(f["lateness"][0]), *f["lateness"][1:]) for f in found),
                     Lateness()),
    )  # fmt: skip
    for f in found:
        for table, adds in f["adds"].items():
            written.adds.setdefault(table, []).extend(adds)
            written.counts[table] = written.counts.get(table, 0) + f["counts"][table]
    for table in written.adds:
        written.layouts[table] = job.layout(table)
        if table not in job.layouts:
            written.guessed.add(table)
    return written


def merged(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Summary entries of several tasks as one entry per key: rows added up, the highest
    batch and deliver time kept.

    Example:
        >>> a = {"topic": "t", "queue_id": 1, "_due": True, "_new": True, "_removed": False,
        ...      "n": 2, "max_batch": 4, "max_deliver_ms": 10}
        >>> [e["n"] for e in merged([a, dict(a, n=3, max_batch=5)])]
        [5]
    """
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for entry in summary:
        key = tuple(entry[k] for k in _KEY)
        seen = out.get(key)
        if seen is None:
            out[key] = dict(entry)
            continue
        seen["n"] += entry["n"]
        seen["max_batch"] = max(seen["max_batch"], entry["max_batch"])
        highs = [v for v in (seen["max_deliver_ms"], entry["max_deliver_ms"]) if v is not None]
        seen["max_deliver_ms"] = max(highs) if highs else None
    return list(out.values())


def _task(
    job: RoundJob, groups: list[list[int]]
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for group in batch.column(0).to_pylist():
                answer = _deliver_group(job, [job.parts[i] for i in groups[int(group)]])
                packed = json.dumps(answer).encode()
                yield pa.RecordBatch.from_arrays([pa.array([packed], pa.binary())], ["packed"])

    return run


def _deliver_group(job: RoundJob, parts: list[Part]) -> dict[str, Any]:
    """One task's share of the round: its candidates, summary, lateness and topic files."""
    arrive(job.schedule, job.settings)
    dataset = files_dataset(parts, job.schema, store_for(job.schedule))
    found = read_candidates(dataset, job.window, job.removed)
    due = found.deliver
    tables = topic_tables(to_topic_rows(due, job.delivered_ts, job.round))
    adds: dict[str, list[dict[str, Any]]] = {}
    counts: dict[str, int] = {}
    for table, rows in tables.items():
        if job.only is not None and table not in job.only:
            continue
        target = job.layout(table)
        arrive(target.path, job.settings)
        adds[table] = write_files(target, rows)
        counts[table] = rows.num_rows
    late = Lateness.of(due["deliver_ts"], job.delivered_ts)
    return {
        "summary": found.summary,
        "files": found.files,
        "rows": found.rows,
        "lateness": [list(late.counts), late.total_s, late.n, late.max_s],
        "adds": adds,
        "counts": counts,
    }


__all__ = ["RoundJob", "Written", "deliver_in_group", "deliver_on_executors", "merged"]
