"""Table schemas, defined once and used by writers, readers and tests alike."""

from schemas.tables import (
    COMMAND_RESULTS,
    COMMANDS,
    COMMITLOG,
    CONSUMER_LOG,
    DELAY_OFFSET,
    QUARANTINE,
    RATES_STATE,
    RECURRING,
    SCHEDULE,
    SCHEDULE_REQUESTS,
    TOPIC,
    column_names,
)

__all__ = [
    "COMMANDS",
    "COMMAND_RESULTS",
    "COMMITLOG",
    "CONSUMER_LOG",
    "DELAY_OFFSET",
    "QUARANTINE",
    "RATES_STATE",
    "RECURRING",
    "SCHEDULE",
    "SCHEDULE_REQUESTS",
    "TOPIC",
    "column_names",
]
