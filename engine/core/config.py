"""Engine configuration: loaded once, frozen, validated.

Settings come from a TOML file (``conf/engine.toml`` by default) and ``key=value``
overrides (``--set`` on the command line, or the ``overrides`` argument). Keys are dotted
(``delivery.poll_interval``). An unknown key or a bad value fails at start with a message
naming the key and the value.

Example:
    >>> cfg = EngineConfig.from_mapping({"levels.delays": "1s 2s 3s", "lakehouse.path": "lh"})
    >>> cfg.levels.max_level
    3
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.core.errors import ConfigError, InvalidMessageError
from engine.core.levels import DEFAULT_LEVELS, LevelTable, parse_duration_ms, parse_levels
from engine.core.topics import check_topic

#: Where the default configuration file lives, relative to the repository root.
DEFAULT_CONF = Path(__file__).resolve().parents[2] / "conf" / "engine.toml"
#: Spark settings sized for one machine (Spark's own defaults are 200 shuffle partitions and
#: Delta's 50 snapshot partitions, several times slower per round on 2 cores). Entries under
#: ``[spark.conf]`` in the file, or ``spark.conf.*`` overrides, replace them.
LOCAL_SPARK_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.databricks.delta.snapshotPartitions": "2",
}
#: The smallest ``messages.max_property_name_length``: the engine's own names are up to 17.
MIN_PROPERTY_NAME = 32
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
#: A URI scheme (two characters or more, so that a Windows drive letter is a path).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


#: Most records in one ingest batch: a batch is held in the driver's memory while stored.
MAX_BATCH_RECORDS = 10_000_000


def _positive_int(key: str, value: object) -> int:
    """A whole number, at least 1."""
    try:
        number = int(str(value))
    except ValueError:
        raise ConfigError(key, value, "expected a whole number") from None
    if number <= 0:
        raise ConfigError(key, value, "must be greater than 0")
    return number


def _batch_records(key: str, value: object) -> int:
    """A whole number, 1 to 10,000,000."""
    number = _positive_int(key, value)
    if number > MAX_BATCH_RECORDS:
        raise ConfigError(key, value, f"must be at most {MAX_BATCH_RECORDS:,}")
    return number


def _port(key: str, value: object) -> int:
    """A port number (0: any free port)."""
    try:
        number = int(str(value))
    except ValueError:
        raise ConfigError(key, value, "expected a port number (0: any free port)") from None
    if not 0 <= number <= 65535:
        raise ConfigError(key, value, "must be between 0 (any free port) and 65535")
    return number


def _property_name_limit(key: str, value: object) -> int:
    """A whole number, at least 32."""
    # The engine's own property names (ORIGIN_MESSAGE_ID, KAFKA_PARTITION...) must fit.
    number = _positive_int(key, value)
    if number < MIN_PROPERTY_NAME:
        raise ConfigError(key, value, f"must be at least {MIN_PROPERTY_NAME}")
    return number


def _duration(key: str, value: object) -> int:
    """A duration with its unit (`ms s m h d`), above 0."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ConfigError(key, value, "give a unit, e.g. '200ms' or '5s'")
    ms = parse_duration_ms(str(value), key)
    if ms <= 0:
        raise ConfigError(key, value, "must be greater than 0")
    return ms


def _duration_or_off(key: str, value: object) -> int:
    """A duration with its unit (`ms s m h d`), or `off` (or `0`)."""
    # "0", "off" or any zero duration ("0s") turns the feature off.
    text = str(value).strip().lower()
    if text in {"0", "off"} or (text[:1] == "0" and parse_duration_ms(text, key) == 0):
        return 0
    return _duration(key, value)


def _text(key: str, value: object) -> str:
    """Text, not empty."""
    text = str(value).strip()
    if not text:
        raise ConfigError(key, value, "must not be empty")
    return text


def _optional_text(key: str, value: object) -> str:
    """Text, or empty."""
    return str(value).strip()


def _levels(key: str, value: object) -> LevelTable:
    """Delays separated by spaces, level 1 first (units `ms s m h d`)."""
    return parse_levels(str(value), key)


def _lakehouse(key: str, value: object) -> str:
    """A local folder, a `file:///` URI or `s3a://bucket/prefix`.

    ``file:`` URIs with no host or ``localhost`` become their path; ``s3://`` is taken as
    ``s3a://``."""
    text = _text(key, value)
    scheme = _SCHEME.match(text)
    if scheme is None:
        return text
    rest = text[scheme.end() :]
    kind = scheme.group(1).lower()
    if kind == "file":
        if not rest.startswith("//"):
            return rest  # file:/lake
        host, slash, path = rest[2:].partition("/")
        if host in ("", "localhost") and slash:
            return "/" + path  # file:///lake, file://localhost/lake
    if kind in ("s3a", "s3") and rest.startswith("//"):
        bucket, _, prefix = rest[2:].partition("/")
        if _BUCKET.match(bucket) and ".." not in prefix:
            prefix = prefix.strip("/")
            return f"s3a://{bucket}/{prefix}" if prefix else f"s3a://{bucket}"
        raise ConfigError(key, value, "expected s3a://<bucket>/<prefix> with a valid bucket name")
    raise ConfigError(
        key,
        value,
        "must be a local folder, a file:/// URI or an S3 location (s3a://bucket/prefix): "
        "the engine commits with put-if-absent, which these stores give",
    )


def _endpoint(key: str, value: object) -> str:
    """`http(s)://host[:port]`, or empty (AWS's own, or ``AWS_ENDPOINT_URL``)."""
    text = str(value).strip().rstrip("/")
    if text and not re.match(r"^https?://[^/\s]+$", text):
        raise ConfigError(key, value, "expected http(s)://host[:port], or empty")
    return text


def _identifier(key: str, value: object) -> str:
    """A SQL identifier (letters, digits, `_`)."""
    text = str(value)
    if not _IDENT.match(text):
        raise ConfigError(key, value, "must be a SQL identifier: letters, digits, _")
    return text


def _bool(key: str, value: object) -> bool:
    """`true` or `false`."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(key, value, "expected true or false")


#: RocketMQ's maxReconsumeTimes default: a message failed this many times more goes to the
#: dead-letter table.
DEFAULT_MAX_RECONSUME_TIMES = 16
#: RocketMQ's retry delay: level 3 + reconsumeTimes of the engine's level table.
RETRY_FIRST_LEVEL = 3


@dataclass(frozen=True)
class GroupConfig:
    """How one consumer group retries failed messages.

    Attributes:
        max_reconsume_times: a message that already came back this many times goes to the
            group's dead-letter topic when it fails again (RocketMQ's maxReconsumeTimes).
        retry_delays: ``None`` for RocketMQ's schedule, delay level 3 + reconsumeTimes of
            the engine's level table (``10s 30s 1m ... 2h`` by default); otherwise the
            delay of the 1st, 2nd, ... retry in milliseconds, the last repeating.
        poll_timeout_ms: how long a poll with nothing new waits (RocketMQ holds 15 s).
    """

    max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES
    retry_delays: tuple[int, ...] | None = None
    poll_timeout_ms: int = 15_000

    def __post_init__(self) -> None:
        if self.max_reconsume_times < 0:
            raise ConfigError(
                "consumers.max_reconsume_times", self.max_reconsume_times, "must be >= 0"
            )
        if self.poll_timeout_ms < 0:
            raise ConfigError("consumers.poll_timeout", self.poll_timeout_ms, "must be >= 0")


def _retry_delays(key: str, value: object) -> tuple[int, ...] | None:
    """`levels`, or delays such as `1s 5s 30s`."""
    text = str(value).strip()
    if text.lower() in ("", "levels"):
        return None
    return parse_levels(text, key).delays_ms


def _timeout(key: str, value: object) -> int:
    """A duration with its unit (`ms s m h d`)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ConfigError(key, value, "give a unit, e.g. '15s'")
    return parse_duration_ms(str(value), key)


def _non_negative_int(key: str, value: object) -> int:
    """A whole number, 0 or more."""
    try:
        number = int(str(value))
    except ValueError:
        raise ConfigError(key, value, "expected a whole number") from None
    if number < 0:
        raise ConfigError(key, value, "must be 0 or more")
    return number


#: ``consumers.<setting>`` (every group) and ``consumers.groups.<group>.<setting>``.
GROUP_KEYS: dict[str, tuple[str, Callable[[str, object], Any]]] = {
    "max_reconsume_times": ("max_reconsume_times", _non_negative_int),
    "retry_delays": ("retry_delays", _retry_delays),
    "poll_timeout": ("poll_timeout_ms", _timeout),
}

#: Where delivery writes a topic's messages (``kafka.sinks.<topic>``).
SINKS = ("delta", "kafka", "both")

#: Where table names live: a Hive metastore kept in the lakehouse (``embedded``), whatever
#: catalog the user's Spark is configured with (``spark``), or each session's memory.
SQL_CATALOGS = ("embedded", "spark", "memory")


#: How a stage runs: a driver thread, or a Structured Streaming query (``delayq-stamp``,
#: ``delayq-deliver``).
STAGE_MODES = ("driver", "streaming")


def _choice(*allowed: str) -> Callable[[str, object], str]:
    def parse(key: str, value: object) -> str:
        text = str(value).strip().lower()
        if text not in allowed:
            raise ConfigError(key, value, f"expected one of {', '.join(allowed)}")
        return text

    parse.__doc__ = f"One of {', '.join(f'`{a}`' for a in allowed)}."
    return parse


#: Seconds per unit of a rate (``5000/s``, ``300/m``, ``20/h``).
_RATE_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_rate(key: str, value: object) -> float:
    """Messages per second from ``N/s``, ``N/m`` or ``N/h`` (a bare number is per second);
    ``off`` or ``0``: no cap (``0.0``).

    Example:
        >>> parse_rate("delivery.max_rate", "300/m"), parse_rate("delivery.max_rate", "off")
        (5.0, 0.0)
    """
    text = str(value).strip().lower().replace(" ", "").replace("_", "")
    if text in ("off", "0", "0/s", "0/m", "0/h"):
        return 0.0
    number, _, unit = text.partition("/")
    unit = unit or "s"
    try:
        count = float(number)
    except ValueError:
        raise ConfigError(key, value, "expected messages a second, e.g. 5000/s or 300/m") from None
    if unit not in _RATE_UNITS:
        raise ConfigError(key, value, "expected a unit of /s, /m or /h, e.g. 5000/s")
    if not count > 0 or count == float("inf"):
        raise ConfigError(key, value, "must be above 0 (or off)")
    return count / _RATE_UNITS[unit]


def _topic_map(key: str, value: object) -> Mapping[str, str]:
    """`kafka_topic=real_topic` pairs, separated by commas or spaces.

    ``"in_a=orders, in_b=audit"`` -> ``{"in_a": "orders", "in_b": "audit"}``."""
    pairs: dict[str, str] = {}
    for item in str(value).replace(",", " ").split():
        source, sep, target = item.partition("=")
        if not sep or not source or not _IDENT.match(target):
            raise ConfigError(key, value, f"bad entry {item!r}: expected kafka_topic=real_topic")
        pairs[source] = target
    return MappingProxyType(pairs)


def _topic_setting(key: str, value: object) -> str:
    """The topic of a ``topics.<name>.max_rate`` key (lower case), checked."""
    topic, dot, setting = key.removeprefix("topics.").rpartition(".")
    if not dot or setting != "max_rate":
        raise ConfigError(key, value, "unknown key; per topic there is topics.<name>.max_rate")
    try:
        check_topic(topic)
    except InvalidMessageError as err:
        raise ConfigError(key, value, f"not a topic that can be delivered to: {err}") from None
    return topic.lower()


def _names(key: str, value: object) -> tuple[str, ...]:
    """Names, separated by commas or spaces."""
    names = tuple(n for n in str(value).replace(",", " ").split() if n)
    if not names:
        raise ConfigError(key, value, "name at least one topic")
    return names


# key -> (attribute, parser). The defaults live on the dataclass fields below.
KEYS: dict[str, tuple[str, Callable[[str, object], Any]]] = {
    "lakehouse.path": ("lakehouse", _lakehouse),
    "storage.s3.endpoint": ("s3_endpoint", _endpoint),
    "storage.s3.region": ("s3_region", _optional_text),
    "storage.s3.access_key": ("s3_access_key", _optional_text),
    "storage.s3.secret_key": ("s3_secret_key", _optional_text),
    "storage.s3.path_style": ("s3_path_style", _bool),
    "lakehouse.database": ("database", _identifier),
    "levels.delays": ("levels", _levels),
    "messages.max_body_bytes": ("max_body_bytes", _positive_int),
    "messages.allow_empty_body": ("allow_empty_body", _bool),
    "messages.max_property_name_length": ("max_property_name", _property_name_limit),
    "messages.max_delay": ("max_delay_ms", _duration),
    "messages.dedup_window": ("dedup_window_ms", _duration_or_off),
    "stamp.interval": ("stamp_interval_ms", _duration),
    "stamp.idle_wait": ("stamp_idle_wait_ms", _duration_or_off),
    "stamp.max_files_per_batch": ("stamp_max_files", _positive_int),
    "stamp.max_rows_per_file": ("stamp_file_rows", _positive_int),
    "stamp.max_bytes_per_batch": ("stamp_max_bytes", _positive_int),
    "stamp.mode": ("stamp_mode", _choice(*STAGE_MODES)),
    "stamp.driver_batch_bytes": ("stamp_driver_bytes", _non_negative_int),
    "delivery.poll_interval": ("poll_interval_ms", _duration),
    "delivery.checkpoint_flush_interval": ("checkpoint_flush_ms", _duration),
    "delivery.progress_interval": ("progress_interval_ms", _duration),
    "delivery.topic_writers": ("topic_writers", _positive_int),
    "delivery.max_lead": ("max_lead_ms", _duration_or_off),
    "delivery.idle_interval": ("idle_interval_ms", _duration_or_off),
    "delivery.mode": ("delivery_mode", _choice(*STAGE_MODES)),
    "delivery.driver_round_rows": ("deliver_driver_rows", _non_negative_int),
    "delivery.max_rate": ("max_rate", parse_rate),
    "lease.timeout": ("lease_timeout_ms", _duration),
    "lease.standby": ("lease_standby", _bool),
    "spark.master": ("spark_master", _text),
    "spark.app_name": ("app_name", _text),
    "spark.jars_dir": ("jars_dir", _text),
    "spark.log_level": ("log_level", _text),
    "sql.register_tables": ("register_tables", _bool),
    "sql.catalog": ("sql_catalog", _choice(*SQL_CATALOGS)),
    "sql.server.enabled": ("sql_server_enabled", _bool),
    "sql.server.host": ("sql_server_host", _text),
    "sql.server.jdbc_port": ("sql_jdbc_port", _port),
    "sql.server.connect_port": ("sql_connect_port", _port),
    "kafka.bootstrap_servers": ("kafka_bootstrap", _text),
    "kafka.ingest_topics": ("kafka_ingest_topics", _names),
    "kafka.topic_map": ("kafka_topic_map", _topic_map),
    "kafka.starting_offsets": ("kafka_starting_offsets", _choice("earliest", "latest")),
    "kafka.max_offsets_per_trigger": ("kafka_max_offsets", _batch_records),
    "kafka.exactly_once": ("kafka_exactly_once", _bool),
    "control.enabled": ("control_enabled", _bool),
    "control.host": ("control_host", _text),
    "control.port": ("control_port", _port),
    "control.warm_up": ("control_warm_up", _bool),
    "metrics.enabled": ("metrics_enabled", _bool),
    "metrics.host": ("metrics_host", _text),
    "metrics.port": ("metrics_port", _port),
    "metrics.refresh_interval": ("metrics_refresh_ms", _duration),
    "maintenance.retention": ("maintenance_retention_ms", _duration),
    "maintenance.prune_after": ("prune_after_ms", _duration_or_off),
    "maintenance.interval": ("maintenance_interval_ms", _duration_or_off),
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know, validated.

    Attributes:
        lakehouse: root folder (or URI) of the lakehouse; relative paths resolve against
            the current directory; ``s3a://bucket/prefix`` puts it in an S3 bucket.
        s3_endpoint: the S3 service's URL (``storage.s3.endpoint``; empty: AWS's own, or
            ``AWS_ENDPOINT_URL``).
        s3_region: the bucket's region (empty: ``AWS_REGION``, else ``us-east-1``).
        s3_access_key: S3 access key id (empty: ``AWS_ACCESS_KEY_ID``, or the AWS
            credential chain).
        s3_secret_key: S3 secret key (empty: ``AWS_SECRET_ACCESS_KEY``).
        s3_path_style: buckets addressed in the URL path, as S3Proxy and most
            S3-compatible servers want (``storage.s3.path_style``).
        database: SQL database the topic tables are registered in.
        levels: the delay level table.
        max_body_bytes: largest accepted message body (RocketMQ's default is 4 MiB).
        allow_empty_body: accept messages whose body is empty (refused by default).
        max_property_name: longest user property name, in characters.
        max_delay_ms: longest delay a timer message may ask for (``messages.max_delay``).
        dedup_window_ms: a stamped ``msg_id`` stays taken this long after the later of its
            store and deliver times; a copy sent meanwhile is a duplicate
            (``messages.dedup_window``; 0 turns deduplication off). At least the longest
            level's delay.
        stamp_interval_ms: how often stamping looks for new ``commitlog`` versions.
        stamp_idle_wait_ms: with ``streaming``, once a look found nothing new, the next one
            waits up to this long for the next ``commitlog`` version (looking every 10 ms, or
            every ``stamp_interval_ms`` on an object store) before it tells Spark nothing
            came: an idle query runs a few triggers a second instead of one per
            ``stamp_interval_ms``, and a message sent meanwhile is stamped as soon as it is
            seen (``stamp.idle_wait``; 0 or ``off``: a trigger every ``stamp_interval_ms``).
        stamp_max_files: most ``commitlog`` data files per stamping batch.
        stamp_max_bytes: most ``commitlog`` bytes per stamping batch (a batch is held in
            the driver's memory while it is written).
        stamp_file_rows: about this many rows per ``schedule`` file; smaller files narrow the
            deliver-time range each covers, so rounds skip more of a large backlog.
        stamp_mode: ``streaming`` (the default: the Structured Streaming query
            ``delayq-stamp``; Spark's offsets log plans each batch, Spark tasks stamp and write
            a large one) or ``driver`` (a driver thread stamps, no Spark job). A lakehouse
            stamped by the query stays so.
        stamp_driver_bytes: with ``streaming``, a batch of at most this many ``commitlog``
            bytes is read, stamped and written on the driver instead of by Spark tasks
            (three Spark jobs less per batch); 0: every batch goes to Spark tasks.
        poll_interval_ms: how often the delivery stage looks for due messages.
        delivery_mode: ``streaming`` (the default: the Structured Streaming query
            ``delayq-deliver``; each trigger plans its watermark into Spark's offsets log, and
            its ``foreachBatch`` runs the round up to it) or ``driver`` (a driver thread runs
            the rounds).
        deliver_driver_rows: with ``streaming``, a round whose window's ``schedule`` files
            hold at most this many rows is read and written on the driver; a larger one by
            Spark tasks (the driver commits their files); 0: every round that reads a file
            goes to Spark tasks.
        max_rate: the most messages a second delivery shows in any one topic table
            (``delivery.max_rate``, e.g. ``5000/s``; 0: no cap). Rows due beyond it wait,
            in ``deliver_ts`` order, and are delivered at the cap (:mod:`engine.deliver.rates`).
        topic_rates: per topic table (lower case), its own cap (``topics.<name>.max_rate``;
            0: uncapped even when ``max_rate`` is set).
        checkpoint_flush_ms: longest time an idle delivery stage waits before
            recording progress (RocketMQ flushes delayOffset every 10 s; here a round
            that delivers anything always commits at once).
        progress_interval_ms: how often a running job prints its progress line.
        lease_timeout_ms: how long an engine's hold on the lakehouse lasts without a
            renewal (``lease.timeout``); it renews every third of it.
        lease_standby: a second engine waits for the lakehouse instead of refusing to
            start (``lease.standby``).
        topic_writers: topic tables a round writes at the same time (each is one Delta
            commit, mostly waiting on storage and the driver).
        max_lead_ms: how far ahead of the clock the running engine may plan a round
            (``delivery.max_lead``, and 3/4 of ``poll_interval_ms``; 0 or ``off``: never):
            its topic files are written before the watermark, its commits wait for it. A
            round planned at the time of the next row due (after a quiet spell) may be up to
            ``poll_interval_ms`` ahead (not with ``off``).
        idle_interval_ms: with ``streaming``, how long the delivery query may go without a
            batch while the ``schedule`` files' statistics show nothing can fall due and no
            new ``schedule`` or ``commands`` version exists (``delivery.idle_interval``; 0 or
            ``off``: a batch every ``poll_interval_ms``).
        spark_master: Spark master for sessions the engine builds itself.
        app_name: Spark application name.
        jars_dir: folder holding the JVM jars passed as ``spark.jars``.
        log_level: Spark log level for sessions the engine builds.
        register_tables: register topic tables by name in the session catalog.
        sql_catalog: where the names live: ``embedded`` (a Hive metastore in
            ``<lakehouse>/_metastore``, seen by later sessions and ``spark-sql``), ``spark``
            (the catalog the user's Spark is configured with) or ``memory`` (per session).
        sql_server_enabled: the engine serves JDBC (Spark's Thrift server) and Spark Connect.
        sql_server_host: the address both listen on.
        sql_jdbc_port: the Thrift server's port (``jdbc:hive2://host:port``).
        sql_connect_port: Spark Connect's port (``sc://host:port``).
        spark_conf: extra Spark settings (``[spark.conf]`` in the file), on top of
            :data:`LOCAL_SPARK_CONF`.
        consumers: retry settings of every consumer group (``[consumers]``).
        groups: settings of named groups (``[consumers.groups.<name>]``), on top of
            ``consumers``.
        kafka_bootstrap: Kafka brokers, for ingest and for delivery to Kafka.
        kafka_ingest_topics: Kafka topics the ingest job reads.
        kafka_topic_map: real topic of records without a ``REAL_TOPIC`` header, by Kafka
            topic.
        kafka_starting_offsets: where a new ingest job starts (``earliest`` or ``latest``).
        kafka_max_offsets: most records per ingest micro-batch.
        kafka_exactly_once: delivery to Kafka in one transaction per round and topic
            (``kafka.exactly_once``): once for ``read_committed`` readers.
        kafka_sinks: where delivery writes a topic (``delta``, ``kafka`` or ``both``), by
            topic table name; topics not listed go to Delta.
        control_enabled: a running engine answers ``delayq`` commands (see
            :mod:`engine.control.endpoint`).
        control_host: the address that endpoint listens on (loopback by default).
        control_port: its port (0: any free port, written where commands find it).
        control_warm_up: run the reading commands once when the engine starts, so that the
            first one a user types is as quick as the next (about 12 CPU-s at start here).
        metrics_enabled: a running engine serves Prometheus metrics (see
            :mod:`engine.run.metrics`).
        metrics_host: the address they are served on (loopback by default).
        metrics_port: their port (0: any free port, printed at start).
        metrics_refresh_ms: how often the figures that need a query (consumer lag, next
            due time) are refreshed.
        maintenance_retention_ms: ``delayq maintain`` deletes data files no table version
            within this long needs (at least an hour).
        prune_after_ms: ``delayq maintain`` deletes ``schedule`` rows delivered or cancelled
            this long before the delivery watermark (0: never; at least the dedup window).
        maintenance_interval_ms: a running engine does ``delayq maintain``'s work this often
            (0: never, the default; at least 10 minutes).
    """

    lakehouse: str = "lakehouse"
    s3_endpoint: str = ""
    s3_region: str = ""
    s3_access_key: str = ""
    s3_secret_key: str = field(default="", repr=False)
    s3_path_style: bool = True
    database: str = "delayq"
    levels: LevelTable = field(default_factory=lambda: parse_levels(DEFAULT_LEVELS))
    max_body_bytes: int = 4 * 1024 * 1024
    allow_empty_body: bool = False
    max_property_name: int = 128
    max_delay_ms: int = 30 * 86_400_000
    dedup_window_ms: int = 2 * 3_600_000
    stamp_interval_ms: int = 50
    stamp_idle_wait_ms: int = 500
    stamp_max_files: int = 1000
    stamp_file_rows: int = 100_000
    stamp_max_bytes: int = 16 * 1024 * 1024
    stamp_mode: str = "streaming"
    stamp_driver_bytes: int = 4 * 1024 * 1024
    poll_interval_ms: int = 200
    checkpoint_flush_ms: int = 10_000
    progress_interval_ms: int = 5_000
    topic_writers: int = 4
    max_lead_ms: int = 500
    idle_interval_ms: int = 1000
    delivery_mode: str = "streaming"
    deliver_driver_rows: int = 200_000
    max_rate: float = 0.0
    topic_rates: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    lease_timeout_ms: int = 15_000
    lease_standby: bool = False
    spark_master: str = "local[2]"
    app_name: str = "delayq"
    jars_dir: str = ".jars"
    log_level: str = "WARN"
    register_tables: bool = True
    sql_catalog: str = "embedded"
    sql_server_enabled: bool = False
    sql_server_host: str = "127.0.0.1"
    sql_jdbc_port: int = 10000
    sql_connect_port: int = 15002
    spark_conf: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType(dict(LOCAL_SPARK_CONF))
    )
    consumers: GroupConfig = field(default_factory=GroupConfig)
    groups: Mapping[str, GroupConfig] = field(default_factory=lambda: MappingProxyType({}))
    kafka_bootstrap: str = "127.0.0.1:9092"
    kafka_ingest_topics: tuple[str, ...] = ("delayq_in",)
    kafka_topic_map: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    kafka_starting_offsets: str = "earliest"
    kafka_max_offsets: int = 100_000
    kafka_sinks: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    kafka_exactly_once: bool = False
    control_enabled: bool = True
    control_host: str = "127.0.0.1"
    control_port: int = 0
    control_warm_up: bool = True
    metrics_enabled: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    metrics_refresh_ms: int = 15_000
    maintenance_retention_ms: int = 7 * 86_400_000
    prune_after_ms: int = 7 * 86_400_000
    maintenance_interval_ms: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lakehouse", _lakehouse("lakehouse.path", self.lakehouse))
        object.__setattr__(self, "s3_endpoint", _endpoint("storage.s3.endpoint", self.s3_endpoint))
        if self.on_object_store and self.sql_catalog == "embedded":
            raise ConfigError(
                "sql.catalog",
                self.sql_catalog,
                f"the embedded metastore (Derby) needs a local lakehouse, not "
                f"{self.lakehouse}: set sql.catalog=memory (names per session) or "
                "sql.catalog=spark (your Spark's own, shared metastore)",
            )
        if not isinstance(self.spark_conf, MappingProxyType):
            object.__setattr__(self, "spark_conf", MappingProxyType(dict(self.spark_conf)))
        for name in ("groups", "kafka_topic_map", "kafka_sinks", "topic_rates"):
            if not isinstance(getattr(self, name), MappingProxyType):
                object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        if self.log_level.upper() not in {"ALL", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF"}:
            raise ConfigError("spark.log_level", self.log_level, "expected e.g. WARN or INFO")
        if self.maintenance_retention_ms < 3_600_000:
            raise ConfigError(
                "maintenance.retention",
                f"{self.maintenance_retention_ms}ms",
                "must be at least 1h: a replayed round reads the version it planned from",
            )
        if self.lease_timeout_ms < 1_000:
            raise ConfigError(
                "lease.timeout",
                f"{self.lease_timeout_ms}ms",
                "must be at least 1s: the engine renews its lease every third of it",
            )
        if 0 < self.maintenance_interval_ms < 600_000:
            raise ConfigError(
                "maintenance.interval",
                f"{self.maintenance_interval_ms}ms",
                "must be 0 (off) or at least 10m: each run compacts every table",
            )
        if 0 < self.prune_after_ms < self.dedup_window_ms:
            raise ConfigError(
                "maintenance.prune_after",
                f"{self.prune_after_ms}ms",
                f"must be 0 (off) or at least messages.dedup_window ({self.dedup_window_ms}ms): "
                "a restart rebuilds the deduplication index from schedule",
            )
        longest = max(self.levels.delays_ms)
        if 0 < self.dedup_window_ms < longest:
            raise ConfigError(
                "messages.dedup_window",
                f"{self.dedup_window_ms}ms",
                f"must be 0 (off) or at least the longest level's delay ({longest}ms)",
            )
        if self.sql_jdbc_port and self.sql_jdbc_port == self.sql_connect_port:
            raise ConfigError(
                "sql.server.connect_port",
                self.sql_connect_port,
                "must differ from sql.server.jdbc_port",
            )
        self._check_kafka()

    def _check_kafka(self) -> None:
        """``kafka.sinks`` and ``kafka.topic_map`` name topics that can be delivered to.

        Raises:
            ConfigError: naming the key and the entry.
        """
        for topic, sink in self.kafka_sinks.items():
            key = f"kafka.sinks.{topic}"
            try:
                check_topic(topic)
            except InvalidMessageError as err:
                raise ConfigError(
                    key, sink, f"not a topic that can be delivered to: {err}"
                ) from None
            if sink not in SINKS:
                raise ConfigError(key, sink, f"expected one of {', '.join(SINKS)}")
            if sink != "delta" and topic in self.kafka_ingest_topics:
                raise ConfigError(key, sink, "is also an ingest topic: deliveries would loop back")
        for source, target in self.kafka_topic_map.items():
            entry = f"{source}={target}"
            try:
                check_topic(target)
            except InvalidMessageError as err:
                raise ConfigError("kafka.topic_map", entry, str(err)) from None
            if source not in self.kafka_ingest_topics:
                read = ", ".join(self.kafka_ingest_topics)
                raise ConfigError(
                    "kafka.topic_map", entry, f"{source} is not read (kafka.ingest_topics: {read})"
                )

    @classmethod
    def from_mapping(cls, settings: Mapping[str, object]) -> EngineConfig:
        """Build a config from flat dotted keys; unknown keys fail.

        Keys under ``spark.conf.`` are passed to Spark as they are.
        """
        values: dict[str, Any] = {}
        spark_conf: dict[str, str] = dict(LOCAL_SPARK_CONF)
        defaults: dict[str, Any] = {}
        groups: dict[str, dict[str, Any]] = {}
        sinks: dict[str, str] = {}
        rates: dict[str, float] = {}
        for key, value in settings.items():
            if key.startswith("spark.conf."):
                spark_conf[key.removeprefix("spark.conf.")] = str(value)
                continue
            if key.startswith("consumers."):
                _group_setting(key, value, defaults, groups)
                continue
            if key.startswith("kafka.sinks."):
                topic = _identifier(key, key.removeprefix("kafka.sinks.")).lower()
                sinks[topic] = _choice(*SINKS)(key, value)
                continue
            if key.startswith("topics."):
                topic = _topic_setting(key, value)
                rates[topic] = parse_rate(key, value)
                continue
            if key not in KEYS:
                known = ", ".join(sorted([*KEYS, *(f"consumers.{k}" for k in GROUP_KEYS)]))
                raise ConfigError(key, value, f"unknown key; known keys: {known}")
            attr, parse = KEYS[key]
            values[attr] = parse(key, value)
        consumers = GroupConfig(**defaults)
        return cls(
            **values,
            spark_conf=spark_conf,
            consumers=consumers,
            groups={g: replace(consumers, **changes) for g, changes in groups.items()},
            kafka_sinks=sinks,
            topic_rates=rates,
        )

    def sink(self, topic: str) -> str:
        """Where delivery writes topic table ``topic``: ``delta``, ``kafka`` or ``both``."""
        return self.kafka_sinks.get(topic.lower(), "delta")

    def rates(self) -> dict[str, float]:
        """The delivery rate caps in messages per second: ``*`` (every topic, from
        ``delivery.max_rate``) and each topic named under ``topics.`` (lower case; ``0``:
        uncapped); empty when nothing is capped.

        Example:
            >>> EngineConfig(max_rate=50.0, topic_rates={"audit": 0.0}).rates()
            {'*': 50.0, 'audit': 0.0}
        """
        caps = {"*": self.max_rate} if self.max_rate else {}
        caps.update(self.topic_rates)
        return caps if any(caps.values()) else {}

    def group(self, name: str) -> GroupConfig:
        """The settings of consumer group ``name``."""
        return self.groups.get(name.lower(), self.consumers)

    def with_overrides(self, **changes: Any) -> EngineConfig:
        """A copy with some attributes replaced (by attribute name)."""
        current = {f.name: getattr(self, f.name) for f in fields(self)}
        current.update(changes)
        return EngineConfig(**current)

    @property
    def on_object_store(self) -> bool:
        """Whether the lakehouse is in an object store (S3) rather than a local folder.

        Example:
            >>> EngineConfig(lakehouse="s3a://delayq/lh", sql_catalog="memory").on_object_store
            True
        """
        return self.lakehouse.startswith("s3a://")

    @property
    def lakehouse_path(self) -> str:
        """The lakehouse root: an absolute local path, or the object store URI.

        Example:
            >>> EngineConfig(lakehouse="s3a://delayq/lh/", sql_catalog="memory").lakehouse_path
            's3a://delayq/lh'
        """
        if self.on_object_store:
            return self.lakehouse
        return str(Path(self.lakehouse).expanduser().resolve())


def _group_setting(
    key: str, value: object, defaults: dict[str, Any], groups: dict[str, dict[str, Any]]
) -> None:
    parts = key.split(".")
    if len(parts) == 2 and parts[1] in GROUP_KEYS:
        attr, parse = GROUP_KEYS[parts[1]]
        defaults[attr] = parse(key, value)
        return
    if len(parts) == 4 and parts[1] == "groups" and parts[3] in GROUP_KEYS:
        attr, parse = GROUP_KEYS[parts[3]]
        # group names ignore case (engine.core.topics.check_group)
        groups.setdefault(_identifier(key, parts[2]).lower(), {})[attr] = parse(key, value)
        return
    known = ", ".join(f"consumers[.groups.<group>].{k}" for k in GROUP_KEYS)
    raise ConfigError(key, value, f"unknown key; known consumer keys: {known}")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def parse_override(text: str) -> tuple[str, str]:
    """Split a ``key=value`` override; fails naming the text when there is no ``=``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(text, text, "an override must look like key=value")
    return key.strip(), value.strip()


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> EngineConfig:
    """Load the configuration file and apply overrides.

    Args:
        path: a TOML file; defaults to ``$DELAYQ_CONF`` or ``conf/engine.toml``.
        overrides: dotted keys that win over the file.

    Raises:
        ConfigError: when the file is missing or unreadable, or a key or value is bad.
    """
    chosen = Path(path or os.environ.get("DELAYQ_CONF") or DEFAULT_CONF)
    try:
        tree = tomllib.loads(chosen.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("conf", str(chosen), "file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("conf", str(chosen), f"not valid TOML: {err}") from None
    settings = flatten(tree)
    settings.update(overrides or {})
    return EngineConfig.from_mapping(settings)
