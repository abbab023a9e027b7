"""Delayed delivery on Spark Structured Streaming and Delta Lake.

The public API in one place::

    from engine import Engine, Message, build_spark, load_config, send, send_many

    cfg = load_config()                      # conf/engine.toml
    spark = build_spark(cfg)                 # local Spark + Delta, tables registered in SQL
    send(spark, cfg, "orders", "paid", delay_level=3)
    Engine(spark, cfg).run(until_idle=True)
    spark.sql("SELECT * FROM delayq.orders").show()
"""

from __future__ import annotations

from engine.clock import Clock, FakeClock, SystemClock
from engine.config import EngineConfig, load_config
from engine.errors import (
    CheckpointError,
    ConfigError,
    DelayQError,
    InvalidMessageError,
    RetryableError,
)
from engine.levels import LevelTable, parse_levels
from engine.producer import Message, send, send_df, send_many
from engine.runner import Engine, Status, read_status
from engine.session import build_spark
from engine.tables import register_topic_tables as refresh_tables

__all__ = [
    "CheckpointError",
    "Clock",
    "ConfigError",
    "DelayQError",
    "Engine",
    "EngineConfig",
    "FakeClock",
    "InvalidMessageError",
    "LevelTable",
    "Message",
    "RetryableError",
    "Status",
    "SystemClock",
    "build_spark",
    "load_config",
    "parse_levels",
    "read_status",
    "refresh_tables",
    "send",
    "send_df",
    "send_many",
]
