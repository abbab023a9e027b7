"""Delayed delivery on Spark Structured Streaming and Delta Lake.

The flow is in the folders: ``core`` (shared) and ``lakehouse`` (tables, catalog, session)
under the stages ``produce`` -> ``stamp`` -> ``deliver`` -> ``consume``, with ``control``
(cancel, inspect, status) and ``run`` (the engine) on top. The public API in one place::

    from engine import Engine, Message, build_spark, load_config, send, send_many

    cfg = load_config()                      # conf/engine.toml
    spark = build_spark(cfg)                 # local Spark + Delta, tables registered in SQL
    send(spark, cfg, "orders", "paid", delay_level=3)
    Engine(spark, cfg).run(until_idle=True)
    spark.sql("SELECT * FROM delayq.orders").show()
"""

from __future__ import annotations

from engine.consume.consumer import Consumer, Received
from engine.consume.lag import lag
from engine.consume.stream import consume_stream
from engine.control.commands import cancel, reschedule
from engine.control.inspect import forecast, history, pending
from engine.control.status import Status, read_status
from engine.core.clock import Clock, FakeClock, SystemClock
from engine.core.config import EngineConfig, load_config
from engine.core.errors import (
    CheckpointError,
    ConfigError,
    ConsumerError,
    DelayQError,
    InvalidMessageError,
    RetryableError,
)
from engine.core.levels import LevelTable, parse_levels
from engine.core.message import Message
from engine.lakehouse.catalog import register_all as refresh_tables
from engine.lakehouse.session import build_spark
from engine.produce.send import send, send_arrow, send_df, send_many
from engine.run.engine import Engine

__all__ = [
    "CheckpointError",
    "Clock",
    "ConfigError",
    "Consumer",
    "ConsumerError",
    "DelayQError",
    "Engine",
    "EngineConfig",
    "FakeClock",
    "InvalidMessageError",
    "LevelTable",
    "Message",
    "Received",
    "RetryableError",
    "Status",
    "SystemClock",
    "build_spark",
    "cancel",
    "consume_stream",
    "forecast",
    "history",
    "lag",
    "load_config",
    "parse_levels",
    "pending",
    "read_status",
    "refresh_tables",
    "reschedule",
    "send",
    "send_arrow",
    "send_df",
    "send_many",
]
