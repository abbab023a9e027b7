"""One exception hierarchy for the engine.

Every error the engine raises on purpose derives from :class:`DelayQError`. Callers that
want to retry catch :class:`RetryableError`; everything else is terminal and needs a fix
in input, configuration or environment.
"""

from __future__ import annotations


def one_line(err: BaseException) -> str:
    """An exception as one line for a log or a status: its class and its message's first line,
    at most 300 characters.

    Example:
        >>> one_line(OSError("disk full\\nmore"))
        'OSError: disk full'
    """
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


class DelayQError(Exception):
    """Root of every error raised by the engine."""


class ConfigError(DelayQError):
    """Raised when configuration is invalid; the message names the key and the value."""

    def __init__(self, key: str, value: object, problem: str) -> None:
        self.key = key
        self.value = value
        super().__init__(f"invalid configuration {key}={value!r}: {problem}")


class InvalidMessageError(DelayQError):
    """Raised at send time when a message cannot be accepted; names the field and value."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        self.field = field
        self.value = value
        shown = value if not isinstance(value, bytes | str) or len(value) <= 60 else value[:60]
        super().__init__(f"invalid message {field}={shown!r}: {problem}")


class ScheduleError(DelayQError):
    """Raised when a recurring schedule is refused; the message names the field and value."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"invalid schedule {field}={value!r}: {problem}")


class SetupError(DelayQError):
    """Raised when the runtime is not set up (Java, jars); says what to install or run."""


class RetryableError(DelayQError):
    """Raised for a transient failure (a storage conflict, a lost executor): retry the step.

    The delivery stage retries these, and any Spark or storage error, after a back-off;
    other :class:`DelayQError` subclasses are terminal and stop the engine.
    """


class DeliveryError(DelayQError):
    """Raised when delivery rounds keep failing (not a transient fault): the engine stops."""


class StampError(DelayQError):
    """Raised when stamping batches keep failing (not a transient fault): the engine stops."""


class CheckpointError(DelayQError):
    """Raised when the delayOffset checkpoint is inconsistent with the tables it guards."""


class ConsumerError(DelayQError):
    """Raised when a consumer call is wrong: an unknown group or topic, an ack for a
    message not in the current batch, a negative timeout, a poll before the last batch
    was committed."""


class ConsumerConflictError(RetryableError):
    """Raised when another consumer of the same group committed first: this consumer's
    batch was not committed, and its messages come again on the next poll."""


class LakehouseHeldError(DelayQError):
    """Raised at start when another engine holds the lakehouse's lease; names it (host,
    pid, since when)."""


class FencedError(DelayQError):
    """Raised when another engine has taken the lakehouse over: this engine's lease epoch
    is no longer the newest, so it must not plan or commit another round."""


class IngestError(DelayQError):
    """Raised when the Kafka ingest cannot go on without losing records: records it has
    not stored yet are gone from Kafka (retention), or the position it recorded is past the
    end of a partition (the topic was made again)."""
