"""Recurring schedules without an engine: when they fire (cron in a time zone across
daylight-saving changes, fixed rates, listed times), what a firing batch sends and skips,
and the errors a bad schedule gets."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from engine.core.clock import FakeClock, to_millis
from engine.core.config import EngineConfig
from engine.core.errors import InvalidMessageError, ScheduleError
from engine.lakehouse.delta.delta_log import Txn
from engine.recur.defs import (
    RecurringSchedule,
    create_schedule,
    delete_schedule,
    list_schedules,
    pause_schedule,
    read_revisions,
    recurring_table,
    resume_schedule,
    update_schedule,
)
from engine.recur.fire import GRACE, LOOKAHEAD, Firing, Span, plan_batch
from engine.recur.spec import Recurrence
from tests.support.process import cli

NEW_YORK = "America/New_York"
BERLIN = "Europe/Berlin"


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[arg-type, misc]


def local(zone: str, times: list[datetime]) -> list[str]:
    from zoneinfo import ZoneInfo

    return [t.astimezone(ZoneInfo(zone)).isoformat() for t in times]


def test_a_cron_time_that_spring_forward_skips_fires_at_the_change_and_once_on_fall_back() -> None:
    """As Debian's cron: 02:30 daily in New York fires at 03:00 EDT on 2026-03-08 (02:00 to
    03:00 is skipped), and 01:30 fires once on 2026-11-01 (01:00 to 02:00 happens twice);
    a job every 30 minutes fires on both passes of the repeated hour."""
    spring = Recurrence.parse(cron="30 2 * * *", time_zone=NEW_YORK)
    assert local(NEW_YORK, spring.between(utc(2026, 3, 7, 12), utc(2026, 3, 9, 12))) == [
        "2026-03-08T03:00:00-04:00",
        "2026-03-09T02:30:00-04:00",
    ]
    fall = Recurrence.parse(cron="30 1 * * *", time_zone=NEW_YORK)
    assert local(NEW_YORK, fall.between(utc(2026, 10, 31, 12), utc(2026, 11, 2, 12))) == [
        "2026-11-01T01:30:00-04:00",
        "2026-11-02T01:30:00-05:00",
    ]
    berlin = Recurrence.parse(cron="30 2 * * *", time_zone=BERLIN)  # 02:30 happens twice
    assert local(BERLIN, berlin.between(utc(2026, 10, 24, 12), utc(2026, 10, 25, 12))) == [
        "2026-10-25T02:30:00+02:00"
    ]
    often = Recurrence.parse(cron="*/30 * * * *", time_zone=NEW_YORK)
    hour = often.between(utc(2026, 11, 1, 4, 59), utc(2026, 11, 1, 6, 30))
    assert local(NEW_YORK, hour) == [
        "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:30:00-04:00",
        "2026-11-01T01:00:00-05:00",
        "2026-11-01T01:30:00-05:00",
    ]


def test_listed_local_times_in_a_gap_move_forward_and_repeated_ones_are_the_first() -> None:
    at = Recurrence.parse(at="2026-03-29T02:30 2026-10-25T02:30", time_zone=BERLIN)
    assert local(BERLIN, at.between(utc(2026, 1, 1), utc(2027, 1, 1))) == [
        "2026-03-29T03:30:00+02:00",  # 02:00-03:00 does not exist that night
        "2026-10-25T02:30:00+02:00",  # the first of the two 02:30s
    ]


def test_a_fixed_rate_counts_real_time_from_its_start_whatever_the_zone() -> None:
    rate = Recurrence.parse(every="1h", start="2026-03-29T00:30:00+01:00", time_zone=BERLIN)
    times = rate.between(utc(2026, 3, 28), utc(2026, 3, 29, 2, 31))
    assert [t.strftime("%H:%M") for t in times] == ["23:30", "00:30", "01:30", "02:30"]
    assert times[0] == utc(2026, 3, 28, 23, 30)  # start itself occurs
    bounded = Recurrence.parse(every="15m", end="2026-01-01T09:30:00Z")
    assert bounded.between(utc(2026, 1, 1, 9), utc(2026, 1, 1, 10))[-1] == utc(2026, 1, 1, 9, 30)


@pytest.mark.parametrize(
    ("given", "field", "shown"),
    [
        ({"cron": "61 * * * *"}, "cron", "'61 * * * *'"),
        ({"cron": "* * *"}, "cron", "'* * *'"),
        ({"every": "500ms"}, "every", "'500ms'"),
        ({"every": "soon"}, "every", "'soon'"),
        ({"at": "tomorrow"}, "at", "'tomorrow'"),
        ({"cron": "* * * * *", "time_zone": "Mars/Olympus"}, "time_zone", "'Mars/Olympus'"),
        ({"cron": "* * * * *", "every": "1m"}, "when", "'cron, every'"),
        ({"every": "1m", "start": "2026-02-01", "end": "2026-01-01"}, "end", ""),
        ({"every": "1m", "jitter": "a bit"}, "jitter", "'a bit'"),
    ],
)
def test_a_bad_recurrence_names_its_field_and_value(
    given: dict[str, str], field: str, shown: str
) -> None:
    with pytest.raises(ScheduleError, match=re.escape(f"invalid schedule {field}={shown}")):
        Recurrence.parse(**given)


def test_schedules_are_created_changed_and_listed_with_their_revisions(tmp_path: Path) -> None:
    cfg = EngineConfig(lakehouse=str(tmp_path))
    clock = FakeClock(utc(2026, 1, 1))
    made = create_schedule(cfg, "nightly", "reports", "run", cron="0 2 * * *",
                           time_zone=BERLIN, clock=clock)  # fmt: skip
    assert (made.revision, made.state) == (1, "active")
    assert made.next_times(clock.now(), 2) == [utc(2026, 1, 1, 1), utc(2026, 1, 2, 1)]
    assert made.message_id(utc(2026, 1, 1, 1)) == f"nightly:{to_millis(utc(2026, 1, 1, 1))}"
    with pytest.raises(ScheduleError, match="invalid schedule name='nightly': a schedule"):
        create_schedule(cfg, "nightly", "reports", "again", every="1m")
    with pytest.raises(ScheduleError, match="invalid schedule name='no such!'"):
        create_schedule(cfg, "no such!", "reports", "run", every="1m")
    with pytest.raises(InvalidMessageError, match="invalid message topic="):
        create_schedule(cfg, "bad-topic", "", "run", every="1m")
    moved = update_schedule(cfg, "nightly", cron="0 3 * * *", clock=clock)
    assert (moved.revision, moved.recurrence.time_zone, moved.body) == (2, BERLIN, b"run")
    assert pause_schedule(cfg, "nightly", clock=clock).next_times(clock.now()) == []
    assert resume_schedule(cfg, "nightly", clock=clock).revision == 4
    assert [(s.name, s.state) for s in list_schedules(cfg)] == [("nightly", "active")]
    delete_schedule(cfg, "nightly", clock=clock)
    assert list_schedules(cfg) == []
    with pytest.raises(ScheduleError, match="no such schedule"):
        pause_schedule(cfg, "nightly")
    history = read_revisions(recurring_table(cfg))["nightly"]
    assert [r.action for r in history] == ["create", "update", "pause", "resume", "delete"]


def _span(
    batch: int, since: datetime, now: datetime, version: int, before: int, seen: datetime
) -> Span:
    return Span(batch, since, now + LOOKAHEAD, now, version, before, seen)


def test_a_change_applies_after_what_was_sent_and_an_occurrence_keeps_its_id() -> None:
    """An update, a pause and a resume, each seen by the next batch: what was sent before a
    change stays sent; an active schedule goes on from the last batch's horizon (no gap, no
    overlap); a resumed one starts at the resume, or at the previous batch's clock when the
    writer's clock is behind it; an occurrence's id is the same in every revision."""
    start = utc(2026, 1, 1, 9)
    rec = Recurrence.parse(every="2s")

    def rev(revision: int, action: str, state: str, at: datetime, body: bytes = b"t") -> Any:
        return RecurringSchedule("tick", revision, state, action, at, "ticks", body, rec)

    made = [rev(1, "create", "active", start)]
    first = plan_batch({}, {"tick": made}, _span(0, start, start, 1, -1, start))
    assert [f.occurrence - start for f in first.fired] == [timedelta(seconds=s)
                                                           for s in (2, 4, 6, 8, 10)]  # fmt: skip
    assert first.fired[0].msg_id == f"tick:{to_millis(start) + 2000}"
    # updated at 09:00:03, seen at 09:00:04: the new body from 09:00:12 (10 s were sent)
    updated = [*made, rev(2, "update", "active", start + timedelta(seconds=3), b"new")]
    now = start + timedelta(seconds=4)
    batch = plan_batch(
        {"tick": made}, {"tick": updated}, _span(1, start + LOOKAHEAD, now, 2, 1, start)
    )
    assert [(f.occurrence - start, f.schedule.body) for f in batch.fired] == [
        (timedelta(seconds=12), b"new"),
        (timedelta(seconds=14), b"new"),
    ]
    # paused at 09:00:05: nothing more (what was sent up to 09:00:14 is delivered as sent)
    paused = [*updated, rev(3, "pause", "paused", start + timedelta(seconds=5))]
    now = start + timedelta(seconds=6)
    span = _span(2, now - timedelta(seconds=2) + LOOKAHEAD, now, 3, 2, now - timedelta(seconds=2))
    assert plan_batch({"tick": updated}, {"tick": paused}, span).fired == []
    # resumed at 09:00:30 by a writer whose clock says 09:00:20: from 09:00:30, the
    # previous batch's clock (occurrences in the pause do not fire)
    resumed = [*paused, rev(4, "resume", "active", start + timedelta(seconds=20))]
    now = start + timedelta(seconds=31)
    span = _span(3, now - timedelta(seconds=1) + LOOKAHEAD, now, 4, 3, now - timedelta(seconds=1))
    batch = plan_batch({"tick": paused}, {"tick": resumed}, span)
    assert batch.fired[0].occurrence == start + timedelta(seconds=32)
    assert batch.fired[0].msg_id == f"tick:{to_millis(start) + 32_000}"


def test_a_cron_started_inside_a_repeated_hour_gives_nothing_before_its_start() -> None:
    """A batch (or a restart) inside the hour that the fall-back change repeats: CronSim
    would answer that hour's first pass again; an occurrence before the span is not in it."""
    berlin = Recurrence.parse(cron="30 2 * * *", time_zone=BERLIN)
    assert berlin.between(utc(2026, 10, 25, 1, 10), utc(2026, 10, 25, 1, 40)) == []
    assert berlin.count_between(utc(2026, 10, 25, 1, 10), utc(2026, 10, 25, 1, 40)) == 0
    schedule = RecurringSchedule("n", 1, "active", "create", utc(2026, 1, 1), "t", b"x", berlin)
    assert schedule.next_times(utc(2026, 10, 25, 1, 10), 1) == [utc(2026, 10, 26, 1, 30)]


@pytest.mark.parametrize(
    ("catch_up", "sent", "skipped"),
    [("skip", [], 3), ("latest", ["09:03"], 2), ("all", ["09:01", "09:02", "09:03"], 0)],
)
def test_occurrences_missed_while_no_engine_ran_follow_the_catch_up_policy(
    tmp_path: Path, catch_up: str, sent: list[str], skipped: int
) -> None:
    """The last batch covered up to 09:00:30; the engine comes back at 09:04:05. The minutes
    09:01-09:03 are over a minute late (missed); 09:04 fires late, 09:05 on time."""
    cfg = EngineConfig(lakehouse=str(tmp_path))
    clock = FakeClock(utc(2026, 1, 1, 8))
    create_schedule(cfg, "minutely", "ticks", "t", every="1m", catch_up=catch_up, clock=clock)
    table = recurring_table(cfg)
    revisions = read_revisions(table)
    now = utc(2026, 1, 1, 9, 4, 5)
    span = Span(7, utc(2026, 1, 1, 9, 0, 30), utc(2026, 1, 1, 9, 5), now, table.latest(), 0,
                utc(2026, 1, 1, 9, 0, 20))  # fmt: skip
    batch = plan_batch(revisions, revisions, span)
    names = [f.msg_id.rsplit(":", 1)[1] for f in batch.fired]
    shown = [datetime.fromtimestamp(int(n) / 1000, UTC).strftime("%H:%M") for n in names]
    assert shown == [*sent, "09:04", "09:05"]
    assert batch.skipped == ({"minutely": skipped} if skipped else {})
    due = [f.deliver_at for f in batch.fired]
    if catch_up == "all":  # spread from now, 100 ms apart
        assert due[:3] == [now + timedelta(milliseconds=ms) for ms in (0, 100, 200)]
    assert due[-2:] == [utc(2026, 1, 1, 9, 4), utc(2026, 1, 1, 9, 5)]  # never before its time
    assert timedelta(seconds=60) == GRACE  # (what "over a minute late" above relies on)


def test_a_batch_replayed_after_a_crash_sends_nothing_twice(tmp_path: Path) -> None:
    """The plan is written before the send, the send records ``txn`` = the batch: a firing
    that dies after sending and before committing replays the same batch, finds its
    ``txn``, and sends nothing again; a later batch goes on from its horizon."""
    cfg = EngineConfig(lakehouse=str(tmp_path))
    clock = FakeClock(utc(2026, 1, 1, 9))
    create_schedule(cfg, "tick", "ticks", "t", every="1s", clock=clock)
    sent: list[tuple[Txn, list[str]]] = []
    recorded: dict[str, int] = {}

    def send(rows: pa.Table, txn: Txn) -> None:
        sent.append((txn, rows["msg_id"].to_pylist()))
        recorded[txn.app_id] = txn.version

    class Died(Exception):
        pass

    def dying_commit(*args: object, **kwargs: object) -> None:
        raise Died

    firing = Firing(cfg, clock, send=send)
    firing.commitlog.txn_version = lambda app: recorded.get(app)  # type: ignore[method-assign, assignment]
    write = firing.log.write
    firing.log.write = lambda n, rows, planned=False, exclusive=False: (  # type: ignore[method-assign, assignment]
        write(n, rows, planned, exclusive) if planned else dying_commit()
    )
    with pytest.raises(Died):
        firing.run()
    assert [t.version for t, _ in sent] == [0]
    again = Firing(cfg, clock, send=send)  # the restart
    again.commitlog.txn_version = lambda app: recorded.get(app)  # type: ignore[method-assign, assignment]
    assert again.run().batch == 0  # the pending plan, replayed
    assert len(sent) == 1  # its send was recorded: not again
    clock.advance(seconds=5)
    assert again.run().sent == 5  # the next batch: the 5 seconds after the first's horizon
    ids = [i for _, batch in sent for i in batch]
    assert len(ids) == len(set(ids)) == 15


def test_the_command_line_manages_schedules_and_names_what_is_wrong(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cfg = EngineConfig(lakehouse=str(tmp_path))
    made = cli(capsys, cfg, "schedule", "create", "nightly", "--topic", "reports", "--body",
               "run", "--cron", "30 2 * * *", "--time-zone", BERLIN)  # fmt: skip
    assert made == (0, 'nightly r1 active: cron "30 2 * * *" in Europe/Berlin -> reports\n', "")
    code, out, _ = cli(capsys, cfg, "schedule", "list", "--next", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("nightly r1 active")
    assert [line.split()[0] for line in lines[1:]] == ["next", "next"]
    assert lines[1].endswith("T02:30:00+01:00")  # in the schedule's zone
    assert cli(capsys, cfg, "schedule", "pause", "nightly")[1].startswith("nightly r2 paused")
    code, _, err = cli(capsys, cfg, "schedule", "create", "x", "--topic", "t", "--body", "b",
                       "--every", "1m", "--time-zone", "Nowhere/Else")  # fmt: skip
    assert (code, err.strip()) == (
        2, "delayq: error: invalid schedule time_zone='Nowhere/Else': not an IANA time zone "
        "(such as Europe/Berlin)",
    )  # fmt: skip
    code, _, err = cli(capsys, cfg, "schedule", "update", "x", "--every", "1m")
    assert (code, err.strip()) == (2, "delayq: error: invalid schedule name='x': no such schedule")


def test_passing_over_schedules_not_due_changes_nothing_a_batch_sends(tmp_path: Path) -> None:
    """With the per-schedule next occurrence kept from batch to batch, a batch evaluates only
    the schedules due in its span; over a day of one-second batches it sends exactly what
    evaluating every schedule each time sends."""
    cfg = EngineConfig(lakehouse=str(tmp_path))
    start = utc(2026, 3, 28, 23, 59, 30)
    clock = FakeClock(start)
    for name, when in (("m", {"cron": "* * * * *"}), ("q", {"every": "15m"}),
                       ("b", {"cron": "30 2 * * *", "time_zone": BERLIN}),
                       ("a", {"at": "2026-03-29T00:00:07Z"})):  # fmt: skip
        create_schedule(cfg, name, "t", "x", clock=clock, **when)  # type: ignore[arg-type]
    revisions = read_revisions(recurring_table(cfg))
    kept: dict[tuple[str, int], datetime] = {}
    since = start
    for second in range(1, 3600, 11):
        now = start + timedelta(seconds=second)
        span = Span(second, since, now + LOOKAHEAD, now, 0, 0, now)
        with_cache = plan_batch(revisions, revisions, span, kept)
        kept.update(with_cache.upcoming)  # (as the firing does once a batch is done)
        without = plan_batch(revisions, revisions, span)
        assert [f.msg_id for f in with_cache.fired] == [f.msg_id for f in without.fired]
        since = span.horizon
    assert len(kept) == 4
    every = Recurrence.parse(every="1s")
    assert every.count_between(utc(2026, 1, 1), utc(2026, 1, 2)) == 86_400


def test_a_send_that_fails_is_sent_by_the_next_run_from_the_same_plan(tmp_path: Path) -> None:
    """The storage refuses the send once: the batch's plan stays, the next run (a second
    later) replays it and sends exactly its occurrences, and the one after goes on."""
    cfg = EngineConfig(lakehouse=str(tmp_path))
    clock = FakeClock(utc(2026, 1, 1, 9))
    create_schedule(cfg, "tick", "ticks", "t", every="1s", clock=clock)
    sent: list[list[str]] = []
    failures = [OSError("storage unavailable")]

    def send(rows: pa.Table, txn: Txn) -> None:
        if failures:
            raise failures.pop()
        sent.append(rows["msg_id"].to_pylist())

    firing = Firing(cfg, clock, send=send)
    with pytest.raises(OSError, match="storage unavailable"):
        firing.run()
    clock.advance(seconds=1)
    assert firing.run().batch == 0  # the same batch, from its plan
    clock.advance(seconds=1)
    assert firing.run().batch == 1
    ids = [i for batch in sent for i in batch]
    start = to_millis(utc(2026, 1, 1, 9))
    assert ids == [f"tick:{start + s * 1000}" for s in range(1, 13)]


def test_skipped_occurrences_are_counted_and_published_across_a_restart(tmp_path: Path) -> None:
    """An engine fires a minutely schedule (``catch_up = skip``), stops, and the next one
    starts five minutes later: the four minutes more than a minute late are skipped,
    counted, and written with the schedule's next occurrence for the ``schedules`` view;
    the engine after that starts from those totals."""
    cfg = EngineConfig(lakehouse=str(tmp_path))
    clock = FakeClock(utc(2026, 1, 1, 9, 0, 30))
    create_schedule(cfg, "minutely", "ticks", "t", every="1m", catch_up="skip", clock=clock)

    def firing() -> Firing:
        return Firing(cfg, clock, send=lambda rows, txn: None)

    first = firing()
    first.run()
    clock.advance(seconds=40)  # 09:01:10: 09:01 is sent
    assert first.run().sent == 1
    clock.advance(seconds=5 * 60)  # 09:06:10, another engine: 09:02-09:05 are missed
    second = firing()
    assert second.run().skipped == {"minutely": 4}
    published = Path(cfg.lakehouse, "_checkpoints", "recurring-next", "next.json")
    row = json.loads(published.read_text())
    assert (row["skipped_total"], row["next_fire_ts"]) == (4, "2026-01-01T09:07:00+00:00")
    clock.advance(seconds=60)
    third = firing()
    third.run()
    assert json.loads(published.read_text())["skipped_total"] == 4  # kept, not reset


def test_a_schedule_next_due_in_years_is_looked_at_again_and_fires() -> None:
    """29 February at noon, made on 1 March 2026: nothing within a year, so the batches pass
    it over until the year is up, look again, and the batch of 2028-02-29 12:00 fires it."""
    leap = Recurrence.parse(cron="0 12 29 2 *")
    made = RecurringSchedule("leap", 1, "active", "create", utc(2026, 3, 1), "t", b"x", leap)
    kept: dict[tuple[str, int], datetime] = {}
    since = utc(2026, 3, 1)
    fired = []
    spans = [(utc(2026, 3, 1, 0, 0, 1), -1), (utc(2027, 3, 2), 1), (utc(2028, 2, 29, 11, 59), 1)]
    for now, before in spans:
        span = Span(0, since, now + LOOKAHEAD + timedelta(minutes=2), now, 1, before, now)
        known = {"leap": [made]} if before >= 0 else {}
        batch = plan_batch(known, {"leap": [made]}, span, kept)
        kept.update(batch.upcoming)
        fired += [f.msg_id for f in batch.fired]
        since = span.horizon
    assert fired == [f"leap:{to_millis(utc(2028, 2, 29, 12))}"]


def test_until_idle_waits_for_the_run_after_a_replayed_batch(tmp_path: Path) -> None:
    """A batch planned at 09:00:00 (up to 09:00:10) and replayed at 09:00:09 by a restarted
    engine: the engine is not caught up until a run has sent the seconds after it, or
    ``--until-idle`` would stop with the next occurrences unsent."""
    cfg = EngineConfig(lakehouse=str(tmp_path))
    clock = FakeClock(utc(2026, 1, 1, 9))
    create_schedule(cfg, "tick", "ticks", "t", every="1s", clock=clock)
    failures = [OSError("killed")]

    def send(rows: pa.Table, txn: Txn) -> None:
        if failures:
            raise failures.pop()

    with pytest.raises(OSError):
        Firing(cfg, clock, send=send).run()
    clock.advance(seconds=9)
    restarted = Firing(cfg, clock, send=send)
    assert not restarted.caught_up()  # (nothing looked at yet)
    assert restarted.run().batch == 0  # the replay: up to 09:00:10
    assert not restarted.caught_up()
    assert restarted.run().sent == 9  # 09:00:11-19
    assert restarted.caught_up()


def test_a_stop_seen_late_still_keeps_its_occurrences_from_firing_or_firing_twice() -> None:
    """What the previous batch read can be old (a restart goes on from the last batch that
    sent something). An hourly schedule paused at 10:20 and resumed at 11:20, both unseen
    until 11:30: 11:00 does not fire. An every-second schedule paused at T and resumed at
    T + 2 s, seen three hours later: the seconds its paused revision may have sent (up to
    T + 10 s) are not sent again."""
    hourly = Recurrence.parse(every="1h")

    def rev(rec: Recurrence, n: int, action: str, state: str, at: datetime) -> Any:
        return RecurringSchedule("s", n, state, action, at, "t", b"x", rec)

    made = rev(hourly, 1, "create", "active", utc(2026, 1, 1, 8))
    history = [made, rev(hourly, 2, "pause", "paused", utc(2026, 1, 1, 10, 20)),
               rev(hourly, 3, "resume", "active", utc(2026, 1, 1, 11, 20))]  # fmt: skip
    now = utc(2026, 1, 1, 11, 30)
    span = Span(5, utc(2026, 1, 1, 10, 0, 10), now + LOOKAHEAD, now, 3, 1, utc(2026, 1, 1, 10))
    assert plan_batch({"s": [made]}, {"s": history}, span).fired == []

    second = Recurrence.parse(every="1s")
    t = utc(2026, 1, 1, 9)
    paused = [rev(second, 1, "create", "active", t - timedelta(hours=1)),
              rev(second, 2, "pause", "paused", t)]  # fmt: skip
    resumed = [*paused, rev(second, 3, "resume", "active", t + timedelta(seconds=2))]
    now = t + timedelta(hours=3)
    span = Span(9, t + timedelta(seconds=9), now + LOOKAHEAD, now, 3, 2, t + timedelta(seconds=1))
    fired = plan_batch({"s": paused}, {"s": resumed}, span).fired
    assert min(f.occurrence for f in fired) > t + LOOKAHEAD  # (the newest missed, then on)


def test_two_changes_given_one_number_are_not_mistaken_for_one() -> None:
    """Two writers both made revision 2: the batch that read the first (hourly) and the
    batch that reads the winner (every minute) see a change, and the minute fires."""
    t = utc(2026, 1, 1, 9)

    def update(at: datetime, every: str) -> Any:
        rec = Recurrence.parse(every=every)
        return RecurringSchedule("s", 2, "active", "update", at, "t", b"x", rec)

    hourly, minutely = update(t, "1h"), update(t + timedelta(seconds=1), "1m")
    kept: dict[tuple[str, int, datetime], datetime] = {}
    first = Span(1, t, t + LOOKAHEAD, t, 1, 0, t)
    kept.update(plan_batch({"s": [hourly]}, {"s": [hourly]}, first, kept).upcoming)
    now = t + timedelta(seconds=55)
    span = Span(2, t + LOOKAHEAD, now + LOOKAHEAD, now, 2, 1, now)
    fired = plan_batch({"s": [hourly]}, {"s": [minutely]}, span, kept).fired
    assert [f.occurrence for f in fired] == [utc(2026, 1, 1, 9, 1)]
