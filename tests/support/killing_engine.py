"""``delayq run`` that SIGKILLs itself, JVM included, at a chosen point of its work.

Run as ``python -m tests.support.killing_engine POINT N <delayq run arguments>``; it dies the
N-th time it reaches POINT (started with ``start_new_session``, its process group is the
Python driver and its JVM, as a ``kill -9`` of a job would leave them):

| POINT          | where it dies                                                        |
|----------------|----------------------------------------------------------------------|
| ``plan``       | a round's plan is written, no topic table yet                        |
| ``topic-staged``| a topic table's data files are written, not committed               |
| ``topic-before``| a topic table is about to be committed                              |
| ``topic-after``| a topic table was committed, the round's progress not yet            |
| ``offset-temp``| the round's progress file is half written (its temporary file only) |
| ``stamp-after``| a stamping batch reached ``schedule``, not yet ``quarantine``        |
| ``round-committed``| a round's progress is in the delayOffset log (with             |
|                | ``delivery.mode = streaming``: not yet in Spark's commit log)        |
| ``query-planned``| the stamping query's batch is in Spark's offsets log, nothing written |
| ``query-written``| the stamping query's batch is written, Spark's commit log not yet  |
| ``tasks-written``| Spark tasks wrote a stamping batch's files, the driver has not     |
|                | committed them (``stamp.driver_batch_bytes = 0``, or a large batch)  |
| ``round-tasks-written``| Spark tasks wrote a round's topic files, its plan is in the  |
|                | delayOffset log, no table committed (``delivery.driver_round_rows = 0``)|
| ``commands-applied``| a round decided cancels or reschedules: their outcomes and the  |
|                | moved rows are written, no topic table yet                           |
| ``kafka-committed``| a round's Kafka transaction to a topic (``kafka.exactly_once``)   |
|                | committed with its marker, the round's progress not yet              |
| ``recurring-sent``| a firing batch of recurring schedules is in ``commitlog``, the     |
|                | batch not marked committed                                           |

The crash points wrap the engine's classes from here, so production code has no hooks. The
last line it prints says where it died (``SIGKILL at topic-staged round 7 table t1``; a
stamping point names its ``batch``; ``start yes`` ends a delivery point hit in the round a
start runs before Spark's queries), for a test to check against what is on disk
(:mod:`tests.support.crash_points`).
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from engine.cli import main
from engine.deliver.kafka_sink import TransactionalKafkaSink
from engine.deliver.round import Delivery
from engine.deliver.sinks import DeltaTopicSink
from engine.lakehouse.state.offset_log import OffsetLog
from engine.run.engine import FIRST_THREAD, Engine
from engine.stamp.query import StampQuery
from engine.stamp.writer import StampWriter

POINTS = (
    "plan",
    "topic-staged",
    "topic-before",
    "topic-after",
    "offset-temp",
    "stamp-after",
    "round-committed",
    "query-planned",
    "query-written",
    "tasks-written",
    "round-tasks-written",
    "commands-applied",
    "kafka-committed",
    "recurring-sent",
)

#: The points outside delivery rounds (stamping, firing recurring schedules).
OUTSIDE_ROUNDS = frozenset(
    {"stamp-after", "query-planned", "query-written", "tasks-written", "recurring-sent"}
)


def die(point: str, **where: object) -> None:
    said = "".join(f" {name} {value}" for name, value in where.items())
    print(f"killing-engine: SIGKILL at {point}{said}", flush=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def arm(point: str, nth: int) -> None:
    """Wrap the engine's classes so that the process dies the ``nth`` time ``point`` is hit."""
    seen = itertools.count(1)

    first_round = threading.Event()  # the round a start runs while the queries start

    def in_query() -> bool:
        # (the rounds points are about a round in the delivery query's micro-batch; the
        # first round holds the engine's round lock, so none of the query's runs meanwhile,
        # and its topic commits run in a pool's threads)
        return not first_round.is_set()

    engine_deliver = Engine._deliver

    def deliver(self: Engine, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name != FIRST_THREAD:
            return engine_deliver(self, *args, **kwargs)
        first_round.set()
        try:
            return engine_deliver(self, *args, **kwargs)
        finally:
            first_round.clear()

    def reached(**where: object) -> None:
        if next(seen) == nth:
            die(point, **where, **started())

    def started() -> dict[str, str]:
        # a delivery point hit in the round a start runs before its queries says so
        return {"start": "yes"} if first_round.is_set() and point not in OUTSIDE_ROUNDS else {}

    topic_stage = DeltaTopicSink.stage  # (a write is a stage, then its commit)

    def stage_topic(
        self: DeltaTopicSink, round_: int, table: str, rows: Any, replayed: bool
    ) -> Callable[[], None]:
        commit = topic_stage(self, round_, table, rows, replayed)
        if point == "topic-staged":
            reached(round=round_, table=table)

        def commit_topic() -> None:
            if point == "topic-before":
                reached(round=round_, table=table)
            commit()
            if point == "topic-after":
                reached(round=round_, table=table)

        return commit_topic

    offset_write = OffsetLog.write

    def write_offsets(
        self: OffsetLog,
        round_: int,
        rows: Iterable[Mapping[str, Any]],
        planned: bool = False,
        exclusive: bool = False,
    ) -> None:
        progress = not planned and self.path.endswith("delay_offset")  # not a stamping plan
        if point == "offset-temp" and progress and next(seen) == nth:
            # what a kill in the middle of put-if-absent leaves: a hidden temporary file
            temp = f"{self.path}/.tmp-{uuid.uuid4().hex}"
            self.store.write(temp, b'{"queue_id": 1, "sta')  # cut short
            die(point, round=round_, **started())
        offset_write(self, round_, rows, planned, exclusive)
        if point == "plan" and planned:
            reached(round=round_)
        if point == "round-committed" and progress and in_query():
            reached(round=round_)

    stamp_append: Callable[..., None] = StampWriter._append

    def append_stamped(self: StampWriter, rows: Any, path: str, batch_id: int, *args: Any) -> None:
        # (a replayed batch that reached the table before writes nothing: no kill there)
        writes = rows.num_rows > 0 and not self._holds(path, batch_id)
        stamp_append(self, rows, path, batch_id, *args)
        if point == "stamp-after" and path == self.layout.schedule and writes:
            reached(batch=batch_id)

    query_run = StampQuery._run

    def run_query_batch(self: StampQuery, frame: Any, batch_id: int) -> None:
        # (only batches with files: the first triggers of a query may plan none)
        files = self.source.between(*self._range(batch_id))
        if point == "query-planned" and files:
            reached(batch=batch_id)
        query_run(self, frame, batch_id)
        if point == "query-written" and files:
            reached(batch=batch_id)

    adopt_files = StampWriter.adopt

    def adopt_written(self: StampWriter, batch: Any, adds: Any, *args: Any) -> tuple[int, int]:
        if point == "tasks-written" and adds:
            reached(stamp_batch=batch.batch)  # (the stamping batch, not Spark's id)
        return adopt_files(self, batch, adds, *args)

    commit_files = DeltaTopicSink.commit_files

    def commit_written(self: DeltaTopicSink, round_: int, table: str, *args: Any) -> None:
        if point == "round-tasks-written" and in_query():
            reached(round=round_, table=table)
        commit_files(self, round_, table, *args)

    apply_commands = Delivery._apply_commands

    def commands_applied(self: Delivery, resolution: Any, plan: Any, *args: Any) -> None:
        apply_commands(self, resolution, plan, *args)
        if point == "commands-applied" and resolution.results:
            reached(round=plan.round)

    kafka_write = TransactionalKafkaSink.write

    def kafka_written(
        self: TransactionalKafkaSink, round_: int, table: str, rows: Any, replayed: bool
    ) -> None:
        kafka_write(self, round_, table, rows, replayed)
        if point == "kafka-committed" and rows.num_rows:
            reached(round=round_, table=table)

    send_recurring = Engine._send_recurring

    def recurring_sent(self: Engine, rows: Any, txn: Any) -> None:
        send_recurring(self, rows, txn)
        if point == "recurring-sent":
            reached(batch=txn.version)

    Engine._send_recurring = recurring_sent  # type: ignore[method-assign]
    Engine._deliver = deliver  # type: ignore[method-assign]
    Delivery._apply_commands = commands_applied  # type: ignore[method-assign]
    TransactionalKafkaSink.write = kafka_written  # type: ignore[method-assign]
    DeltaTopicSink.commit_files = commit_written  # type: ignore[method-assign]
    StampQuery._run = run_query_batch  # type: ignore[method-assign]
    StampWriter.adopt = adopt_written  # type: ignore[method-assign]
    DeltaTopicSink.stage = stage_topic  # type: ignore[method-assign]
    OffsetLog.write = write_offsets  # type: ignore[method-assign]
    StampWriter._append = append_stamped  # type: ignore[method-assign]


if __name__ == "__main__":
    chosen, count, *run_args = sys.argv[1:]
    if chosen not in POINTS:
        sys.exit(f"unknown point {chosen!r}; one of {', '.join(POINTS)}")
    arm(chosen, int(count))
    sys.exit(main(["run", *run_args]))
