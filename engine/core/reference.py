"""The configuration reference, made from the definitions in :mod:`engine.core.config`, so
that it cannot drift from them: every key the engine takes, what values it accepts (the
first line of its parser's docstring), its default (as ``conf/engine.toml`` ships it) and
what it does (:data:`MEANINGS`). The docs site's Reference > Configuration page is this
table (``docs/hooks.py``).

Example:
    >>> [s.key for s in settings()][:2]
    ['lakehouse.path', 'lakehouse.database']
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.config import DEFAULT_CONF, GROUP_KEYS, KEYS, flatten

#: Keys that name something of the user's (a Spark setting, a group, a topic), with the kind
#: of their values.
PATTERNS: dict[str, str] = {
    "spark.conf.<any>": "a Spark setting's value",
    "consumers.groups.<group>.<key>": "as the `consumers.<key>` of the same name",
    "kafka.sinks.<topic>": "one of `delta`, `kafka`, `both`",
    "topics.<topic>.max_rate": "as `delivery.max_rate`",
}

#: Defaults of keys that ``conf/engine.toml`` does not list.
DEFAULTS: dict[str, str] = {
    "spark.conf.<any>": "see `conf/engine.toml`",
    "kafka.sinks.<topic>": "`delta`",
    "topics.<topic>.max_rate": "`delivery.max_rate`",
}

#: What each key does, in the words of the docs' table.
MEANINGS: dict[str, str] = {
    "lakehouse.path": (
        "root of the tables and checkpoints (a local folder, relative to the current "
        "directory, a `file:///` URI, or `s3a://bucket/prefix`)"
    ),
    "storage.s3.endpoint": "the S3 service's URL (empty: `AWS_ENDPOINT_URL`, else AWS's own)",
    "storage.s3.region": "the bucket's region (empty: `AWS_REGION`, else `us-east-1`)",
    "storage.s3.path_style": (
        "buckets in the URL path, as S3Proxy and most S3-compatible servers want"
    ),
    "storage.s3.access_key": (
        "credentials, with `--set` (empty: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`)"
    ),
    "storage.s3.secret_key": (
        "credentials, with `--set` (empty: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`)"
    ),
    "lakehouse.database": "SQL database of the tables",
    "levels.delays": "level table; units `ms s m h d`",
    "messages.max_body_bytes": "largest body accepted",
    "messages.allow_empty_body": "accept messages with an empty body",
    "messages.max_property_name_length": (
        "longest property name (characters `A-Z a-z 0-9 _ . - :`); at least 32, the "
        "engine's own names must fit"
    ),
    "messages.max_delay": "longest delay a timer message may ask for",
    "messages.dedup_window": (
        "a stamped `msg_id` stays taken this long after the later of its store and deliver "
        "times, and a copy sent meanwhile is a duplicate; at least the longest level, `0` "
        "turns it off"
    ),
    "stamp.interval": (
        "how often stamping looks for new `commitlog` versions (a look is one file check)"
    ),
    "stamp.idle_wait": (
        "with `stamp.mode = streaming`: once a look found nothing new, the next one waits "
        "up to this long for a new `commitlog` version (a file check every 10 ms, or every "
        "`stamp.interval` on an object store) before it tells Spark nothing came, so an "
        "idle query runs about 2 triggers a second instead of 20 and a message sent "
        "meanwhile is stamped as soon as it is seen; `off`: a trigger every "
        "`stamp.interval`"
    ),
    "stamp.max_files_per_batch": "most `commitlog` data files per stamping batch",
    "stamp.max_bytes_per_batch": (
        "most `commitlog` bytes (Parquet) per stamping batch; a batch is held in the "
        "driver's memory, as Arrow, while it is written, and one file larger than this is a"
        " batch of its own"
    ),
    "stamp.mode": (
        "`streaming`: the Structured Streaming query `delayq-stamp` (see [the stages as "
        "streaming queries](../operations/streaming-queries.md)), and a lakehouse the query "
        "has stamped stays on `streaming`; `driver`: a driver thread stamps, no streaming query"
    ),
    "stamp.driver_batch_bytes": (
        "with `streaming`, a batch of at most this many `commitlog` bytes is read, stamped "
        "and written on the driver; a larger one by Spark tasks; `0`: always by Spark tasks"
    ),
    "stamp.max_rows_per_file": (
        "about this many rows per `schedule` file (sorted by `deliver_ts`; files are cut by"
        " an estimated size): smaller files let rounds skip more of a backlog"
    ),
    "delivery.poll_interval": "how often the delivery stage runs a round",
    "delivery.mode": (
        "`streaming`: the Structured Streaming query `delayq-deliver`, whose trigger plans "
        "each round's watermark into Spark's offsets log (see [the stages as "
        "streaming queries](../operations/streaming-queries.md)); `driver`: a driver thread "
        "runs the rounds"
    ),
    "delivery.driver_round_rows": (
        "with `streaming`, a round whose window's `schedule` files hold at most this many "
        "rows is read and written on the driver; a larger one by Spark tasks (the driver "
        "commits their files); `0`: every round that reads rows"
    ),
    "delivery.max_rate": (
        "the most messages a second delivery shows in any one topic table (`5000/s`, "
        "`300/m`, `20/h`; `off`: no cap): rows due beyond it wait and go at the cap, in "
        "`deliver_ts` order, never early"
    ),
    "topics.<topic>.max_rate": (
        "the topic table's own delivery rate cap (`off`: none, whatever `delivery.max_rate` says)"
    ),
    "delivery.checkpoint_flush_interval": "longest an idle stage waits before recording progress",
    "delivery.progress_interval": "how often a running job prints progress",
    "delivery.topic_writers": (
        "topic tables a round writes at once (one commit each); raise it where commits wait"
        " on a network store"
    ),
    "delivery.idle_interval": (
        "with `delivery.mode = streaming`: while the `schedule` files' statistics show "
        "nothing can fall due and no new `schedule` or `commands` version exists, the "
        "delivery query runs no batch for up to this long (its watermark, and the progress "
        "it commits, wait as long); `off`: a batch every `delivery.poll_interval`"
    ),
    "delivery.max_lead": (
        "a running engine plans a round up to this far ahead of the clock, and at most 3/4 "
        "of `delivery.poll_interval` (so 150 ms with the default 200 ms poll: this default "
        "matters only with a poll interval above 667 ms); the lead follows how long the "
        "last rounds took to write their files. The topic files are written first, "
        "unseen, and committed once the clock reaches the round's watermark (never early); "
        "a round planned at the time of the next row due may be up to "
        "`delivery.poll_interval` ahead; `off` plans every round at the current time"
    ),
    "lease.timeout": (
        "how long an engine's hold on the lakehouse lasts without a renewal (see [one "
        "engine per lakehouse](../operations/one-engine.md))"
    ),
    "lease.standby": "a second engine waits to take over instead of refusing to start",
    "spark.master": (
        "master when the engine builds its own session (`spark://127.0.0.1:7077`: [run on a"
        " cluster](../operations/cluster.md))"
    ),
    "spark.app_name": "the Spark application's name, as the Spark UI and `spark-submit` show it",
    "spark.jars_dir": "folder of the jars passed as `spark.jars`",
    "spark.log_level": "Spark's log level",
    "sql.register_tables": "register tables by name in the session catalog",
    "sql.catalog": (
        "where names live: `embedded` (Hive metastore in `<lakehouse>/_metastore`), `spark`"
        " (your Spark's catalog), `memory`"
    ),
    "sql.server.enabled": (
        "the engine serves JDBC (Thrift server) and Spark Connect (see [SQL from other "
        "tools](../guides/sql-tools.md))"
    ),
    "sql.server.host": "the address both listen on",
    "sql.server.jdbc_port": (
        "the Thrift server's port (0: any free one, written to `_engine/sql.json`)"
    ),
    "sql.server.connect_port": "Spark Connect's port (0: any free one)",
    "spark.conf.<any>": "passed to Spark as is",
    "consumers.retry_delays": (
        "retry delay: level 3 + reconsumeTimes, or a list such as `1s 5s 30s`"
    ),
    "consumers.max_reconsume_times": "retries before a failure goes to `dlq_<group>`",
    "consumers.poll_timeout": "how long an empty poll waits",
    "consumers.groups.<group>.<key>": (
        "`max_reconsume_times`, `retry_delays` or `poll_timeout` for one group"
    ),
    "kafka.bootstrap_servers": "brokers for ingest and for delivery to Kafka",
    "kafka.ingest_topics": "Kafka topics the ingest job reads (comma-separated)",
    "kafka.topic_map": (
        "the real topic of each Kafka topic's records that carry no `REAL_TOPIC` header: "
        "`in_a=orders, in_b=audit`"
    ),
    "kafka.starting_offsets": "where a new ingest job starts",
    "kafka.max_offsets_per_trigger": "most records per ingest batch",
    "kafka.sinks.<topic>": (
        "where delivery writes the topic's messages: its Delta table, the Kafka topic of its "
        "name, or both"
    ),
    "kafka.exactly_once": (
        "deliver to Kafka in one transaction per round and topic (once for `read_committed`"
        " readers)"
    ),
    "control.enabled": (
        "a running engine carries out `delayq` commands (see [commands while an engine "
        "runs](../operations/commands.md))"
    ),
    "control.host": "the address it listens on",
    "control.port": "its port (0: any free one, written to `<lakehouse>/_engine/control.json`)",
    "control.warm_up": (
        "run the reading commands once at start, so the first one a user types is as quick "
        "as the next (about 12 CPU-s at start on 2 cores)"
    ),
    "metrics.enabled": (
        "a running engine serves Prometheus metrics (see [metrics](../operations/metrics.md))"
    ),
    "metrics.host": "the address they are served on",
    "metrics.port": "their port (0: any free one, printed at start)",
    "metrics.refresh_interval": "how often a scrape refreshes the consumer lag and next due time",
    "maintenance.retention": (
        "`delayq maintain` deletes files no version this recent needs (at least 1h)"
    ),
    "maintenance.interval": (
        "a running engine does `delayq maintain`'s work this often (at least 10m)"
    ),
    "maintenance.prune_after": (
        "`delayq maintain` deletes `schedule` rows done this long before the watermark (`0`: never)"
    ),
}


@dataclass(frozen=True)
class Setting:
    """One row of the configuration reference."""

    key: str
    kind: str
    default: str
    meaning: str


def _kind(parse: Callable[[str, object], Any]) -> str:
    doc = (parse.__doc__ or "Text.").strip().splitlines()[0].rstrip(".")
    return doc if doc.startswith("`") else doc[0].lower() + doc[1:]


def _shown(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def settings(conf: Path = DEFAULT_CONF) -> list[Setting]:
    """Every key, grouped by section in the order ``conf`` lists them, then the rest.

    Raises:
        KeyError: a key has no meaning written in :data:`MEANINGS` (a test checks there is
            none).

    Example:
        >>> next(s for s in settings() if s.key == "lease.timeout").default
        '`15s`'
    """
    shipped = flatten(tomllib.loads(conf.read_text(encoding="utf-8")))
    kinds = {key: _kind(parse) for key, (_, parse) in KEYS.items()}
    kinds |= {f"consumers.{key}": _kind(parse) for key, (_, parse) in GROUP_KEYS.items()}
    kinds |= PATTERNS
    order = {k: i for i, k in enumerate(dict.fromkeys(k.split(".")[0] for k in shipped))}
    keys = sorted(kinds, key=lambda k: order.get(k.split(".")[0], len(order)))
    rows = []
    for key in keys:
        default = DEFAULTS.get(key, "")
        if key in shipped:
            default = f"`{_shown(shipped[key])}`" if _shown(shipped[key]) else "(empty)"
        rows.append(Setting(key, kinds[key], default or "(empty)", MEANINGS[key]))
    return rows


def markdown(rows: list[Setting]) -> str:
    """The reference as a Markdown table.

    Example:
        >>> markdown(settings()).splitlines()[0]
        '| key | values | default | what it does |'
    """
    lines = ["| key | values | default | what it does |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| `{row.key}` | {row.kind} | {row.default} | {row.meaning} |")
    return "\n".join(lines) + "\n"
