"""One engine per lakehouse: the lease, standby, and fencing, on real Spark + Delta, in a
local folder and (where marked) in an S3 bucket on a real S3 server."""

from __future__ import annotations

import json
import threading

import pytest
from pyspark.sql import SparkSession

from engine.core.clock import FakeClock
from engine.core.config import EngineConfig
from engine.core.errors import FencedError, LakehouseHeldError
from engine.lakehouse.state.lease import LEASE_DIR, Lease
from engine.lakehouse.storage.fs import put_if_absent, write_text
from engine.produce.send import Message, send_many
from engine.run.engine import Engine
from tests.support.lakehouse import START, assert_exactly_once_never_early, delivered_rows

pytestmark = pytest.mark.integration


def _ms(clock: FakeClock) -> int:
    return int(clock.now().timestamp() * 1000)


def _foreign_claim(spark: SparkSession, cfg: EngineConfig, epoch: int, at_ms: int) -> None:
    """A claim made by an engine on another machine, renewed at ``at_ms``."""
    claim = {
        "epoch": epoch, "engine_id": "other", "host": "other-host", "pid": 4242,
        "since_ms": at_ms, "renewed_ms": at_ms, "timeout_ms": 15_000,
    }  # fmt: skip
    where = f"{cfg.lakehouse}/{LEASE_DIR}/{epoch:020d}.json"
    assert put_if_absent(where, json.dumps(claim).encode())


def test_a_held_lakehouse_is_refused_naming_the_holder_until_its_lease_runs_out(
    spark: SparkSession, any_cfg: EngineConfig
) -> None:
    cfg = any_cfg
    clock = FakeClock(START)
    _foreign_claim(spark, cfg, 1, _ms(clock))
    lease = Lease(cfg.lakehouse, clock, timeout_ms=15_000)
    clock.advance(seconds=14)
    with pytest.raises(LakehouseHeldError) as refused:
        lease.acquire()
    message = str(refused.value)
    assert "another engine holds the lakehouse" in message
    assert "host other-host, pid 4242, since 2026-01-01 12:00:00 UTC" in message
    assert "renewed 14.0 s ago" in message and "lease.standby=true" in message
    clock.advance(seconds=2)  # 16 s without a renewal: the lease has run out
    assert lease.acquire().epoch == 2
    assert lease.holder().host != "other-host"  # type: ignore[union-attr]
    # ... but that engine may only be stalled: the new one's start plans nothing of its own
    # ahead of the stamping query (a stalled query may yet write its plan to Spark's log)
    assert lease.before is not None and lease.before.may_still_run()


def test_a_standby_takes_over_when_the_holder_releases(
    spark: SparkSession, cfg: EngineConfig
) -> None:
    clock = FakeClock(START)
    _foreign_claim(spark, cfg, 1, _ms(clock))
    taken: list[int] = []
    standby = Lease(cfg.lakehouse, clock, timeout_ms=15_000)
    waiter = threading.Thread(target=lambda: taken.append(standby.acquire(standby=True).epoch))
    waiter.start()
    waiter.join(2.5)
    assert waiter.is_alive() and not taken, "it waits while the holder's lease runs"
    beat = f"{cfg.lakehouse}/{LEASE_DIR}/{1:020d}.beat.json"
    write_text(beat, json.dumps({"renewed_ms": _ms(clock), "released": True}))  # a clean stop
    waiter.join(10)
    assert taken == [2]
    assert standby.before is not None and not standby.before.may_still_run()  # it stopped


def test_a_standby_gives_up_when_told_to_stop(spark: SparkSession, cfg: EngineConfig) -> None:
    clock = FakeClock(START)
    _foreign_claim(spark, cfg, 1, _ms(clock))
    stop = threading.Event()
    stop.set()
    with pytest.raises(LakehouseHeldError):
        Lease(cfg.lakehouse, clock, timeout_ms=15_000).acquire(standby=True, stop=stop)


def test_an_engine_taken_over_stops_and_its_late_commit_is_rejected(
    spark: SparkSession, any_cfg: EngineConfig, clock: FakeClock
) -> None:
    """Engine A plans a round and is paused after its last lease check; B takes the
    lakehouse over and runs A's plan; A's commit then fails: nothing twice, nothing early."""
    cfg = any_cfg
    messages = [Message(f"t{i % 2}", f"m{i}", delay_level=1) for i in range(8)]
    ids = send_many(spark, cfg, messages, clock)
    first = Engine(spark, cfg, clock, out=lambda _: None).open()
    first.stamp_available()
    second = Engine(spark, cfg, clock, out=lambda _: None)
    checks = 0
    real_check = first.delivery.fence

    def paused_after_the_check() -> None:
        nonlocal checks
        checks += 1
        real_check()
        if checks == 2:  # A's check before its commit passed; A is paused, B takes over
            second.open()  # replays A's planned round (same watermark, same rows)
            clock.advance(seconds=1)
            second.step()

    first.delivery.fence = paused_after_the_check
    clock.advance(seconds=1.5)
    with pytest.raises(FencedError, match="another engine took the lakehouse over"):
        first.step()
    assert checks == 3, "the commit's put-if-absent failed, and the check after it fenced A"
    with pytest.raises(FencedError):
        first.step()  # A stays fenced
    clock.advance(seconds=1)
    second.step()
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)


def test_an_engine_object_taken_over_in_the_same_process_is_fenced(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    first = Engine(spark, cfg, clock, out=lambda _: None).open()
    epoch = first.lease.mine.epoch  # type: ignore[union-attr]
    second = Engine(spark, cfg, clock, out=lambda _: None).open()
    assert second.lease.mine.epoch == epoch + 1  # type: ignore[union-attr]
    send_many(spark, cfg, [Message("orders", "x")], clock)
    clock.advance(seconds=1)
    with pytest.raises(FencedError):
        first.step()
    assert second.step().delivered == 1


def test_an_engine_that_stopped_reads_the_progress_again_when_it_holds_the_lakehouse_again(
    spark: SparkSession, cfg: EngineConfig, clock: FakeClock
) -> None:
    first = Engine(spark, cfg, clock, out=lambda _: None).open()
    ids = send_many(
        spark, cfg, [Message("orders", f"a{i}", delay_level=1) for i in range(4)], clock
    )
    clock.advance(seconds=2)
    first.step()
    first.stop()  # lets the lakehouse go
    second = Engine(spark, cfg, clock, out=lambda _: None).open()
    ids += send_many(
        spark, cfg, [Message("orders", f"b{i}", delay_level=1) for i in range(4)], clock
    )
    clock.advance(seconds=2)
    second.step()
    second.stop()
    ids += send_many(
        spark, cfg, [Message("orders", f"c{i}", delay_level=1) for i in range(4)], clock
    )
    clock.advance(seconds=2)
    assert first.step().delivered == 4  # from the second's progress, not its own old one
    assert_exactly_once_never_early(delivered_rows(spark, cfg), ids)
