"""The ``delayq`` command line: send messages, run the engine, look at what it holds.

Examples::

    delayq send --topic orders --body '{"id": 1}' --key order-1 --level 3
    delayq send --topic orders --body 'remind' --delay 15m
    delayq send --topic orders --body 'close' --deliver-at 2026-12-01T09:00:00+01:00
    delayq send --file messages.jsonl          # one JSON object per line
    delayq status
    delayq topics
    delayq sql "SELECT msg_id, CAST(body AS STRING) FROM delayq.orders"
    delayq pending --topic orders          # what waits, soonest first
    delayq forecast --minutes 60           # how many come due per minute
    delayq history --key order-1           # sent, stamped, delivered, with times
    delayq cancel --id 3F2A...             # or --key order-1 [--topic orders]
    delayq cancel --id 3F2A... --id 9B01...   # many at once, or --file ids.txt
    delayq reschedule --id 3F2A... --delay 2h
    delayq reschedule --file moves.txt     # a line: ID [TIME or DELAY]
    delayq run --until-idle --set levels.delays="1s 2s 3s"
    delayq lag --group billing             # consumer lag per topic
    delayq dlq list --group billing        # dead letters of a consumer group
    delayq dlq show --group billing 5D0E...
    delayq dlq resend --group billing --key order-7   # or --id ID, or --all
    delayq dlq purge --group billing --all            # asks first (--yes to skip)
    delayq schedule create nightly --topic reports --body run --cron "30 2 * * *"
    delayq schedule list --next 3          # recurring schedules (update, pause, resume, ...)

Every command takes ``--conf FILE`` and any number of ``--set key=value`` overrides
(after the command name). When an engine runs on the lakehouse, commands other than ``run``
are carried out by it (:mod:`engine.control.endpoint`: about a second instead of starting a
Spark of their own); ``--local`` runs one here anyway.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from engine.control.schedules import add_schedule_parser, cmd_schedule
from engine.core.config import DEFAULT_CONF, EngineConfig, load_config, parse_override
from engine.core.errors import ConfigError, DelayQError, InvalidMessageError, LakehouseHeldError
from engine.run.report import run_main, setup_logging

DEMO_TOPICS = ("orders", "notifications")
DEMO_MAX_LEVEL = 4  # 30 s with the default table: the demo ends within a minute


def build_parser() -> argparse.ArgumentParser:
    """The `delayq` command line: every command, its options and their help.

    Example:
        >>> build_parser().prog
        'delayq'
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--conf", metavar="FILE", help="TOML config (default conf/engine.toml)")
    common.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config key, e.g. --set levels.delays='1s 2s 3s' (repeatable)",
    )
    common.add_argument(
        "--local",
        action="store_true",
        help="run in this process with a Spark of its own, even when an engine runs",
    )
    # --conf/--set belong to each command (argparse would let a subcommand's default
    # silently replace a value given before the command name).
    parser = argparse.ArgumentParser(
        prog="delayq",
        description="Delayed delivery on Spark + Delta Lake (RocketMQ-style delay levels).",
        epilog="Run `delayq COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    send = sub.add_parser("send", parents=[common], help="send one message, or many from a file")
    send.add_argument("--topic", help="real topic the message is delivered to")
    send.add_argument("--body", help="message body (text)")
    send.add_argument("--key", action="append", default=[], help="a lookup key (repeatable)")
    send.add_argument("--tag", help="message tag")
    send.add_argument(
        "--id",
        metavar="MSG_ID",
        help="the message's own id: sending again with the same id delivers it once "
        "(within messages.dedup_window)",
    )
    send.add_argument(
        "--property", action="append", default=[], metavar="NAME=VALUE", help="user property"
    )
    when = send.add_mutually_exclusive_group()
    when.add_argument("--level", type=int, help="delay level (none or <= 0: deliver at once)")
    when.add_argument(
        "--deliver-at",
        metavar="TIME",
        help="deliver at TIME: ms since the epoch or ISO-8601 with a zone "
        "(2026-12-01T09:00:00+01:00)",
    )
    when.add_argument("--delay", metavar="DURATION", help="deliver after e.g. 90s, 15m, 2d, 250ms")
    send.add_argument(
        "--window",
        metavar="DURATION",
        help="delivery window: deliver any time in this long after the deliver time (the "
        "engine spreads such messages to flatten peaks), e.g. 30s, 5m; at most 1d",
    )
    send.add_argument(
        "--file",
        metavar="JSONL",
        help="send many: one JSON object per line with topic, body, keys, tags, "
        "properties, msg_id, window, and delay_level, deliver_at or delay ('-' reads standard "
        "input)",
    )

    run = sub.add_parser("run", parents=[common], help="run the engine (Ctrl-C stops it)")
    add_run_arguments(run)

    sub.add_parser("status", parents=[common], help="pending per level, delivered, quarantined")
    sub.add_parser("topics", parents=[common], help="topic tables and their row counts")
    pend = sub.add_parser("pending", parents=[common], help="messages waiting, by topic or key")
    pend.add_argument("--topic", help="only this topic")
    pend.add_argument("--key", help="only messages with this key")
    pend.add_argument("--limit", type=int, default=50, help="rows to show (default 50)")
    fore = sub.add_parser("forecast", parents=[common], help="how many come due per minute")
    fore.add_argument("--minutes", type=int, default=60, help="how far ahead (default 60)")
    hist = sub.add_parser("history", parents=[common], help="one message's events, by id or key")
    who = hist.add_mutually_exclusive_group(required=True)
    who.add_argument("--id", dest="msg_id", help="message id")
    who.add_argument("--key", help="every message with this key")
    wait_help = "seconds to wait for the engine's answer (default 30; 0: do not wait)"
    stop = sub.add_parser("cancel", parents=[common], help="cancel scheduled messages")
    which = stop.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", dest="msg_ids", action="append", help="message id (repeatable)")
    which.add_argument("--key", help="every pending message with this key")
    which.add_argument(
        "--file", metavar="IDS", help="message ids, one per line ('-' reads standard input)"
    )
    stop.add_argument("--topic", help="with --key: only messages for this topic")
    stop.add_argument("--wait", type=float, default=30.0, metavar="S", help=wait_help)
    move = sub.add_parser("reschedule", parents=[common], help="move messages to a new time")
    ids = move.add_mutually_exclusive_group(required=True)
    ids.add_argument("--id", dest="msg_ids", action="append", help="message id (repeatable)")
    ids.add_argument(
        "--file",
        metavar="MOVES",
        help="one message per line: ID, then optionally its own new time (ms, ISO-8601 with a "
        "zone, or a delay such as 15m); '-' reads standard input",
    )
    to = move.add_mutually_exclusive_group()
    to.add_argument("--deliver-at", metavar="TIME", help="new time: ms or ISO-8601 with a zone")
    to.add_argument("--delay", metavar="DURATION", help="new time from now: 90s, 15m, 2d")
    move.add_argument("--wait", type=float, default=30.0, metavar="S", help=wait_help)
    lag = sub.add_parser("lag", parents=[common], help="consumer groups' lag per topic")
    lag.add_argument("--group", help="only this group")
    lag.add_argument(
        "--members",
        action="store_true",
        help="each group's members: last commit, messages handled in the last 5 minutes, share",
    )
    # --conf/--set go after the action (delayq dlq list --set ...).
    dlq = sub.add_parser("dlq", help="dead letters of a consumer group: list, show, resend, purge")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    group_help = "the consumer group"
    listing = dlq_sub.add_parser("list", parents=[common], help="list dead letters, newest first")
    listing.add_argument("--group", required=True, help=group_help)
    listing.add_argument("--limit", type=int, default=50, help="rows to show (default 50)")
    one = dlq_sub.add_parser("show", parents=[common], help="one dead letter with its history")
    one.add_argument("--group", required=True, help=group_help)
    one.add_argument("msg_id", help="the dead letter's id, or the id it was first sent with")
    again = dlq_sub.add_parser("resend", parents=[common], help="send back to the original topic")
    again.add_argument("--group", required=True, help=group_help)
    pick = again.add_mutually_exclusive_group(required=True)
    pick.add_argument("--id", dest="msg_id", help="one dead letter")
    pick.add_argument("--key", help="every dead letter with this key")
    pick.add_argument("--all", dest="everything", action="store_true", help="every dead letter")
    again.add_argument("--again", action="store_true", help="also those resent before")
    purge = dlq_sub.add_parser("purge", parents=[common], help="delete dead letters")
    purge.add_argument("--group", required=True, help=group_help)
    gone = purge.add_mutually_exclusive_group(required=True)
    gone.add_argument("--id", dest="msg_id", help="one dead letter")
    gone.add_argument("--all", dest="everything", action="store_true", help="every dead letter")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    sql = sub.add_parser("sql", parents=[common], help="run a SQL query with tables registered")
    sql.add_argument("query", help='e.g. "SELECT * FROM delayq.orders"')
    sql.add_argument("--limit", type=int, default=50, help="rows to show (default 50)")
    add_schedule_parser(sub, common)
    keep = sub.add_parser(
        "maintain", parents=[common], help="compact small files and delete unneeded ones"
    )
    keep.add_argument(
        "--table", action="append", metavar="NAME",
        help="only this table (schedule, commitlog, topics/orders, ...; repeatable)",
    )  # fmt: skip
    keep.add_argument(
        "--full",
        action="store_true",
        help="VACUUM by listing the files (also those a crashed writer left)",
    )
    keep.add_argument("--vacuum-topics", action="store_true",
                      help="VACUUM topic tables too (no consumer stream stopped for longer "
                           "than maintenance.retention)")  # fmt: skip
    return parser


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``run``, shared with ``jobs/delay_engine.py``."""
    parser.add_argument(
        "--until-idle",
        action="store_true",
        help="stop once every sent message is delivered or quarantined (a recurring "
        "schedule's occurrences count once sent, 10 s ahead)",
    )
    parser.add_argument(
        "--max-seconds", type=float, metavar="S", help="stop after S seconds whatever is pending"
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="send a demo set across the short levels once the engine is running",
    )
    parser.add_argument(
        "--show", type=int, default=20, metavar="N", help="rows per topic shown at the end"
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Load ``--conf`` with the ``--set`` overrides applied."""
    overrides = dict(parse_override(item) for item in args.set)
    return load_config(args.conf, overrides)


def demo_messages(levels: int) -> list[dict[str, Any]]:
    """A demo set: a few messages on each of the first levels, some not delayed, two timers."""
    messages = []
    for level in range(0, min(levels, DEMO_MAX_LEVEL) + 1):
        for i in range(3):
            topic = DEMO_TOPICS[i % 2]
            messages.append(
                {
                    "topic": topic,
                    "body": json.dumps({"demo": True, "level": level, "n": i}),
                    "keys": [f"demo-{level}-{i}"],
                    "tags": "demo",
                    "properties": {"source": "make run"},
                    "delay_level": level,
                }
            )
    for delay in ("2500ms", "7s"):  # timer messages: a relative delay, to the millisecond
        messages.append(
            {"topic": "notifications", "body": json.dumps({"demo": True, "delay": delay}),
             "keys": [f"demo-timer-{delay}"], "tags": "demo", "delay": delay}
        )  # fmt: skip
    return messages


def _messages_from_file(path: str, cfg: EngineConfig) -> list[dict[str, Any]]:
    """The messages of a JSON-lines file, each checked; a bad one names its line.

    Raises:
        DelayQError: ``<file>:<line>: <what is wrong>``, or that the file holds no message.
    """
    from engine.core.message import message_from_mapping, validate

    name = "standard input" if path == "-" else path
    items: list[dict[str, Any]] = []
    for number, line in _numbered_lines(path):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise DelayQError(f"{name}:{number}: not a JSON object: {err}") from None
        if not isinstance(item, dict):
            raise DelayQError(f"{name}:{number}: not a JSON object: {line.strip()[:60]}")
        try:
            validate(message_from_mapping(item, len(items)), cfg)
        except (InvalidMessageError, TypeError, ValueError) as err:
            what = err if isinstance(err, InvalidMessageError) else f"invalid message: {err}"
            raise DelayQError(f"{name}:{number}: {what}") from None
        items.append(item)
    if not items:
        raise DelayQError(f"{name} holds no message (one JSON object per line): nothing sent")
    return items


def _open_input(option: str, path: str) -> TextIO:
    """The file a command reads (``-``: standard input); when the command runs in the engine,
    the file as the calling ``delayq`` sent it."""
    from engine.control.endpoint import sent_files

    if path == "-":
        return sys.stdin
    sent = sent_files()
    if sent is not None:  # carried out by the engine: only what the caller sent, never its files
        if path not in sent:
            raise DelayQError(f"cannot read {option} {path}: the command did not bring it along")
        return io.StringIO(sent[path])
    try:
        return open(path, encoding="utf-8")
    except OSError as err:
        raise DelayQError(f"cannot read {option} {path}: {err.strerror}") from None


def _numbered_lines(path: str) -> list[tuple[int, str]]:
    """The lines of a ``--file`` (``-``: standard input), numbered from 1.

    Raises:
        DelayQError: it cannot be read, or a line is not UTF-8 (naming the line).
    """
    name = "standard input" if path == "-" else path
    handle = _open_input("--file", path)
    lines: list[tuple[int, str]] = []
    try:
        for number, line in enumerate(handle, start=1):
            lines.append((number, line))
    except UnicodeDecodeError:
        raise DelayQError(f"{name}:{len(lines) + 1}: not UTF-8 text") from None
    finally:
        if handle is not sys.stdin:
            handle.close()
    return lines


def _id_lines(path: str) -> list[tuple[int, str, str | None]]:
    """``(line number, id, rest of the line or None)`` for each non-blank line of an ids file.

    Raises:
        DelayQError: the file cannot be read, is not UTF-8, holds no id, or names an id twice.
    """
    name = "standard input" if path == "-" else path
    found: list[tuple[int, str, str | None]] = []
    for number, line in _numbered_lines(path):
        words = line.split(maxsplit=1)
        if words:
            found.append((number, words[0], words[1].strip() if len(words) > 1 else None))
    if not found:
        raise DelayQError(f"{name} holds no message id (one per line): nothing done")
    first: dict[str, int] = {}
    for number, msg_id, _ in found:
        if msg_id in first:
            raise DelayQError(
                f"{name}:{number}: {msg_id} is on line {first[msg_id]} already: nothing done"
            )
        first[msg_id] = number
    return found


def cmd_send(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq send``: print the id of every message sent."""
    from pyspark.sql import SparkSession

    from engine.core.message import message_property
    from engine.lakehouse.catalog.session import build_spark
    from engine.produce.send import commitlog_ready, send_many

    if args.file:
        messages = _messages_from_file(args.file, cfg)
    else:
        if not args.topic or args.body is None:
            raise DelayQError("send needs --topic and --body (or --file)")
        props = dict(message_property(p) for p in args.property)
        messages = [
            {
                "topic": args.topic,
                "body": args.body,
                "keys": args.key,
                "tags": args.tag,
                "properties": props,
                "delay_level": args.level,
                "deliver_at": args.deliver_at,
                "delay": args.delay,
                "msg_id": args.id,
                "window": args.window,
            }
        ]
    spark = None  # an existing commitlog takes the commit from here, without a JVM
    if SparkSession.getActiveSession() is not None or not commitlog_ready(cfg):
        note_local_spark(cfg)
        spark = build_spark(cfg.with_overrides(register_tables=False))
    for msg_id in send_many(spark, cfg, messages):
        print(msg_id)
    return 0


def show_topics(spark: Any, cfg: EngineConfig, limit: int) -> None:
    """Print each topic table's newest rows, with the lateness of each delivery."""
    from engine.lakehouse.delta.delta_log import list_topics
    from engine.lakehouse.storage.layout import layout

    for name in list_topics(cfg):
        df = spark.read.format("delta").load(layout(cfg).topic(name))
        print(f"\n== topic {cfg.database}.{name}: {df.count()} rows delivered")
        df.selectExpr(
            "msg_id",
            "array_join(keys, ' ') AS keys",
            "CAST(body AS STRING) AS body",
            "delay_level AS level",
            "date_format(store_ts, 'HH:mm:ss.SSS') AS stored",
            "date_format(deliver_ts, 'HH:mm:ss.SSS') AS due",
            "date_format(delivered_ts, 'HH:mm:ss.SSS') AS delivered",
            "unix_millis(delivered_ts) - unix_millis(deliver_ts) AS late_ms",
        ).orderBy("due", "msg_id").show(limit, truncate=40)


def cmd_run(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq run`` (and the spark-submit job): run the engine."""
    from engine.lakehouse.catalog.session import build_spark
    from engine.produce.send import send_many
    from engine.run.engine import Engine
    from engine.run.signals import StopSignals

    with StopSignals() as signals:  # Ctrl-C / SIGTERM: a clean stop, not the JVM's shutdown
        signals.install()
        spark = build_spark(cfg)
        signals.install(spark)
        if signals.requested.is_set():
            print("delayq: interrupted before the engine started", file=sys.stderr)
            return 130
        engine = Engine(spark, cfg)
        print(
            f"delayq: lakehouse {cfg.lakehouse_path}, {cfg.levels.max_level} levels "
            f"({cfg.levels.source}), database {cfg.database}"
        )
        control = metrics = upkeep = sql = None
        try:  # one engine per lakehouse: refuses, or stands by (lease.standby)
            engine.hold(stop=signals.requested, keep=True)
        except LakehouseHeldError:
            if not signals.requested.is_set():
                raise
        if signals.requested.is_set():
            engine.stop()
            print("delayq: interrupted before the engine started", file=sys.stderr)
            return 130

        def send_demo() -> None:
            ids = send_many(spark, cfg, demo_messages(cfg.levels.max_level))
            topics = ", ".join(DEMO_TOPICS)
            print(
                f"demo: sent {len(ids)} messages to {topics} on levels 0-{DEMO_MAX_LEVEL} "
                "and 2 timers"
            )

        try:
            control = _start_control(cfg, spark)
            metrics = _start_metrics(cfg, spark, engine)
            upkeep = _start_upkeep(cfg, spark)
            sql = _start_sql(cfg, spark, engine)
            final = engine.run(
                until_idle=args.until_idle,
                max_seconds=args.max_seconds,
                when_warm=send_demo if args.demo else None,
                stop=signals.requested,
            )
        finally:
            _stop_all(sql, upkeep, control, metrics)
            engine.stop()  # (when the engine never ran) lets the lakehouse go
    if args.show:
        show_topics(spark, cfg, args.show)
    if final.quarantined:
        where = f"SELECT * FROM {cfg.database}.quarantine"
        print(f"\n{final.quarantined} messages are in quarantine: {where}")
    print(f"\nQuery the topics in SQL: SELECT * FROM {cfg.database}.<topic>  (see README)")
    return 0


def _start_upkeep(cfg: EngineConfig, spark: Any) -> Any:
    """Run maintenance every ``maintenance.interval`` (off by default); the schedule, or None."""
    if not cfg.maintenance_interval_ms:
        return None
    from engine.run.upkeep import Upkeep, maintain_once

    session = spark.newSession()  # its settings (VACUUM's retention check) stay its own
    every = cfg.maintenance_interval_ms / 1000
    print(f"delayq: maintenance every {every:g} s (maintenance.interval)")
    return Upkeep(
        lambda: maintain_once(session, cfg, lambda line: print(f"maintain: {line}", flush=True)),
        every,
    ).start()


def _stop_all(*servers: Any) -> None:
    """Stop each server that started; one that fails to stop does not keep the others up."""
    first: BaseException | None = None
    for server in servers:
        if server is None:
            continue
        try:
            server.stop()
        except BaseException as err:
            first = first or err
    if first is not None:
        raise first


def _start_sql(cfg: EngineConfig, spark: Any, engine: Any) -> Any:
    """Serve JDBC and Spark Connect (``sql.server.enabled``) once the engine has opened the
    lakehouse (upgraded, recovered); the server, or None.

    Raises:
        ConfigError: a ``sql.server`` port or host cannot be listened on.
    """
    if not cfg.sql_server_enabled:
        return None
    from engine.run.sql_server import SqlServer

    engine.open()
    server = SqlServer(spark, cfg).start()
    print(f"delayq: SQL at {server.jdbc_url} (JDBC) and {server.connect_url} (Spark Connect)")
    if cfg.sql_server_host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"delayq: warning: SQL is served on {cfg.sql_server_host} without authentication; "
            "any client that reaches it can read and write every table"
        )
    return server


def _start_metrics(cfg: EngineConfig, spark: Any, engine: Any) -> Any:
    """Serve Prometheus metrics (``metrics.enabled``); the server, or None.

    Raises:
        ConfigError: ``metrics.host``/``metrics.port`` cannot be listened on.
    """
    if not cfg.metrics_enabled:
        return None
    from engine.run.metrics import MetricsServer

    server = MetricsServer(cfg, engine, spark.newSession()).start()
    print(f"delayq: Prometheus metrics at {server.url}")
    return server


def _start_control(cfg: EngineConfig, spark: Any) -> Any:
    """Start answering ``delayq`` commands (``control.enabled``); the server, or None.

    Raises:
        ConfigError: ``control.host``/``control.port`` cannot be listened on.
    """
    if not cfg.control_enabled:
        return None
    from engine.control.endpoint import ControlServer

    try:
        server = ControlServer(cfg, functools.partial(run_here, spark=spark)).start()
    except OSError as err:
        raise ConfigError(
            "control.port",
            f"{cfg.control_host}:{cfg.control_port}",
            f"cannot listen there ({err.strerror or err}): choose another control.port "
            "(0: any free one) or set control.enabled=false",
        ) from None
    print(f"delayq: answering delayq commands at {server.url} (control.json in _engine/)")
    # The first Spark reads of the tables take seconds (the engine's own rounds read them
    # with Arrow): run the reading commands once now, so the first a user types is quick too.
    where = ["--set", f"lakehouse.path={cfg.lakehouse_path}",
             "--set", f"lakehouse.database={cfg.database}",
             "--set", f"sql.catalog={cfg.sql_catalog}"]  # fmt: skip
    reading = (["status"], ["pending", "--limit", "1"], ["pending", "--topic", "-", "--limit", "1"],
               ["forecast", "--minutes", "1"], ["history", "--id", "-"], ["topics"],
               ["lag"])  # fmt: skip

    if cfg.control_warm_up:
        server.warm_up([[*command, *where] for command in reading])
    return server


def cmd_status(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq status``: counts per level from the tables and the checkpoint."""
    from engine.control.status import read_status
    from engine.core.clock import SystemClock
    from engine.lakehouse.catalog.session import build_spark
    from engine.lakehouse.delta.tables import ensure_tables
    from engine.lakehouse.state.lease import Lease, holder_line
    from engine.lakehouse.storage.layout import layout
    from engine.run.sql_server import read_addresses

    spark = build_spark(cfg)
    status = read_status(spark, cfg, ensure_tables(spark, cfg, migrate=False))
    print(f"lakehouse   {cfg.lakehouse_path}")
    print(f"sent        {status.sent}")
    print(f"to stamp    {status.unstamped}")
    print(f"quarantined {status.quarantined}")
    print(f"cancelled   {status.cancelled}")
    print(f"watermark   {status.watermark}")
    lease = Lease(layout(cfg).root, SystemClock(), cfg.lease_timeout_ms)
    now_ms = int(SystemClock().now().timestamp() * 1000)
    print(f"engine      {holder_line(lease.holder(), now_ms)}")
    served = read_addresses(cfg)
    if served is not None:
        print(f"sql         {served['jdbc']} (JDBC), {served['connect']} (Spark Connect)")
    print(f"{'queue':<16}{'pending':>10}{'delivered':>12}")
    for queue in sorted(set(status.pending) | set(status.delivered)):
        label = cfg.levels.label(queue)
        print(f"{label:<16}{status.pending.get(queue, 0):>10}{status.delivered.get(queue, 0):>12}")
    _print_lag(spark, cfg, None)
    return 0


def _print_lag(spark: Any, cfg: EngineConfig, group: str | None) -> None:
    from engine.consume.lag import lag

    rows = lag(spark, cfg, group).collect()
    if not rows and group is None:
        return
    print(f"{'consumer group':<20}{'topic':<24}{'lag':>8}  committed")
    for r in rows:
        print(f"{r['group_name']:<20}{r['topic']:<24}{r['lag']:>8}  {r['committed_ts']}")


def cmd_lag(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq lag``: each group's lag per topic table."""
    from engine.lakehouse.catalog.session import build_spark

    spark = build_spark(cfg)
    _print_lag(spark, cfg, args.group)
    if args.members:
        _print_members(spark, cfg, args.group)
    return 0


def _print_members(spark: Any, cfg: EngineConfig, group: str | None) -> None:
    from engine.consume.lag import members
    from engine.core.clock import SystemClock

    rows = members(spark, cfg, SystemClock().now(), group).collect()
    head = f"{'consumer group':<20}{'member':<28}{'handled 5m':>11}{'share':>7}{'total':>9}"
    print(f"\n{head}  last commit")
    for r in rows:
        share = "-" if r["share"] is None else f"{r['share']:.0%}"
        print(
            f"{r['group_name']:<20}{r['consumer']:<28}{r['handled']:>11}{share:>7}"
            f"{r['handled_total']:>9}  {r['last_commit_ts']}"
        )


def cmd_dlq(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq dlq``: list, show, resend or purge a group's dead letters."""
    from engine.consume import deadletter
    from engine.lakehouse.catalog.session import build_spark

    spark = build_spark(cfg)
    action = args.dlq_command
    if action == "list":
        deadletter.dead_letters(spark, cfg, args.group).show(args.limit, truncate=40)
    elif action == "show":
        print("\n".join(deadletter.show(spark, cfg, args.group, args.msg_id).lines()))
    elif action == "resend":
        ids = deadletter.resend(
            spark,
            cfg,
            args.group,
            msg_id=args.msg_id,
            key=args.key,
            everything=args.everything,
            again=args.again,
        )
        print(f"resent {len(ids)} dead letters:")
        for msg_id in ids:
            print(msg_id)
    else:
        what = "every dead letter" if args.everything else f"dead letter {args.msg_id}"
        if not args.yes:
            if not sys.stdin.isatty():
                raise DelayQError(f"purge {what} of group {args.group}: pass --yes to confirm")
            answer = input(f"Delete {what} of group {args.group}? Type the group name: ")
            if answer.strip() != args.group:
                print("not purged")
                return 1
        count = deadletter.purge(
            spark, cfg, args.group, msg_id=args.msg_id, everything=args.everything
        )
        print(f"purged {count} dead letters of group {args.group}")
    return 0


def cmd_topics(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq topics``: every topic table with its row count."""
    from engine.lakehouse.catalog.session import build_spark
    from engine.lakehouse.delta.delta_log import list_topics
    from engine.lakehouse.storage.layout import layout

    spark = build_spark(cfg)
    for name in list_topics(cfg):
        rows = spark.read.format("delta").load(layout(cfg).topic(name)).count()
        print(f"{cfg.database}.{name}\t{rows}")
    return 0


def cmd_sql(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq sql``: run a query in a session with every table registered."""
    from engine.lakehouse.catalog.session import build_spark

    build_spark(cfg).sql(args.query).show(args.limit, truncate=False)
    return 0


def cmd_maintain(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq maintain``: OPTIMIZE and VACUUM every table, with a line per table."""
    from engine.control.maintain import maintain
    from engine.lakehouse.catalog.session import build_spark

    spark = build_spark(cfg.with_overrides(register_tables=False))
    only = set(args.table) if args.table else None
    reports = list(
        maintain(spark, cfg, lambda line: print(line, flush=True), only,
                 full=args.full, vacuum_topics=args.vacuum_topics)
    )  # fmt: skip
    for report in reports:
        print(report.line())
    before = sum(r.files_before for r in reports)
    after = sum(r.files_after for r in reports)
    freed = sum(r.freed_bytes for r in reports) / 1e6
    print(f"{len(reports)} tables: {before} files -> {after}; {freed:.1f} MB freed")
    return 0


def cmd_pending(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq pending``: waiting messages, soonest first, with counts per topic."""
    from pyspark.sql import functions as F

    from engine.control.inspect import pending
    from engine.lakehouse.catalog.session import build_spark

    spark = build_spark(cfg)
    rows = pending(spark, cfg)
    if args.topic:
        rows = rows.where(F.lower(F.col("topic")) == args.topic.lower())
    if args.key:
        rows = rows.where(F.array_contains(F.col("keys"), args.key))
    rows = rows.cache()  # two answers from one read
    try:
        rows.groupBy("topic").count().orderBy("topic").show(truncate=False)
        rows.selectExpr(
            "msg_id", "topic", "array_join(keys, ' ') AS keys", "queue_id", "deliver_ts"
        ).orderBy("deliver_ts").show(args.limit, truncate=False)
    finally:
        rows.unpersist()
    return 0


def cmd_forecast(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq forecast``: pending messages per minute over the next minutes."""
    from engine.control.inspect import forecast
    from engine.core.clock import SystemClock
    from engine.lakehouse.catalog.session import build_spark

    forecast(build_spark(cfg), cfg, SystemClock().now(), args.minutes).show(
        args.minutes + 1, truncate=False
    )
    return 0


def cmd_history(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq history``: sent, stamped, quarantined and delivered events, in order."""
    from engine.control.inspect import history
    from engine.lakehouse.catalog.session import build_spark

    history(build_spark(cfg), cfg, msg_id=args.msg_id, key=args.key).show(200, truncate=False)
    return 0


def _report(results: Sequence[Any]) -> int:
    """Print each command's outcome (named by message id when there are several); exit 0
    when every one cancelled or rescheduled something, else 1."""
    many = len(results) > 1
    for msg_id, result in results:
        print(f"{msg_id}: {result.line()}" if many else result.line())
        for o in result.outcomes:
            if o.msg_id and o.result in ("cancelled", "rescheduled"):
                moved = f" -> {o.new_deliver_ts.isoformat()}" if o.new_deliver_ts else ""
                due = o.deliver_ts.isoformat() if o.deliver_ts else "?"
                print(f"  {o.result:<12}{o.msg_id}  {o.topic}  due {due}{moved}")
    if any(result.status == "pending" for _, result in results):
        what = "the commands stay" if many else "the command stays"
        print(f"no engine answered yet: {what} queued and apply when one runs")
    return 0 if all(r.status in ("cancelled", "rescheduled") for _, r in results) else 1


def _progress(verb: str) -> Any:
    """A progress line on a terminal (standard error) while a batch waits; None when piped."""
    if not sys.stderr.isatty():
        return None

    def show(decided: int, total: int) -> None:
        end = "\n" if decided == total else ""
        print(f"\r{verb}: {decided}/{total} decided by the engine", end=end, file=sys.stderr)

    return show


def cmd_cancel(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq cancel``: exit 0 when every message asked for was cancelled, 1 otherwise."""
    from engine.control.commands import cancel, cancel_many
    from engine.lakehouse.catalog.session import build_spark

    if args.key is not None:
        spark = build_spark(cfg)
        return _report([(args.key, cancel(spark, cfg, key=args.key, topic=args.topic,
                                          wait=args.wait))])  # fmt: skip
    if args.topic is not None:
        raise DelayQError("--topic goes with --key (a cancel by key), not with message ids")
    ids = args.msg_ids
    if args.file:
        lines = _id_lines(args.file)
        for number, _, rest in lines:
            if rest is not None:
                raise DelayQError(f"{args.file}:{number}: one message id per line, not {rest!r}")
        ids = [msg_id for _, msg_id, _ in lines]
    spark = build_spark(cfg)
    results = cancel_many(spark, cfg, ids, wait=args.wait, progress=_progress("cancel"))
    return _report(list(zip(ids, results, strict=True)))


#: A bare number in a moves file below this is a delay without its unit, not a time in ms.
_EARLIEST_MS = 10**11  # 1973


def _when(text: str, where: str) -> tuple[str | None, str | None]:
    """A time from a moves file as (deliver_at, delay): digits (ms) or a date are a time.

    Raises:
        DelayQError: a bare number too small to be ms since the epoch (``90`` for ``90s``).
    """
    if text.isdigit() and int(text) < _EARLIEST_MS:
        raise DelayQError(f"{where}: {text} has no unit: write e.g. {text}s, or ms since the epoch")
    looks_like_time = text.isdigit() or "-" in text or ":" in text
    return (text, None) if looks_like_time else (None, text)


def cmd_reschedule(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``delayq reschedule``: exit 0 when every message was moved, 1 otherwise."""
    from engine.control.commands import reschedule_many
    from engine.lakehouse.catalog.session import build_spark

    default = (args.deliver_at, args.delay)
    moves: list[tuple[str, str | None, str | None]] = []
    if args.file:
        for number, msg_id, rest in _id_lines(args.file):
            where = f"{args.file}:{number}"
            deliver_at, delay = _when(rest, where) if rest is not None else default
            if deliver_at is None and delay is None:
                raise DelayQError(
                    f"{where}: no new time for {msg_id}: put one after the id "
                    "or give --deliver-at or --delay"
                )
            moves.append((msg_id, deliver_at, delay))
    else:
        if default == (None, None):
            raise DelayQError("reschedule needs --deliver-at or --delay")
        moves = [(msg_id, *default) for msg_id in args.msg_ids]
    spark = build_spark(cfg)
    results = reschedule_many(spark, cfg, moves, wait=args.wait,
                              progress=_progress("reschedule"))  # fmt: skip
    return _report([(move[0], r) for move, r in zip(moves, results, strict=True)])


COMMANDS = {
    "send": cmd_send,
    "run": cmd_run,
    "status": cmd_status,
    "topics": cmd_topics,
    "sql": cmd_sql,
    "pending": cmd_pending,
    "forecast": cmd_forecast,
    "history": cmd_history,
    "cancel": cmd_cancel,
    "reschedule": cmd_reschedule,
    "lag": cmd_lag,
    "dlq": cmd_dlq,
    "maintain": cmd_maintain,
    "schedule": cmd_schedule,
}
#: Commands that need no Spark and no engine: carried out here, always.
NO_SPARK = frozenset({"schedule"})


#: Said once when a command starts a Spark of its own.
LOCAL_NOTE = (
    "delayq: no engine is running on {lakehouse}: starting a Spark for this command alone "
    "(20-30 s). A running engine (`delayq run`, `make engine`) answers in about a second."
)


def console() -> None:
    """The ``delayq`` console script: :func:`main`, then the exit handlers, then leave.

    The process leaves with ``os._exit`` once Python's exit handlers have run (the checkpoint
    thread's among them) and output is flushed: a finished command is not turned into an
    abort (exit 134) by a native thread pool's destructor at interpreter exit, as Arrow's
    can do intermittently (apache/arrow#34314).
    """
    import atexit
    import logging
    import os

    code = main()
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``delayq``; returns the process exit code."""
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    log_file = setup_logging("delayq")
    return run_main("delayq", lambda: _dispatch(args, raw), log_file)


def _dispatch(args: argparse.Namespace, raw: list[str]) -> int:
    """Run the command in the engine on the lakehouse when one answers, else here."""
    cfg = config_from_args(args)
    if args.command in NO_SPARK:
        return COMMANDS[args.command](args, cfg)
    if args.command != "run" and not args.local:
        code = _in_engine(args, raw, cfg)
        if code is not None:
            return code
        if args.command != "send":  # it says so itself when it needs a Spark
            note_local_spark(cfg)
    if args.command not in ("run", "send"):  # (those two start theirs themselves)
        start_spark_held(cfg)
    return COMMANDS[args.command](args, cfg)


def start_spark_held(cfg: EngineConfig) -> None:
    """Start the command's Spark with Ctrl-C and SIGTERM held until its JVM is up.

    PySpark starts the JVM, then waits for it to write its address into a folder; a Ctrl-C in
    that wait removed the folder, and the JVM printed a Java stack trace and ran on, orphaned.
    Held, a signal stops the command once the JVM answers: the JVM is stopped, one line says
    so, and the exit code is 130. The commands then find this session (``build_spark``).

    Raises:
        KeyboardInterrupt: a Ctrl-C or SIGTERM came while the JVM started.

    Example:
        >>> start_spark_held(cfg)  # doctest: +SKIP
    """
    import signal
    import threading

    from pyspark.sql import SparkSession

    from engine.lakehouse.catalog.session import build_spark

    if SparkSession.getActiveSession() is not None:
        return
    if threading.current_thread() is not threading.main_thread():
        return  # signals reach the main thread only (and handlers are set there)
    held: list[int] = []

    def hold(number: int, _frame: object) -> None:
        held.append(number)

    numbers = (signal.SIGINT, signal.SIGTERM)
    previous = {number: signal.signal(number, hold) for number in numbers}
    try:
        spark = build_spark(cfg.with_overrides(register_tables=False))
    except Exception:
        if held:  # a SIGTERM to the process group stopped the JVM itself
            raise KeyboardInterrupt from None
        raise
    finally:
        for number, handler in previous.items():
            if signal.getsignal(number) is hold:  # (PySpark puts its own SIGINT handler)
                signal.signal(number, handler)
    if held:
        spark.stop()
        raise KeyboardInterrupt


def note_local_spark(cfg: EngineConfig) -> None:
    """Say once on standard error that this command starts a Spark of its own (none when it
    runs in an engine's, or a caller's, session)."""
    from pyspark.sql import SparkSession

    if SparkSession.getActiveSession() is None:
        print(LOCAL_NOTE.format(lakehouse=cfg.lakehouse_path), file=sys.stderr)


def _in_engine(args: argparse.Namespace, raw: list[str], cfg: EngineConfig) -> int | None:
    """Have the running engine carry out the command; its exit code, or None when no engine
    answers. Paths are made absolute (the engine runs elsewhere), files and standard input
    travel with the command, and ``dlq purge`` asks for its confirmation here."""
    import os

    from engine.control.remote import call, running_engine

    if running_engine(cfg) is None:
        return None
    # The engine runs elsewhere: the same config file and lakehouse, as absolute paths.
    conf = args.conf or os.environ.get("DELAYQ_CONF") or str(DEFAULT_CONF)
    argv = [*raw, "--set", f"lakehouse.path={cfg.lakehouse_path}",
            "--conf", os.path.abspath(os.path.expanduser(conf))]  # fmt: skip
    stdin: str | None = None
    files: dict[str, str] = {}
    path = getattr(args, "file", None)
    if path == "-":
        stdin = sys.stdin.read()
        sys.stdin = io.StringIO(stdin)  # still there for a local run
    elif path:
        try:
            with open(path, encoding="utf-8") as handle:
                files[path] = handle.read()
        except OSError as err:
            raise DelayQError(f"cannot read --file {path}: {err.strerror}") from None
        except UnicodeDecodeError:
            return None  # a local run says which line
    asks = args.command == "dlq" and args.dlq_command == "purge" and not args.yes
    if asks and sys.stdin.isatty():
        what = "every dead letter" if args.everything else f"dead letter {args.msg_id}"
        answer = input(f"Delete {what} of group {args.group}? Type the group name: ")
        if answer.strip() != args.group:
            print("not purged")
            return 1
        argv.append("--yes")
        args.yes = True  # asked once, also for a local run
    reply = call(cfg, argv, stdin, files)
    if reply is None:
        return None
    sys.stdout.write(reply.stdout)
    sys.stderr.write(reply.stderr)
    return reply.code


def run_here(
    argv: list[str],
    stdin: str | None,
    files: dict[str, str],
    who: str | None = None,
    *,
    spark: Any = None,
) -> tuple[int, str, str]:
    """Run ``delayq <argv>`` in this process, its output captured: how a running engine
    carries out a command it is sent (:class:`~engine.control.endpoint.ControlServer`).

    Args:
        argv: the command and its arguments.
        stdin: its standard input.
        files: the files it reads, by the name on its command line (no other is opened).
        who: the caller's ``user@host`` (recorded as ``issued_by`` of its commands).
        spark: the engine's session; the command gets a session of its own from it.

    Example:
        >>> run_here(["status", "--bogus"], None, {})[0]
        2
    """
    from engine.control.endpoint import captured
    from engine.lakehouse.catalog.session import separate_session

    if spark is not None:
        with separate_session(spark):
            return run_here(argv, stdin, files, who)
    with captured(stdin, files, who) as (out, err):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as stop:  # argparse: a usage error or --help
            code = stop.code if isinstance(stop.code, int) else 2
            return code, out.getvalue(), err.getvalue()
        if args.command == "run":
            print("delayq: error: an engine is running on this lakehouse already", file=sys.stderr)
            return 2, out.getvalue(), err.getvalue()
        from engine.run.report import log_dir

        log_file = log_dir() / "delayq-engine-commands.log"
        code = run_main(
            "delayq", lambda: COMMANDS[args.command](args, config_from_args(args)), log_file
        )
        return code, out.getvalue(), err.getvalue()


if __name__ == "__main__":
    sys.exit(main())
