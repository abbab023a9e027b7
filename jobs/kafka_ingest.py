"""Kafka in, as a Spark application: read Kafka topics into ``commitlog``.

Reads ``kafka.ingest_topics`` from ``kafka.bootstrap_servers`` (``make kafka-up`` starts a
local broker) and stores each record in ``commitlog``, exactly once across restarts; records
with bad headers go to ``quarantine`` with the reason. The delay comes from the headers
``DELAY``, ``TIMER_DELIVER_MS``, ``TIMER_DELAY_SEC`` or ``TIMER_DELAY_MS``, the real topic
from ``REAL_TOPIC`` or ``kafka.topic_map`` (see ``engine.core.kafka_headers``). From the
repository root, with a broker running (``make kafka-up``)::

    source .venv/bin/activate
    spark-submit --properties-file .jars/spark-defaults.conf jobs/kafka_ingest.py --available-now

Options: ``--set kafka.ingest_topics=in_a,in_b`` (and any other key), ``--available-now``
(read what is there, then stop; without it, until Ctrl-C), ``--skip-lost-records`` (where
Kafka's retention removed records before they were stored, go on from the first record it
has; without it the job stops and says so).
Run the engine (``jobs/delay_engine.py``) beside it to deliver what it stores.
"""

from __future__ import annotations

import argparse
import sys

from engine.cli import config_from_args
from engine.core.errors import DelayQError
from engine.lakehouse.catalog.session import build_spark
from engine.produce.kafka_ingest import start_ingest
from engine.run.report import run_main, setup_logging
from engine.run.signals import StopSignals


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, start the ingest stream, print progress until it stops."""
    parser = argparse.ArgumentParser(
        prog="kafka_ingest.py",
        description="Read Kafka topics into the delay engine's commitlog (Ctrl-C stops).",
    )
    parser.add_argument("--conf", metavar="FILE", help="TOML config (default conf/engine.toml)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[])
    parser.add_argument(
        "--available-now", action="store_true", help="read what is in Kafka now, then stop"
    )
    parser.add_argument(
        "--skip-lost-records",
        action="store_true",
        help="where Kafka no longer holds the records after the stored ones (retention), go on "
        "from the first record it has (the others are lost) instead of stopping",
    )
    args = parser.parse_args(argv)
    log_file = setup_logging("kafka_ingest")
    return run_main("kafka_ingest", lambda: _ingest(args), log_file)


def _ingest(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    with StopSignals() as signals:  # Ctrl-C / SIGTERM: stop the stream, not the JVM
        signals.install()
        spark = build_spark(cfg)
        signals.install(spark)
        query = start_ingest(
            spark,
            cfg,
            available_now=args.available_now,
            skip_lost=args.skip_lost_records,
            out=lambda line: print(line, flush=True),
        )
        topics = ", ".join(cfg.kafka_ingest_topics)
        print(f"kafka_ingest: {cfg.kafka_bootstrap} [{topics}] -> {cfg.lakehouse_path}/commitlog")
        while query.isActive and not signals.requested.wait(0.5):
            pass
        if signals.requested.is_set():
            print("kafka_ingest: stopping")
            query.stop()
    failed = query.exception()
    if isinstance(failed, DelayQError):
        raise failed
    if failed is not None:
        raise DelayQError(f"ingest failed: {failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
