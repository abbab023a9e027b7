"""Which stage failures are retried (they can pass) and which stop the engine as bugs."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake.exceptions import CommitFailedError, DeltaProtocolError
from kafka.errors import KafkaTimeoutError
from py4j.protocol import Py4JNetworkError
from pyspark.errors import AnalysisException, PythonException, SparkRuntimeException

from engine.core.errors import ConfigError, RetryableError, SetupError
from engine.run.failures import is_transient, retry_or_stop, setup_mistake


@pytest.mark.parametrize(
    "err",
    [
        RetryableError("a listing missed a commit"),
        TimeoutError("read timed out"),
        ConnectionResetError("reset by peer"),
        FileNotFoundError("a file vacuumed under the reader"),
        CommitFailedError("another writer won"),
        SparkRuntimeException("a task failed"),
        Py4JNetworkError("the gateway went away"),
        KafkaTimeoutError("no broker"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_failures_that_can_pass_are_retried(err: BaseException) -> None:
    assert is_transient(err)


@pytest.mark.parametrize(
    "err",
    [
        TypeError("unsupported operand"),
        KeyError("round"),
        AttributeError("no attribute 'rows'"),
        AssertionError("a broken invariant"),
        pa.ArrowInvalid("a column of the wrong type"),
        AnalysisException("cannot resolve column"),
        PythonException("a UDF raised"),
        DeltaProtocolError("a reader feature"),
        ConfigError("delivery.poll_interval", "x", "not a duration"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_bugs_and_mistakes_are_not(err: BaseException) -> None:
    assert not is_transient(err)


def test_an_executor_that_cannot_start_python_is_a_set_up_mistake_named_at_once() -> None:
    """Spark's task failure when an executor's ``PYSPARK_PYTHON`` does not exist: retried, it
    failed the same way every 12 s for minutes; it stops at once, naming the program."""
    spark_text = (
        "Job aborted due to stage failure: Task 0 in stage 3.0 failed 1 times, most recent "
        "failure: Lost task 0.0 in stage 3.0 (TID 3) (192.0.2.2 executor driver): "
        'java.io.IOException: Cannot run program ".venv/bin/python": error=2, No such file '
        "or directory\n\tat java.base/java.lang.ProcessBuilder.start(ProcessBuilder.java:1143)"
    )
    err = SparkRuntimeException(spark_text)
    assert is_transient(err)  # (as a Spark failure it would be retried)
    assert setup_mistake(RuntimeError("the batch failed")) is None
    try:
        raise RuntimeError("the stamping batch failed") from err
    except RuntimeError as outer:
        mistake = setup_mistake(outer)  # (found down the chain)
    assert isinstance(mistake, SetupError)
    assert str(mistake).startswith(
        "Spark could not start '.venv/bin/python' for a task (error=2, No such file or "
        "directory): PYSPARK_PYTHON"
    )
    with pytest.raises(SetupError) as raised:
        retry_or_stop(err)
    assert raised.value.__cause__ is err
    retry_or_stop(TimeoutError("read timed out"))  # (tried again)
    no_memory = SparkRuntimeException(
        spark_text.replace("error=2, No such file or directory", "error=12, Cannot allocate memory")
    )
    assert setup_mistake(no_memory) is None  # (a fork that failed for want of memory can pass)
    retry_or_stop(no_memory)
