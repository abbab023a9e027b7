"""Which stage failures are retried (they can pass) and which stop the engine as bugs."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake.exceptions import CommitFailedError, DeltaProtocolError
from kafka.errors import KafkaTimeoutError
from py4j.protocol import Py4JNetworkError
from pyspark.errors import AnalysisException, PythonException, SparkRuntimeException

from engine.core.errors import ConfigError, RetryableError
from engine.run.failures import is_transient


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
