"""MkDocs hooks: the reference pages, made from the code at each build so that they cannot
drift from it (configuration from ``engine.core.config``, the command line from
``engine.cli``'s parser, tables from ``schemas``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGURATION = """# Configuration

The engine reads `conf/engine.toml` (or the file `--conf` or `DELAYQ_CONF` names), and every
key can be set on the command line with `--set key=value`
(`--set levels.delays="1s 2s 3s"`). A bad key or value stops the start, naming both:
`invalid configuration levels.delays='1s 2x': bad token '2x' ...`.

This table is made from the engine's definitions at each build of these pages: the values a
key accepts, its default as `conf/engine.toml` ships it, and what it does.

"""


def configuration() -> str:
    """The configuration page."""
    from engine.core.reference import markdown, settings

    return CONFIGURATION + markdown(settings())


def cli() -> str:
    """The command line page: every command's ``--help``."""
    from engine.cli import build_parser

    os.environ["COLUMNS"] = "96"  # (argparse wraps to the terminal's width)
    parser = build_parser()
    parts = [
        "# Command line\n",
        "`delayq` (in `.venv/bin`, or on the PATH once `source .venv/bin/activate`) sends, "
        "inspects and runs; each command's `--help` says the same as this page, which is "
        "made from the parser at each build.\n",
        "```text\n" + parser.format_help() + "```\n",
    ]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        parts.append(f"## `delayq {name}`\n")
        parts.append("```text\n" + command.format_help() + "```\n")
    return "\n".join(parts)


VIEWS_INTRO = """## Views

Named in the database `delayq` (`lakehouse.database`) with the tables; their SQL is in
`engine/lakehouse/catalog/views.py`.

| view | one row per |
|---|---|
"""

VIEWS = {
    "delay_offset": "round and queue of the delayOffset log (`status`, the round's `watermark`,"
    " what it `delivered`)",
    "pending": "message stamped and neither delivered by the committed progress nor cancelled"
    " (the columns of `schedule`)",
    "due_forecast": "minute of the next hour: how many pending messages fall due in it",
    "history": "event of a message: sent, stamped or quarantined (with the reason),"
    " rescheduled, delivered or cancelled",
    "consumer_lag": "consumer group and topic: rows delivered after the group's committed"
    " position (named once a group has committed)",
    "schedules": "recurring schedule not deleted: its newest revision and `next_fire_ts`, its"
    " next occurrence not sent yet, as the running engine published it (named once an engine"
    " has fired schedules; see [Recurring schedules](../guides/recurring.md))",
    "schedule_request_results": "row inserted into `schedule_requests`: `applied` with the"
    " revision it made, or `refused` with why (named once the engine has decided one)",
}


def tables() -> str:
    """The tables page: each table's columns and Spark types, from ``schemas``."""
    import schemas
    from schemas import tables as module

    parts = [
        "# Tables\n",
        "The Delta tables of a lakehouse, with the columns and types defined once in "
        "`schemas/tables.py` (this page is made from it at each build). Every column is "
        "nullable: a row another writer added may be incomplete, and the engine quarantines "
        "it with a reason instead of failing.\n",
    ]
    for name in schemas.__all__:
        schema = getattr(schemas, name, None)
        if schema is None or not hasattr(schema, "fields"):
            continue
        kind = " (a log of JSON files, not a Delta table; SQL reads it as a view)"
        parts.append(f"## `{name.lower()}`{kind if name == 'DELAY_OFFSET' else ''}\n")
        parts.append("| column | type |\n|---|---|")
        parts.extend(f"| `{f.name}` | `{f.dataType.simpleString()}` |" for f in schema.fields)
        parts.append("")
    parts.append(VIEWS_INTRO + "\n".join(f"| `{v}` | {what} |" for v, what in VIEWS.items()))
    parts.append("")
    parts.append("## What each table holds\n")
    parts.append((module.__doc__ or "").replace("``", "`"))
    return "\n".join(parts)


ERRORS = """# Errors and exit codes

When something goes wrong, the engine, the ingest job and every `delayq` command end in one of
three ways.

- **An error the engine recognises** prints one line starting `error:` and exits 2: a mistake
  in the input, the configuration or the set-up (naming the key, field or file and what to
  do), or a failure it reports as such (the delivery stage failing round after round, the
  ingest stopping, records gone from Kafka before the ingest stored them). A stamping batch or
  delivery round is retried, 10 s apart and up to 30 times in a row, only for failures that
  can pass: storage and network errors, Delta conflicts, Spark task and executor failures
  (`engine/run/failures.py` lists them); any other exception in a stage is a bug and stops the
  engine at once.
- **An interruption**: a Ctrl-C before the engine runs exits 130, and so does a command
  stopped (Ctrl-C or SIGTERM) while its Spark starts: it waits for the JVM to answer, stops
  it, and says `delayq: interrupted`. A Ctrl-C or SIGTERM once the engine runs stops it
  cleanly, with exit 0.
- **Anything else is a bug**: one line names the error and the log file that holds the whole
  traceback, Python's and the JVM's, and the exit code is 70, for example `delayq: internal
  error (a bug): NumberFormatException: For input string: "x"; the traceback is in
  $TMPDIR/delayq-logs/delayq-20261124T040102-4242.log`.

A `delayq` command that waits for a running engine's answer (`cancel`, `reschedule`) exits 1
when the answer is no (nothing cancelled, not moved) or no engine answered in time.

Log records reach the console one line each. The JVM writes its stack traces to `spark.log`
in the same folder and names it on the console line; that file is shared by the programs on
the machine. The folder is `$DELAYQ_LOG_DIR`, by default `delayq-logs` under `$TMPDIR` or
`/tmp`, and a program removes its own log files older than a week when it starts.

## The exceptions

From Python, every error delayq raises on purpose is a `DelayQError`; catch
`RetryableError` to retry. This table is made from `engine/core/errors.py` at each build.

"""


def errors() -> str:
    """The errors page: exit codes, then each exception class with its parent and meaning."""
    import inspect

    from engine.core import errors as module

    rows = ["| exception | is a | raised when |", "|---|---|---|"]
    for name, cls in inspect.getmembers(module, inspect.isclass):
        if not issubclass(cls, module.DelayQError) or cls.__module__ != module.__name__:
            continue
        parent = cls.__mro__[1].__name__
        meaning = " ".join((cls.__doc__ or "").split())
        rows.append(f"| `{name}` | `{parent}` | {meaning} |")
    return ERRORS + "\n".join(rows) + "\n"


def getting_started() -> str:
    """The getting-started page: the repository's README, its links made relative to the
    pages (so the README and the site cannot say different things)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.replace("](docs/pages/", "](")


PAGES = {
    "getting-started.md": getting_started,
    "reference/configuration.md": configuration,
    "reference/cli.md": cli,
    "reference/tables.md": tables,
    "reference/errors.md": errors,
}


def on_files(files: Any, config: Any) -> Any:
    """Add the generated reference pages to the site."""
    from mkdocs.structure.files import File

    for path, make in PAGES.items():
        files.append(File.generated(config, path, content=make()))
    return files
