"""``delayq schedule``: recurring schedules from the command line (no Spark, no engine needed).

Examples::

    delayq schedule create nightly --topic reports --body run --cron "30 2 * * *" \\
        --time-zone Europe/Berlin
    delayq schedule create heartbeat --topic ticks --body tick --every 15m --jitter 10s
    delayq schedule create launch --topic events --body go --at 2026-12-24T18:00
    delayq schedule list --next 3
    delayq schedule update nightly --cron "0 3 * * *"
    delayq schedule pause nightly        # resume, delete alike

A running engine fires them (``engine.recur.fire``); they are kept in the ``recurring`` table.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from engine.recur.policy import CATCH_UP, DEFAULT_CATCH_UP, DEFAULT_CATCH_UP_WINDOW

if TYPE_CHECKING:
    from engine.core.config import EngineConfig
    from engine.recur.defs import RecurringSchedule

#: The template and timing options of ``create`` and ``update``, as their API names.
_FIELDS = {
    "topic": "topic", "body": "body", "cron": "cron", "every": "every", "at": "at",
    "time_zone": "time_zone", "start": "start", "end": "end", "jitter": "jitter",
    "catch_up": "catch_up", "catch_up_window": "catch_up_window", "key": "keys",
    "tag": "tags", "property": "properties",
}  # fmt: skip


def add_schedule_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``schedule`` and its subcommands to ``delayq``'s parser.

    Example:
        >>> add_schedule_parser(sub, common)  # doctest: +SKIP
    """
    schedule = sub.add_parser("schedule", help="recurring schedules: create, list, pause, ...")
    commands = schedule.add_subparsers(dest="schedule_command", required=True, metavar="ACTION")
    for action, text in (("create", "create a recurring schedule"),
                         ("update", "change a schedule (the options given)")):  # fmt: skip
        one = commands.add_parser(action, parents=[common], help=text)
        one.add_argument("name", help="the schedule's name (letters, digits, _ . -)")
        one.add_argument("--topic", required=action == "create", help="topic of its messages")
        one.add_argument("--body", required=action == "create", help="body of its messages")
        when = one.add_mutually_exclusive_group(required=action == "create")
        when.add_argument("--cron", metavar="EXPR", help='five cron fields: "30 2 * * *"')
        when.add_argument("--every", metavar="DURATION", help="a fixed rate: 15m, 1h, 30s")
        when.add_argument("--at", action="append", metavar="TIME", help="a time (repeatable)")
        one.add_argument("--time-zone", metavar="ZONE", help="IANA zone (default UTC)")
        one.add_argument("--start", metavar="TIME", help="no occurrence before TIME")
        one.add_argument("--end", metavar="TIME", help="no occurrence after TIME")
        one.add_argument("--jitter", metavar="DURATION", help="delay each by up to DURATION")
        one.add_argument(
            "--catch-up", choices=CATCH_UP,
            help=f"after downtime, which missed occurrences fire (default {DEFAULT_CATCH_UP})",
        )  # fmt: skip
        one.add_argument(
            "--catch-up-window", metavar="DURATION",
            help=f"how far back missed ones count (default {DEFAULT_CATCH_UP_WINDOW})",
        )  # fmt: skip
        one.add_argument("--key", action="append", help="a message key (repeatable)")
        one.add_argument("--tag", help="the message tag")
        one.add_argument(
            "--property", action="append", metavar="NAME=VALUE", help="a message property"
        )
    listing = commands.add_parser("list", parents=[common], help="the schedules")
    listing.add_argument("--next", type=int, default=1, metavar="N", help="next N occurrences")
    listing.add_argument("--deleted", action="store_true", help="deleted schedules too")
    for action in ("pause", "resume", "delete"):
        named = commands.add_parser(action, parents=[common], help=f"{action} a schedule")
        named.add_argument("name")


def cmd_schedule(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq schedule ACTION``: print what the schedule is now (or the list).

    Raises:
        ScheduleError: a bad field, or no such schedule.
        InvalidMessageError: a bad message field.
    """
    from zoneinfo import ZoneInfo

    from engine.core.clock import SystemClock
    from engine.recur.defs import (
        create_schedule,
        delete_schedule,
        list_schedules,
        pause_schedule,
        resume_schedule,
        update_schedule,
    )

    action = args.schedule_command
    if action == "list":
        now = SystemClock().now()
        shown = list_schedules(cfg, deleted=args.deleted)
        if not shown:
            print("no recurring schedules")
        for schedule in shown:
            print(describe(schedule))
            zone = ZoneInfo(schedule.recurrence.time_zone)
            for t in schedule.next_times(now, max(0, args.next)):
                print(f"    next {t.astimezone(zone).isoformat()}")
        return 0
    if action in ("pause", "resume", "delete"):
        change = {"pause": pause_schedule, "resume": resume_schedule, "delete": delete_schedule}
        print(describe(change[action](cfg, args.name)))
        return 0
    given = _given(args)
    made = (
        create_schedule(cfg, args.name, **given)
        if action == "create"
        else update_schedule(cfg, args.name, **given)
    )
    print(describe(made))
    return 0


def describe(schedule: RecurringSchedule) -> str:
    """One line: name, revision, state, when, zone, topic.

    Example:
        >>> describe(schedule)  # doctest: +SKIP
        'nightly r1 active: cron "30 2 * * *" in Europe/Berlin -> reports'
    """
    rec = schedule.recurrence
    when = f'{rec.kind} "{rec.expression}"'
    bounds = "".join(
        f" {word} {t.isoformat()}" for word, t in (("from", rec.start), ("until", rec.end)) if t
    )
    return (
        f"{schedule.name} r{schedule.revision} {schedule.state}: {when} in {rec.time_zone}"
        f"{bounds} -> {schedule.topic}"
    )


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The options given, as :func:`create_schedule`'s keyword arguments."""
    from engine.core.message import message_property

    given: dict[str, Any] = {}
    for option, name in _FIELDS.items():
        value = getattr(args, option, None)
        if value is not None:
            given[name] = value
    if "properties" in given:
        given["properties"] = dict(message_property(p) for p in given["properties"])
    return given
