"""What one Structured Streaming micro-batch costs here: the floor a Spark-native stamping or
delivery query would stand on (issue "The engine is a Spark Structured Streaming application
again").

Each query runs alone for ``--seconds`` on a throw-away lakehouse, as fast as its trigger
lets it, and its progress events (``StreamingQueryProgress.durationMs``) are summarised per
phase: the whole trigger, ``latestOffset`` (planning the batch's end), ``queryPlanning``,
``walCommit`` (the offsets log, before the batch runs), ``addBatch`` (the ``foreachBatch``
function) and ``commitOffsets``. The queries, from the least work to a whole stage:

* ``noop``: the rate source, ``foreachBatch`` doing nothing (the trigger's own cost);
* ``count``: the same, counting the batch (one Spark job per batch);
* ``clock``: a Python ``DataSourceStreamReader`` whose offsets are the clock's milliseconds
  (as a watermark-driven delivery query would plan), ``foreachBatch`` counting;
* ``delta_spark``: Delta's streaming source over a table a producer thread appends to (1,000
  rows every 100 ms, through the engine's log appender), ``foreachBatch`` appending the batch
  to another Delta table with Spark, idempotently (``txnAppId``/``txnVersion`` = batch id);
* ``delta_arrow``: the same source, ``foreachBatch`` taking the batch to the driver as Arrow
  and committing it with the log appender (``txn`` = batch id), as the driver path commits.

From the shell (``--conf`` as ``spark-submit``'s, repeatable)::

    .venv/bin/python -m jobs.tools.stream_floor --queries noop,count,delta_spark --seconds 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit
from pyspark.sql.types import StructType

from engine.core.config import load_config
from engine.lakehouse.catalog.session import build_spark
from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.delta.log_append import LogAppender

QUERIES = ("noop", "count", "clock", "delta_spark", "delta_arrow")
PHASES = ("triggerExecution", "latestOffset", "queryPlanning", "walCommit", "addBatch",
          "commitOffsets")  # fmt: skip
ROWS_PER_APPEND = 1000
APPEND_EVERY_S = 0.1


class ClockSource(DataSource):
    """Offsets are the clock's milliseconds; a batch (start, end] yields one row per ms."""

    @classmethod
    def name(cls) -> str:
        return "delayq_floor_clock"

    def schema(self) -> str:
        return "ms long"

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return ClockReader()


class ClockReader(DataSourceStreamReader):
    """The reader of :class:`ClockSource`."""

    def initialOffset(self) -> dict[str, int]:
        return {"ms": int(time.time() * 1000)}

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        return {"ms": max(start["ms"], int(time.time() * 1000))}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        return [InputPartition((start["ms"], end["ms"]))]

    def read(self, partition: InputPartition) -> Iterator[tuple[int]]:
        first, last = partition.value
        for ms in range(first + 1, last + 1):
            yield (ms,)


def _feeder(path: str, stop: threading.Event) -> None:
    """Append ``ROWS_PER_APPEND`` rows every ``APPEND_EVERY_S`` until ``stop``."""
    appender = LogAppender(path)
    n = 0
    while not stop.is_set():
        ids = pa.array(range(n, n + ROWS_PER_APPEND), pa.int64())
        appender.append(pa.table({"id": ids, "body": pa.array([b"x" * 100] * ROWS_PER_APPEND)}))
        n += ROWS_PER_APPEND
        stop.wait(APPEND_EVERY_S)


def _query(spark: SparkSession, name: str, root: Path) -> tuple[DataFrame, Callable[..., None]]:
    """The streaming DataFrame and the ``foreachBatch`` function of query ``name``."""
    if name in ("noop", "count"):
        frame = spark.readStream.format("rate").option("rowsPerSecond", 10_000).load()
    elif name == "clock":
        spark.dataSource.register(ClockSource)
        frame = spark.readStream.format("delayq_floor_clock").load()
    else:
        frame = spark.readStream.format("delta").load(str(root / "source"))
    sink = str(root / "sink")

    def noop(df: DataFrame, batch: int) -> None:
        return None

    def count(df: DataFrame, batch: int) -> None:
        df.count()

    def delta_spark(df: DataFrame, batch: int) -> None:
        (df.write.format("delta").mode("append").option("txnAppId", "floor")
         .option("txnVersion", batch).save(sink))  # fmt: skip

    appender = LogAppender(sink)

    def delta_arrow(df: DataFrame, batch: int) -> None:
        appender.append(df.toArrow(), txn=Txn("floor", batch))

    chosen = {"noop": noop, "count": count, "clock": count, "delta_spark": delta_spark,
              "delta_arrow": delta_arrow}  # fmt: skip
    return frame, chosen[name]


def _summary(progress: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    batches = [p for p in progress if p.get("numInputRows", 0) > 0] or progress
    out: dict[str, Any] = {"batches": len(progress), "with_rows": len(batches),
                           "rows": sum(p.get("numInputRows", 0) for p in progress),
                           "batches_per_s": round(len(progress) / seconds, 2)}  # fmt: skip
    for phase in PHASES:
        values = sorted(p["durationMs"].get(phase, 0) for p in batches[1:] or batches)
        if values:
            out[phase] = {
                "p50": statistics.median(values),
                "p95": values[min(len(values) - 1, int(0.95 * len(values)))],
                "max": values[-1],
            }
    return out


def run(spark: SparkSession, name: str, seconds: float, trigger: str) -> dict[str, Any]:
    """Run query ``name`` for ``seconds``; its summary."""
    root = Path(tempfile.mkdtemp(prefix=f"floor-{name}-"))
    for table in ("source", "sink"):
        spark.createDataFrame([], "id BIGINT, body BINARY").write.format("delta").save(
            str(root / table)
        )
    stop = threading.Event()
    feeder = threading.Thread(target=_feeder, args=(str(root / "source"), stop), daemon=True)
    if name.startswith("delta"):
        feeder.start()
    frame, batch_fn = _query(spark, name, root)
    query = (frame.writeStream.queryName(f"floor_{name}").foreachBatch(batch_fn)
             .option("checkpointLocation", str(root / "_checkpoint"))
             .trigger(processingTime=trigger).start())  # fmt: skip
    started = time.monotonic()
    progress: list[dict[str, Any]] = []
    seen: set[int] = set()
    while time.monotonic() - started < seconds:
        time.sleep(1.0)
        for event in query.recentProgress:
            if event["batchId"] not in seen:
                seen.add(event["batchId"])
                progress.append(event)
        if query.exception() is not None:
            raise RuntimeError(f"{name}: {query.exception()}")
    query.stop()
    stop.set()
    return _summary(progress, time.monotonic() - started)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen queries one after the other; print a table and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", default=",".join(QUERIES))
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--trigger", default="0 seconds", help="processingTime of each query")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default="bench/out/stream_floor.json")
    args = parser.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.conf)
    extra.setdefault("spark.sql.streaming.numRecentProgressUpdates", "2000")
    extra.setdefault("spark.ui.enabled", "false")
    extra.setdefault("spark.sql.shuffle.partitions", "2")
    # a Python streaming source plans on the driver in a Python process of its own: this
    # interpreter (else the python3 on PATH, which may lack pyarrow)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    with tempfile.TemporaryDirectory() as lake:
        cfg = load_config(overrides={"lakehouse.path": lake, "sql.catalog": "memory"})
        spark = build_spark(cfg, extra)
        results = {}
        for name in args.queries.split(","):
            results[name] = run(spark, name, args.seconds, args.trigger)
            r = results[name]
            cells = " ".join(f"{p}={r[p]['p50']:.0f}/{r[p]['p95']:.0f}" for p in PHASES if p in r)
            print(f"{name:12} {r['batches']:4d} batches ({r['batches_per_s']}/s, "
                  f"{r['rows']} rows) ms p50/p95: {cells}", flush=True)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conf": extra, "trigger": args.trigger, "results": results},
                              indent=2))  # fmt: skip
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
