"""Table schemas, defined once and used by writers, readers and tests alike."""

from schemas.tables import (
    COMMITLOG,
    DELAY_OFFSET,
    QUARANTINE,
    SCHEDULE,
    TOPIC,
    column_names,
)

__all__ = ["COMMITLOG", "DELAY_OFFSET", "QUARANTINE", "SCHEDULE", "TOPIC", "column_names"]
