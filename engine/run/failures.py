"""Which failures of a stage pass on their own (retry the batch or round) and which are bugs.

A stamping batch or a delivery round that fails is run again from its plan, which is safe for
any failure; but only a failure that can pass deserves the retries. A bug (a ``TypeError``
in delayq's code, a query Spark cannot analyse) fails the same way every time: retried 30
times, 10 s apart, it kept the engine up for five minutes doing nothing and then exited as
a delivery failure. It now stops the engine at once, reported as a bug (exit 70, naming the
log file that holds its traceback).

Transient: :class:`~engine.core.errors.RetryableError`; ``OSError`` (disks, networks,
timeouts, Arrow's I/O); Delta's conflicts (Spark's ``Concurrent...Exception`` family,
delta-rs's failed commits) and delta-rs's storage errors; Spark's failures from the JVM (a
lost executor, a failed task, the gateway); object-store and Kafka client errors. Everything
else is a bug: Python's own errors, Spark's ``AnalysisException`` and ``ParseException``,
the JVM's argument and arithmetic errors, an exception raised in a Python UDF, and delta-rs's
protocol and schema errors. Another :class:`~engine.core.errors.DelayQError` is neither: it
is a mistake to fix, reported as such (exit 2).

Example:
    >>> is_transient(TimeoutError("read timed out")), is_transient(KeyError("round"))
    (True, False)
"""

from __future__ import annotations

from engine.core.errors import DelayQError, RetryableError

#: Classes (by name, to spare importing their libraries) whose failures can pass.
TRANSIENT = frozenset(
    {
        "OSError",
        # Delta on Spark: another writer's commit won (delta.exceptions)
        "DeltaConcurrentModificationException",
        "ConcurrentAppendException",
        "ConcurrentDeleteReadException",
        "ConcurrentDeleteDeleteException",
        "ConcurrentTransactionException",
        "ConcurrentWriteException",
        "MetadataChangedException",
        "ProtocolChangedException",
        # delta-rs: a commit lost, or its storage failed (its protocol errors are below)
        "DeltaError",
        # Spark: failures in the JVM, tasks, executors, the gateway
        "CapturedException",
        "SparkRuntimeException",
        "QueryExecutionException",
        "StreamingQueryException",
        "UnknownException",
        "PySparkRuntimeError",
        "Py4JError",
        # object stores and Kafka
        "BaseError",
        "KafkaError",
    }
)
#: Classes that are bugs although a class further up their line is in :data:`TRANSIENT`.
BUGS = frozenset(
    {
        "AnalysisException",
        "ParseException",
        "IllegalArgumentException",
        "NumberFormatException",
        "ArithmeticException",
        "ArrayIndexOutOfBoundsException",
        "DateTimeException",
        "UnsupportedOperationException",
        "SparkNoSuchElementException",
        "PythonException",
        "DeltaProtocolError",
        "SchemaMismatchError",
        "UnknownConfigurationKeyError",
    }
)


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` can pass on its own, so that the stage should try again (see the
    module's description). The most specific class that is named decides.

    Example:
        >>> is_transient(RetryableError("a listing missed a commit"))
        True
        >>> is_transient(DelayQError("a mistake to fix")), is_transient(ValueError("bug"))
        (False, False)
    """
    if isinstance(err, DelayQError):
        return isinstance(err, RetryableError)
    for kind in type(err).__mro__:
        if kind.__name__ in BUGS:
            return False
        if kind.__name__ in TRANSIENT:
            return True
    return False


__all__ = ["BUGS", "TRANSIENT", "is_transient"]
