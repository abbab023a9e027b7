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

import re
import sys

from engine.core.errors import DelayQError, RetryableError, SetupError

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


#: A process Spark could not start (an executor's Python worker): ``(program, reason)``.
#: Only a missing program or one not allowed to run (``error=2``, ``error=13``): a failed
#: fork for want of memory or processes (``error=12``, ``error=11``) can pass.
_CANNOT_RUN = re.compile(r'Cannot run program "([^"]*)"(?:[^:\n]*): (error=(?:2|13),[^\n]*)')


def setup_mistake(err: BaseException) -> SetupError | None:
    """The set-up mistake a failure shows, as a one-line error to stop at (``None``: none
    known). Spark reports an executor that cannot start Python as a failed task, which
    would be retried like a lost executor, every 12 s for as long as the retries last; it
    fails the same way until the setting is fixed.

    Example:
        >>> err = RuntimeError('IOException: Cannot run program ".venv/bin/python": '
        ...                    'error=2, No such file or directory')
        >>> print(setup_mistake(err))  # doctest: +ELLIPSIS
        Spark could not start '.venv/bin/python' for a task (error=2, No such file or ...
    """
    seen: BaseException | None = err
    walked: set[int] = set()
    while seen is not None and id(seen) not in walked:
        walked.add(id(seen))
        try:
            text = str(seen)  # (a Py4J error asks the JVM, which may be gone)
        except Exception:
            text = ""
        found = _CANNOT_RUN.search(text)
        if found:
            mistake = SetupError(
                f"Spark could not start {found[1]!r} for a task ({found[2].strip()}): "
                "PYSPARK_PYTHON (or spark.pyspark.python) must name a Python that exists on "
                f"every worker, by an absolute path (this driver's: {sys.executable})"
            )
            return mistake
        seen = seen.__cause__ or seen.__context__
    return None


def retry_or_stop(err: BaseException) -> None:
    """Return when a stage that failed with ``err`` should try again (it can pass); else
    raise what it stops with: a set-up mistake as :class:`~engine.core.errors.SetupError`
    (:func:`setup_mistake`), or ``err`` itself (a mistake to fix, or a bug).

    Example:
        >>> retry_or_stop(TimeoutError("read timed out"))
        >>> retry_or_stop(KeyError("round"))
        Traceback (most recent call last):
        ...
        KeyError: 'round'
    """
    mistake = setup_mistake(err)
    if mistake is not None:
        raise mistake from err
    if not is_transient(err):
        raise err


__all__ = ["BUGS", "TRANSIENT", "is_transient", "retry_or_stop", "setup_mistake"]
