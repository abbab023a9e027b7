"""The two forms of the message rules agree: Spark's column (DataFrame sends) and Arrow's
(stamping on the driver), reason for reason on the same rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from engine.core.arrow_checks import rejection_reasons
from engine.core.config import EngineConfig
from engine.core.message import rejection_reason
from engine.stamp.transform import id_hashes
from schemas import COMMITLOG

pytestmark = pytest.mark.integration
T0 = datetime(2026, 1, 1, 12, tzinfo=UTC)
CFG = EngineConfig(max_body_bytes=8, max_delay_ms=60_000)

# (msg_id, topic, properties, body, store_ts, deliver_at): one row per rule, and valid ones.
ROWS = [
    ("ok", "orders", {"region": "eu"}, b"a", T0, None),
    ("timer", "orders", {"DELAYQ_WINDOW_MS": "86400000"}, b"a", T0, T0 + timedelta(seconds=59)),
    (None, "orders", {}, b"a", T0, None),
    ("a b", "orders", {}, b"a", T0, None),
    ("x" * 129, "orders", {}, b"a", T0, None),
    ("line\n", "orders", {}, b"a", T0, None),
    ("t1", None, {}, b"a", T0, None),
    ("t2", "", {}, b"a", T0, None),
    ("t3", "9lives", {}, b"a", T0, None),
    ("t4", "Schedule", {}, b"a", T0, None),
    ("t5", "orders\n", {}, b"a", T0, None),
    ("b1", "orders", {}, None, T0, None),
    ("b2", "orders", {}, b"", T0, None),
    ("b3", "orders", {}, b"123456789", T0, None),
    ("s1", "orders", {}, b"a", None, None),
    ("s2", "orders", {}, b"a", datetime(1969, 12, 31, tzinfo=UTC), None),
    ("s3", "orders", {}, b"a", T0, datetime(9001, 1, 1, tzinfo=UTC)),
    ("s4", "orders", {}, b"a", T0, T0 + timedelta(seconds=61)),
    ("p1", "orders", {"": "v"}, b"a", T0, None),
    ("p2", "orders", {"k": None}, b"a", T0, None),
    ("p3", "orders", {"ok": "1", "a=b": "2", "c d": "3"}, b"a", T0, None),
    ("p4", "orders", {"n" * 300: "1"}, b"a", T0, None),
    ("w1", "orders", {"DELAYQ_WINDOW_MS": "0"}, b"a", T0, None),
    ("w2", "orders", {"DELAYQ_WINDOW_MS": "30s"}, b"a", T0, None),
    ("w3", "orders", {"DELAYQ_WINDOW_MS": "86400001"}, b"a", T0, None),
    ("w4", "orders", {"DELAYQ_WINDOW_MS": "123456789012"}, b"a", T0, None),
    ("w5", "orders", {"DELAYQ_WINDOW_MS": "1 "}, b"a", T0, None),
    ("two", None, {"": "v"}, b"", None, None),  # several broken: the first rule wins
]


def test_arrow_rules_give_the_spark_rules_reasons(spark: SparkSession) -> None:
    df = spark.createDataFrame(
        [(m, t, [], None, p, b, 1, T0, s, d) for m, t, p, b, s, d in ROWS], COMMITLOG
    )
    by_spark = [r["reason"] for r in df.select(rejection_reason(CFG).alias("reason")).collect()]
    by_arrow = rejection_reasons(df.toArrow(), CFG).to_pylist()

    assert by_arrow == by_spark
    assert by_arrow[:2] == [None, None]
    assert all(by_arrow[2:]), "every other row breaks a rule"
    assert by_arrow[-1] == "topic is missing"


def test_rules_on_rows_without_optional_columns() -> None:
    rows = pa.table({"msg_id": ["ok"], "topic": ["orders"], "body": [b"a"], "store_ts": [T0]})
    assert rejection_reasons(rows, CFG).to_pylist() == [None]


def test_message_id_hashes_are_sparks_xxhash64(spark: SparkSession) -> None:
    ids = ["A", "order-1:paid", "9F1C" * 8, "x" * 128, "é€", *("k" * n for n in range(70)), None]
    df = spark.createDataFrame([(i,) for i in ids], "msg_id string")
    by_spark = [r[0] for r in df.select(F.xxhash64("msg_id")).collect()]
    by_arrow = id_hashes(pa.array(ids, pa.string())).to_pylist()
    assert by_arrow[:-1] == by_spark[:-1]
    assert by_arrow[-1] is None  # a null id is quarantined, never indexed
