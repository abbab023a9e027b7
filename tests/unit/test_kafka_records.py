"""Kafka records shaped as commitlog rows, in Arrow: what a record with odd headers becomes."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from engine.core.clock import to_millis
from engine.core.config import EngineConfig
from engine.produce.kafka_records import kafka_records, parse_records

NOW = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
BORN_MS = to_millis(datetime(2026, 1, 1, tzinfo=UTC))


def parsed(*records: dict[str, Any], **overrides: Any) -> dict[bytes, dict[str, Any]]:
    cfg = EngineConfig().with_overrides(**overrides)
    table = kafka_records(
        [{"topic": "in", "offset": i, "timestamp": BORN_MS, **r} for i, r in enumerate(records)]
    )
    rows = parse_records(table, cfg, NOW).to_pylist()
    return {r["body"] if r["body"] is not None else b"<none>": r for r in rows}


def test_odd_records_are_stored_or_refused_never_an_error() -> None:
    rows = parsed(
        {"value": b"binary", "key": b"\xff\xfe",
         "headers": [("REAL_TOPIC", b"orders"), ("trace", b"\x00\xff")]},
        {"value": b"forwarded",
         "headers": [("REAL_TOPIC", b"orders"), ("KAFKA_TOPIC", b"x"), ("DELAYQ_MSG_ID", b"o")]},
        {"value": b"overflow at",
         "headers": [("REAL_TOPIC", b"o"), ("TIMER_DELIVER_MS", b"9" * 17)]},
        {"value": b"overflow sec",
         "headers": [("REAL_TOPIC", b"o"), ("TIMER_DELAY_SEC", b"9300000000000")]},
        {"value": b"forged retry", "headers": [("REAL_TOPIC", b"retry_billing")]},
        {"value": None, "headers": [("REAL_TOPIC", b"orders")]},
        {"value": b"unmapped", "topic": "raw"},
    )  # fmt: skip
    assert rows[b"binary"]["reason"] is None and rows[b"binary"]["keys"] == ["base64://4="]
    assert dict(rows[b"binary"]["properties"])["trace"] == "base64:AP8="
    forwarded = dict(rows[b"forwarded"]["properties"])
    assert forwarded["KAFKA_TOPIC"] == "in" and "DELAYQ_MSG_ID" not in forwarded
    assert rows[b"overflow at"]["reason"] == (
        "header TIMER_DELIVER_MS='99999999999999999' is not ms since the epoch"
    )
    assert "within messages.max_delay" in rows[b"overflow sec"]["reason"]
    assert rows[b"forged retry"]["reason"] == "topic 'retry_billing' is reserved for the engine"
    assert rows[b"<none>"]["reason"] == "the record has no value (body)"
    assert rows[b"unmapped"]["reason"] == (
        "no REAL_TOPIC header and no kafka.topic_map entry for topic 'raw'"
    )
    assert len({r["msg_id"] for r in rows.values()}) == 7


def test_headers_set_delay_topic_keys_tags_and_properties() -> None:
    rows = parsed(
        {"value": b"level", "key": b"k1", "headers": [
            ("DELAY", b" +2 "), ("REAL_TOPIC", b"orders"), ("KEYS", b" a  b "), ("TAGS", b"t"),
            ("color", b"red"), ("color", b"blue"), ("empty", None)]},
        {"value": b"ms", "headers": [("TIMER_DELAY_MS", b"1500")]},
        {"value": b"sec", "headers": [("TIMER_DELAY_SEC", b"3")]},
        {"value": b"now"},
        {"value": b"two", "headers": [("DELAY", b"1"), ("TIMER_DELAY_MS", b"5")]},
        {"value": b"soon", "headers": [("DELAY", b"1.5")]},
        {"value": b"retry",
         "headers": [("UNIQ_KEY", b"order-7"), ("DELAY", b"x"), ("DELAY", b"1")]},
        kafka_ingest_topics=("in",),
        kafka_topic_map={"in": "audit"},
    )  # fmt: skip
    level = rows[b"level"]
    assert (level["topic"], level["delay_level"], level["deliver_at"]) == ("orders", 2, None)
    assert level["keys"] == ["k1", "a", "b"] and level["tags"] == "t"
    assert level["properties"] == [
        ("color", "blue"), ("empty", ""),
        ("KAFKA_TOPIC", "in"), ("KAFKA_PARTITION", "0"), ("KAFKA_OFFSET", "0"),
    ]  # fmt: skip
    now_ms = to_millis(NOW)  # store time in whole milliseconds, as the delay is added
    assert to_millis(rows[b"ms"]["deliver_at"]) == now_ms + 1500
    assert to_millis(rows[b"sec"]["deliver_at"]) == now_ms + 3000
    assert rows[b"sec"]["topic"] == "audit" and rows[b"now"]["deliver_at"] is None
    assert rows[b"now"]["store_ts"] == NOW and to_millis(rows[b"now"]["born_ts"]) == BORN_MS
    assert rows[b"two"]["reason"].startswith("give only one of the headers DELAY, ")
    assert rows[b"soon"]["reason"] == "header DELAY='1.5' is not a level"
    assert rows[b"retry"]["msg_id"] == "order-7" and rows[b"retry"]["delay_level"] == 1


def test_made_ids_depend_on_topic_partition_offset_and_time_only() -> None:
    first = parsed({"value": b"a", "headers": [("REAL_TOPIC", b"o")]})[b"a"]["msg_id"]
    again = parsed({"value": b"a", "headers": [("REAL_TOPIC", b"o"), ("x", b"y")]})[b"a"]
    assert again["msg_id"] == first and len(first) == 32 and first.isupper()


def test_made_ids_are_the_md5_of_the_joined_parts_and_keys_stay_theirs() -> None:
    """The ids of earlier versions: a batch stored by one and replayed by this one (its
    checkpoint lost) is recognised as the same records."""
    rows = parsed(
        {"value": b"k", "partition": 3, "headers": [("REAL_TOPIC", b"o"), ("UNIQ_KEY", b"key-1")]},
        {"value": b"p", "partition": 3, "headers": [("REAL_TOPIC", b"o")]},
        {"value": b"q", "partition": 0, "headers": [("REAL_TOPIC", b"o")]},
    )
    micros = BORN_MS * 1000
    for body, partition, offset in ((b"p", 3, 1), (b"q", 0, 2)):
        text = f"in:{partition}:{offset}:{micros}".encode()
        assert rows[body]["msg_id"] == hashlib.md5(text).hexdigest().upper()
    assert rows[b"k"]["msg_id"] == "key-1"


def test_a_record_without_topic_partition_offset_or_time_still_gets_an_id() -> None:
    table = kafka_records(
        [{"value": b"b", "topic": "in", "offset": 2, "timestamp": BORN_MS,
          "headers": [("REAL_TOPIC", b"o")]},
         {"value": b"d", "topic": None, "partition": None, "offset": None,
          "headers": [("REAL_TOPIC", b"o")]}]
    )  # fmt: skip
    rows = {r["body"]: r for r in parse_records(table, EngineConfig(), NOW).to_pylist()}
    assert rows[b"d"]["msg_id"] == hashlib.md5(b"").hexdigest().upper()
    assert (
        rows[b"b"]["msg_id"] == hashlib.md5(f"in:0:2:{BORN_MS * 1000}".encode()).hexdigest().upper()
    )


def test_an_empty_batch_gives_no_rows() -> None:
    assert parse_records(kafka_records([]), EngineConfig(), NOW).num_rows == 0


def test_batches_and_null_header_lists_give_each_record_its_own_headers() -> None:
    one = kafka_records(
        [{"value": f"v{i}".encode(), "topic": "in", "offset": i, "timestamp": BORN_MS,
          "headers": [("REAL_TOPIC", f"t{i}".encode()), ("n", str(i).encode())]}
         for i in range(6)]
    )  # fmt: skip
    whole = parse_records(one, EngineConfig(), NOW)
    in_batches = parse_records(pa.Table.from_batches(one.to_batches(max_chunksize=4)),
                               EngineConfig(), NOW)  # fmt: skip
    assert in_batches.to_pylist() == whole.to_pylist()
    assert whole["topic"].to_pylist() == [f"t{i}" for i in range(6)]
    # A null list whose offsets still span entries (Arrow allows it): they are not its own.
    headers = one["headers"].chunk(0)
    nulled = pa.ListArray.from_arrays(
        headers.offsets, headers.values, mask=pa.array([True] + [False] * 5)
    )
    rows = parse_records(one.set_column(6, "headers", nulled), EngineConfig(), NOW)
    assert rows["reason"][0].as_py().startswith("no REAL_TOPIC header")
    assert rows["topic"].to_pylist()[1:] == [f"t{i}" for i in range(1, 6)]


def test_kafka_out_records_carry_id_time_tags_and_properties() -> None:
    from engine.deliver.kafka_sink import kafka_records as out_records

    maps = pa.array([[("a", "1")], [("b", None)], [("c", "3")]], pa.map_(pa.string(), pa.string()))
    nulled = pa.MapArray.from_arrays(maps.offsets, maps.keys, maps.items,
                                     mask=pa.array([False, True, False]))  # fmt: skip
    rows = pa.table({
        "msg_id": ["A", "B", "C"], "keys": [["k1", "k2"], [], None], "tags": ["t", None, None],
        "properties": nulled, "body": [b"1", b"2", None], "deliver_ts": [NOW, NOW, NOW],
    })  # fmt: skip
    records = out_records(rows, "orders").to_pylist()
    assert [r["key"] for r in records] == [b"k1", None, None]
    assert [[h["key"] for h in r["headers"]] for r in records] == [
        ["DELAYQ_MSG_ID", "DELAYQ_DELIVER_TS", "TAGS", "a"],
        ["DELAYQ_MSG_ID", "DELAYQ_DELIVER_TS"],  # a null map: no property of another row's
        ["DELAYQ_MSG_ID", "DELAYQ_DELIVER_TS", "c"],
    ]
    assert records[0]["headers"][1]["value"] == str(to_millis(NOW)).encode()
