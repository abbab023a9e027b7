"""Write the JVM's class data archive for delayq's Sparks (``make jars`` runs this once).

A Spark driver spends seconds of each start reading, parsing and verifying the same ten
thousand classes from the jars. This tool starts one Spark with
``-XX:ArchiveClassesAtExit``, runs what a delayq process does (sends, stamps and delivers a
few messages on a throw-away lakehouse with the embedded catalog, reads the views, runs
``delayq status``), and stops it; the JVM writes the classes it loaded to the archive as it
exits. Every later driver maps the archive instead (:func:`engine.lakehouse.catalog.session.
driver_java_options`, and ``spark-defaults.conf`` for ``spark-submit``): a ``delayq``
command that starts a Spark of its own takes about a quarter less.

The archive belongs to these jars and this JDK: ``make jars`` writes it again with new
jars, and a JVM that finds it stale runs without it.

From the shell::

    python -m jobs.tools.class_archive --out .jars/classes.jsa
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pyspark.sql import SparkSession

from engine.cli import main as delayq
from engine.core.config import EngineConfig
from engine.core.levels import parse_levels
from engine.lakehouse.catalog.names import register_all
from engine.lakehouse.catalog.session import DRIVER_JAVA_OPTIONS, build_spark
from engine.produce.send import Message, send_many
from engine.run.engine import Engine

#: Longest the sample run may take before the archive is written anyway.
RUN_S = 120.0


def write_archive(out: Path, workdir: Path, say: Callable[[str], None] = print) -> None:
    """Run a small delayq workload in a Spark that writes ``out`` as its JVM exits, and
    wait for that JVM to exit.

    Example:
        >>> write_archive(Path(".jars/classes.jsa"), Path("work"))  # doctest: +SKIP
    """
    lakehouse = workdir / "lakehouse"
    cfg = EngineConfig(
        lakehouse=str(lakehouse),
        database="delayq_archive",
        levels=parse_levels("1s"),
        log_level="ERROR",
        spark_conf={
            "spark.driver.extraJavaOptions": f"{DRIVER_JAVA_OPTIONS} "
            f"-XX:ArchiveClassesAtExit={out} -Xlog:cds=off -Xlog:cds+dynamic=off",
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "2",
        },
    )
    started = time.monotonic()

    def step(what: str) -> None:
        say(f"  {what} ({time.monotonic() - started:.0f} s)")

    spark = build_spark(cfg)
    step("a Spark started")
    gateway = spark.sparkContext._gateway
    jvm = getattr(gateway, "proc", None)
    finished = False
    try:
        _workload(spark, cfg)
        step("4 messages sent, stamped and delivered, the views read, delayq status run")
        finished = True
    finally:
        spark.stop()
        if gateway is not None and jvm is not None:  # it exits when its stdin closes, then writes
            gateway.shutdown()
            jvm.stdin.close()
            try:
                jvm.wait(timeout=RUN_S)
            except subprocess.TimeoutExpired:
                finished = False
            if not finished:  # no archive of a run cut short
                jvm.kill()
                jvm.wait()
                out.unlink(missing_ok=True)
    step("the JVM wrote the archive and exited")


def _workload(spark: SparkSession, cfg: EngineConfig) -> None:
    send_many(spark, cfg, [Message("orders", f"m{i}", delay_level=i % 2) for i in range(4)])
    engine = Engine(spark, cfg, out=lambda _line: None)
    try:
        engine.run(until_idle=True, max_seconds=RUN_S)
    finally:
        engine.stop()
    register_all(spark, cfg)
    spark.sql(f"SELECT count(*) FROM {cfg.database}.pending").collect()
    with contextlib.redirect_stdout(io.StringIO()):
        delayq(["status", "--set", f"lakehouse.path={cfg.lakehouse}",
                "--set", f"lakehouse.database={cfg.database}"])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Write the archive; exit 0 when it was written, 1 (one line why) when not."""
    parser = argparse.ArgumentParser(prog="python -m jobs.tools.class_archive")
    parser.add_argument("--out", type=Path, required=True, help="the archive to write")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.unlink(missing_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="delayq-archive-") as workdir:
        write_archive(out, Path(workdir))
    if not out.is_file():
        print(f"class_archive: the JVM wrote no {out}", file=sys.stderr)
        return 1
    size = out.stat().st_size / 2**20
    print(f"class archive {out}: {size:.0f} MB in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
