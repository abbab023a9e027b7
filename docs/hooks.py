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
        parts.append(f"## `{name.lower()}`\n")
        parts.append("| column | type |\n|---|---|")
        parts.extend(f"| `{f.name}` | `{f.dataType.simpleString()}` |" for f in schema.fields)
        parts.append("")
    parts.append("## What each table holds\n")
    parts.append((module.__doc__ or "").replace("``", "`"))
    return "\n".join(parts)


PAGES = {
    "reference/configuration.md": configuration,
    "reference/cli.md": cli,
    "reference/tables.md": tables,
}


def on_files(files: Any, config: Any) -> Any:
    """Add the generated reference pages to the site."""
    from mkdocs.structure.files import File

    for path, make in PAGES.items():
        files.append(File.generated(config, path, content=make()))
    return files
