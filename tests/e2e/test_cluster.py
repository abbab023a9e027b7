"""The engine and a consumer as applications on a real Spark standalone cluster (a master and
two workers, started once for the module as ``make cluster-up`` does) with the lakehouse in an
S3 bucket of a real S3 server (as ``make s3-up`` starts), through a lost worker and a killed
driver. Producers send from the test's own application; every process gets the bucket's
credentials from its environment."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from engine.produce.send import Message, send_many
from jobs.tools.cluster import Cluster, describe, kill, read_state, start, stop
from jobs.tools.objectstore import Server
from tests.support.lakehouse import assert_exactly_once_never_early, delivered_rows
from tests.support.objectstore import s3_cfg
from tests.support.process import VENV_BIN, engine_args, wait_for
from tests.support.process import start as start_process

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("cluster")
    ports = {"port": _free_port(), "ui_port": _free_port()}
    state = start(home, workers=2, cores=2, memory="2g", **ports)
    print(f"\ncluster started in {state.started_in} s")
    yield state
    stop(home)


def _wave(k: int, n: int) -> list[Message]:
    """Levels 0-3 and timers up to 6 s, all to ``orders`` (the consumer's topic)."""
    return [
        Message("orders", f"w{k}-{i}", delay_level=i % 4)
        if i % 3
        else Message("orders", f"w{k}-{i}", delay=f"{i % 7}s")
        for i in range(n)
    ]


def test_on_the_cluster_every_message_once_never_early_through_a_lost_worker_and_driver(
    spark: SparkSession, make_cfg: Any, tmp_path: Path, cluster: Cluster, s3: Server
) -> None:
    cfg = s3_cfg(make_cfg, s3)
    assert cfg.lakehouse.startswith("s3a://")
    on_cluster = [
        "--set", f"spark.master={cluster.master_url}",
        "--set", "spark.conf.spark.cores.max=2",
        "--set", "spark.conf.spark.executor.memory=1g",
    ]  # fmt: skip
    settings = engine_args(cfg, *on_cluster, queries=True)
    delayq = str(VENV_BIN / "delayq")
    env = s3.environment()
    first = start_process([delayq, "run", *settings], tmp_path / "first.log", env)
    procs = [first]
    try:
        ids = send_many(spark, cfg, _wave(1, 30))
        wait_for(lambda: len(delivered_rows(spark, cfg)) > 0, 180, "deliveries on the cluster")
        state = read_state(cluster.home, int(cluster.ui_url.rsplit(":", 1)[1]))
        assert state is not None and any(a["name"] == cfg.app_name for a in state.apps), describe(
            state
        )
        assert kill(cluster.home, "worker-1")  # a worker dies mid-run, its executor with it
        ids += send_many(spark, cfg, _wave(2, 30))
        wait_for(lambda: len(delivered_rows(spark, cfg)) > 30, 180, "deliveries after the loss")
        os.killpg(first.pid, signal.SIGKILL)  # then the driver: kill -9
        first.wait(30)
        print(f"\nkilled the driver with {len(delivered_rows(spark, cfg))} of 60 delivered")
        start(cluster.home, workers=2, cores=2, memory="2g", port=_port(cluster),
              ui_port=int(cluster.ui_url.rsplit(":", 1)[1]))  # fmt: skip
        ids += send_many(spark, cfg, _wave(3, 30))
        until = ["--until-idle", "--max-seconds", "300"]
        second = start_process([delayq, "run", *settings, *until], tmp_path / "second.log", env)
        procs.append(second)
        lines = "\n".join(settings[1::2])
        consumer = start_process(
            [sys.executable, "-m", "tests.support.waiting_consumer", lines, ",".join(ids)],
            tmp_path / "consumer.log",
            env,
        )
        procs.append(consumer)
        # Alone on 2 cores the second engine is idle 4 minutes after the kill; the whole
        # suite around it can double that.
        assert second.wait(480) == 0, (tmp_path / "second.log").read_text()[-3000:]
        assert consumer.wait(300) == 0, (tmp_path / "consumer.log").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids, cfg)
    received = (tmp_path / "consumer.log").read_text().split("received ", 1)[1].split()
    assert received == sorted(ids), "each message handed to the consumer exactly once"


def _port(cluster: Cluster) -> int:
    return int(cluster.master_url.rsplit(":", 1)[1])
