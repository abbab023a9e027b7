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

from importlib import import_module
from typing import TYPE_CHECKING, Any

#: Where each public name lives. Imported on first use: ``delayq status`` must not pay for
#: Spark, Arrow and delta-rs before it knows it needs them (a running engine answers it).
_WHERE = {
    "Consumer": "engine.consume.consumer",
    "Received": "engine.consume.consumer",
    "lag": "engine.consume.lag",
    "consume_stream": "engine.consume.stream",
    "SimpleConsumer": "engine.control.simple_consumer",
    "cancel": "engine.control.commands",
    "reschedule": "engine.control.commands",
    "forecast": "engine.control.inspect",
    "history": "engine.control.inspect",
    "pending": "engine.control.inspect",
    "Status": "engine.control.status",
    "read_status": "engine.control.status",
    "Clock": "engine.core.clock",
    "FakeClock": "engine.core.clock",
    "SystemClock": "engine.core.clock",
    "EngineConfig": "engine.core.config",
    "load_config": "engine.core.config",
    "CheckpointError": "engine.core.errors",
    "ConfigError": "engine.core.errors",
    "ConsumerError": "engine.core.errors",
    "DelayQError": "engine.core.errors",
    "InvalidMessageError": "engine.core.errors",
    "RetryableError": "engine.core.errors",
    "LevelTable": "engine.core.levels",
    "parse_levels": "engine.core.levels",
    "Message": "engine.core.message",
    "build_spark": "engine.lakehouse.catalog.session",
    "send": "engine.produce.send",
    "send_arrow": "engine.produce.send",
    "send_df": "engine.produce.send",
    "send_many": "engine.produce.send",
    "Engine": "engine.run.engine",
    "create_schedule": "engine.recur.defs",
    "create_schedules": "engine.recur.defs",
    "delete_schedule": "engine.recur.defs",
    "list_schedules": "engine.recur.defs",
    "pause_schedule": "engine.recur.defs",
    "resume_schedule": "engine.recur.defs",
    "update_schedule": "engine.recur.defs",
    "ScheduleError": "engine.core.errors",
}
_RENAMED = {"refresh_tables": ("engine.lakehouse.catalog.names", "register_all")}

if TYPE_CHECKING:
    from engine.consume.consumer import Consumer, Received
    from engine.consume.lag import lag
    from engine.consume.stream import consume_stream
    from engine.control.commands import cancel, reschedule
    from engine.control.inspect import forecast, history, pending
    from engine.control.simple_consumer import SimpleConsumer
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
        ScheduleError,
    )
    from engine.core.levels import LevelTable, parse_levels
    from engine.core.message import Message
    from engine.lakehouse.catalog.names import register_all as refresh_tables
    from engine.lakehouse.catalog.session import build_spark
    from engine.produce.send import send, send_arrow, send_df, send_many
    from engine.recur.defs import (
        create_schedule,
        create_schedules,
        delete_schedule,
        list_schedules,
        pause_schedule,
        resume_schedule,
        update_schedule,
    )
    from engine.run.engine import Engine


def __dir__() -> list[str]:
    """The public names too, before their first use."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (PEP 562)."""
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name]), name)
    elif name in _RENAMED:
        module, attribute = _RENAMED[name]
        value = getattr(import_module(module), attribute)
    else:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    globals()[name] = value
    return value


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
    "ScheduleError",
    "SimpleConsumer",
    "Status",
    "SystemClock",
    "build_spark",
    "cancel",
    "consume_stream",
    "create_schedule",
    "create_schedules",
    "delete_schedule",
    "forecast",
    "history",
    "lag",
    "list_schedules",
    "load_config",
    "parse_levels",
    "pause_schedule",
    "pending",
    "read_status",
    "refresh_tables",
    "reschedule",
    "resume_schedule",
    "send",
    "send_arrow",
    "send_df",
    "send_many",
    "update_schedule",
]
