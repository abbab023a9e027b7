"""A plain ``spark-sql`` on a lakehouse whose metastore a running engine holds: one line.

Derby opens the embedded metastore (``<lakehouse>/_metastore/db``) in one process at a time.
``spark-sql`` pointed at it while an engine runs would wait about 30 s and print thousands of
lines of Derby's stack trace. The venv's launcher (``.venv/bin/find-spark-home``, written by
``make venv``) runs :func:`main` with ``spark-sql``'s arguments first: when the metastore
they name is held by another process, it says so in one line, naming the engine's SQL
endpoint, and ``spark-sql`` exits 3 before its JVM starts.

Example:
    >>> metastore_named(["--conf", "spark.hadoop.javax.jdo.option.ConnectionURL="
    ...     "jdbc:derby:;databaseName=/lake/_metastore/db;create=true"])
    '/lake/_metastore/db'
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.lakehouse.catalog.metastore import claimant, holder

#: The exit status of a ``spark-sql`` refused here (the launcher passes any other through).
HELD = 3
_URL_KEY = "spark.hadoop.javax.jdo.option.ConnectionURL"
_DATABASE = re.compile(r"databaseName=([^;]+)")


def metastore_named(args: Sequence[str], spark_home: str | None = None) -> str | None:
    """The Derby database ``spark-sql`` with ``args`` would open: a ``--conf`` of the
    metastore's JDBC address, else the ``--properties-file`` (else Spark's
    ``conf/spark-defaults.conf``); ``None`` when none names an embedded Derby database.

    Example:
        >>> metastore_named(["-e", "SELECT 1"], spark_home="/nonexistent") is None
        True
    """
    url, properties = None, None
    items = list(args)
    for i, arg in enumerate(items):
        following = items[i + 1] if i + 1 < len(items) else ""
        if arg in ("--conf", "-c") and following.startswith(f"{_URL_KEY}="):
            url = following.split("=", 1)[1]
        elif arg.startswith(f"--conf={_URL_KEY}="):
            url = arg.split("=", 2)[2]
        elif arg == "--properties-file":
            properties = following
        elif arg.startswith("--properties-file="):
            properties = arg.split("=", 1)[1]
    if url is None:
        if properties is None and spark_home:
            properties = os.path.join(spark_home, "conf", "spark-defaults.conf")
        url = _property(properties, _URL_KEY) if properties else None
    found = _DATABASE.search(url or "")
    return found.group(1) if found and url and url.startswith("jdbc:derby:") else None


def _property(path: str, key: str) -> str | None:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.strip().partition(" ")
        if name == key:
            return value.strip()
    return None


def refusal(database: str) -> str | None:
    """Why ``spark-sql`` cannot open the metastore at ``database`` now (one line), or
    ``None`` when no other process holds it.

    Example:
        >>> refusal("/nonexistent/_metastore/db") is None
        True
    """
    pid = holder(database)
    if pid is None:
        pid = claimant(Path(database).parent)
    if pid is None:
        return None
    lakehouse = Path(database).parent.parent
    who = f"process {pid}" if pid > 0 else "another process"
    served = _served(lakehouse)
    where = (
        f"query it through that engine's SQL endpoint: beeline -u {served}"
        if served
        else "start the engine with sql.server.enabled = true to query it while it runs "
        "(beeline, Spark Connect), or stop it first"
    )
    return (
        f"spark-sql: the metastore of the lakehouse {lakehouse} is open in {who} (a running "
        f"engine or session), and Derby opens it in one process at a time; {where}"
    )


def _served(lakehouse: Path) -> str | None:
    """The JDBC address the engine on ``lakehouse`` serves SQL at, if it says so."""
    try:
        found = json.loads((lakehouse / "_engine" / "sql.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    address = found.get("jdbc") if isinstance(found, dict) else None
    return address if isinstance(address, str) else None


def main(argv: Sequence[str] | None = None) -> int:
    """Check ``spark-sql``'s arguments; ``HELD`` (after one line on stderr) when the
    metastore they name is held, else 0.

    Example:
        >>> main(["-e", "SELECT 1"])  # doctest: +SKIP
        0
    """
    args = list(sys.argv[1:] if argv is None else argv)
    database = metastore_named(args, os.environ.get("SPARK_HOME"))
    if database is None:
        return 0
    said = refusal(database)
    if said is None:
        return 0
    print(said, file=sys.stderr)
    return HELD


if __name__ == "__main__":
    sys.exit(main())
