"""Kafka records as ``commitlog`` rows, in Arrow: headers read, bad records given a reason.

The ingest job (:mod:`engine.produce.kafka_ingest`) hands each micro-batch of Spark's Kafka
source here as an Arrow table (``key, value, topic, partition, offset, timestamp, headers``)
and appends the result. Whole columns are computed at once; only the records that are
refused, and the ids made for records without ``UNIQ_KEY``, are handled one by one.

What a record becomes (header names in :mod:`engine.core.kafka_headers`):

* its delay: one of ``DELAY`` (a level), ``TIMER_DELIVER_MS``, ``TIMER_DELAY_SEC``,
  ``TIMER_DELAY_MS`` (none: delivered at once); numbers are whole, optionally signed, with
  spaces around allowed;
* its topic: the ``REAL_TOPIC`` header, else ``kafka.topic_map`` of its Kafka topic;
* ``msg_id``: the ``UNIQ_KEY`` header, else the upper-case MD5 of
  ``<topic>:<partition>:<offset>:<timestamp in us>`` (a replayed batch gets the same ids);
* ``keys``: the Kafka key, then the ``KEYS`` header split on spaces; ``tags``: ``TAGS``;
* ``properties``: every other header (the last value of a repeated one wins), then
  ``KAFKA_TOPIC``, ``KAFKA_PARTITION`` and ``KAFKA_OFFSET``. Headers named like the engine's
  own properties are dropped (a record forwarded from a delivered topic carries old ones).

Header values are UTF-8 text; bytes that are not become ``base64:<bytes in base64>``, and a
header without a value is ``""``. Where a header is given twice, the last one counts.

Example:
    >>> from datetime import UTC, datetime
    >>> from engine.core.config import EngineConfig
    >>> records = kafka_records([
    ...     {"value": b"hi", "topic": "in", "offset": 0, "timestamp": 0,
    ...      "headers": [("REAL_TOPIC", b"orders"), ("DELAY", b"2")]},
    ...     {"value": b"no", "topic": "in", "offset": 1, "timestamp": 0,
    ...      "headers": [("DELAY", b"soon")]},
    ... ])
    >>> rows = parse_records(records, EngineConfig(), datetime(2026, 1, 1, tzinfo=UTC))
    >>> rows.select(["topic", "delay_level", "reason"]).to_pylist()[0]
    {'topic': 'orders', 'delay_level': 2, 'reason': None}
    >>> rows["reason"][1].as_py()
    "header DELAY='soon' is not a level"
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.core.arrow_lists import entry_rows, grouped, take_or_null
from engine.core.clock import to_micros, to_millis
from engine.core.config import EngineConfig
from engine.core.kafka_headers import (
    HEADER_DELAY_MS,
    HEADER_DELAY_SEC,
    HEADER_DELIVER_MS,
    HEADER_DELIVER_TS,
    HEADER_KEYS,
    HEADER_LEVEL,
    HEADER_MSG_ID,
    HEADER_REAL_TOPIC,
    HEADER_TAGS,
    HEADER_UNIQ_KEY,
    SPECIAL_HEADERS,
    TIMING_HEADERS,
)
from engine.core.message import ENGINE_PROPERTIES
from engine.core.topics import DLQ_PREFIX, RESERVED_TOPICS, RETRY_PREFIX

#: Properties recording where a record came from.
PROP_KAFKA_TOPIC = "KAFKA_TOPIC"
PROP_KAFKA_PARTITION = "KAFKA_PARTITION"
PROP_KAFKA_OFFSET = "KAFKA_OFFSET"
SOURCE_PROPERTIES = (PROP_KAFKA_TOPIC, PROP_KAFKA_PARTITION, PROP_KAFKA_OFFSET)

#: Incoming headers with the names of the engine's own properties are not kept: the
#: engine sets them (a record forwarded from a delivered topic carries old ones).
OWN_PROPERTIES = (*SOURCE_PROPERTIES, HEADER_MSG_ID, HEADER_DELIVER_TS, *ENGINE_PROPERTIES)
#: Largest TIMER_DELIVER_MS accepted (year 9999); beyond, the arithmetic would overflow.
MAX_EPOCH_MS = 253_402_300_799_999

_HEADER = pa.struct([("key", pa.string()), ("value", pa.binary())])
#: A Kafka record as Spark's Kafka source gives it (``includeHeaders``).
KAFKA_RECORD = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("headers", pa.list_(_HEADER)),
    ]
)
_TIME = pa.timestamp("us", tz="UTC")
_PROPERTIES = pa.map_(pa.string(), pa.string())


def kafka_records(records: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Records as dicts (``headers`` as ``(name, bytes)`` pairs, ``timestamp`` in ms) as the
    Arrow table :func:`parse_records` takes; missing fields are null (``partition`` 0).

    Example:
        >>> kafka_records([{"value": b"x", "topic": "in", "offset": 3}]).num_rows
        1
    """
    rows = []
    for r in records:
        stamp = r.get("timestamp")
        rows.append(
            {
                "key": r.get("key"),
                "value": r.get("value"),
                "topic": r.get("topic"),
                "partition": r.get("partition", 0),
                "offset": r.get("offset"),
                "timestamp": None if stamp is None else int(stamp) * 1000,
                "headers": [{"key": k, "value": v} for k, v in r.get("headers") or []],
            }
        )
    return pa.Table.from_pylist(rows, schema=KAFKA_RECORD)


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(raw).decode("ascii")


def _texts(values: pa.Array) -> pa.Array:
    """Bytes as UTF-8 text, ``base64:...`` where they are not UTF-8 (null stays null)."""
    try:
        return pc.cast(values, pa.string())
    except pa.ArrowInvalid:  # some value is not UTF-8: the rare case, value by value
        return pa.array(
            [None if v is None else _decode(v) for v in values.to_pylist()], pa.string()
        )


def _bools(mask: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(pc.fill_null(mask, False).to_numpy(zero_copy_only=False), dtype=bool)


def _last_per_row(parents: np.ndarray, positions: np.ndarray, n: int) -> np.ndarray:
    """For rows ``0..n-1``: the last of ``positions`` (ascending) whose parent is the row,
    or -1."""
    out = np.full(n, -1, dtype=np.int64)
    if positions.size:
        rows, first_from_end = np.unique(parents[positions][::-1], return_index=True)
        out[rows] = positions[::-1][first_from_end]
    return out


class _Headers:
    """Every record's headers, flattened once."""

    def __init__(self, headers: pa.Array) -> None:
        self.rows = len(headers)
        self.parents = entry_rows(headers)
        entries = pc.list_flatten(headers)
        keys, values = entries.flatten()
        self.keys: pa.Array = keys
        self.values: pa.Array = values

    def last(self, name: str) -> pa.Array:
        """Each record's last header ``name`` as text (null where it has none)."""
        positions = np.flatnonzero(_bools(pc.equal(self.keys, name)))
        index = _last_per_row(self.parents, positions, self.rows)
        text = pc.fill_null(_texts(take_or_null(self.values, index)), "")  # no value: ""
        return pc.if_else(pa.array(index >= 0), text, pa.scalar(None, pa.string()))

    def others(self, excluded: tuple[str, ...]) -> tuple[np.ndarray, pa.Array, pa.Array]:
        """The headers not in ``excluded`` as (row, name, text), one per row and name (the
        last wins, in the place of the last)."""
        kept = _bools(pc.invert(pc.is_in(self.keys, value_set=pa.array(excluded, pa.string()))))
        kept &= _bools(pc.is_valid(self.keys))
        positions = np.flatnonzero(kept)
        if positions.size:
            codes = np.asarray(pc.dictionary_encode(self.keys.take(positions)).indices)
            pair = self.parents[positions] * (int(codes.max()) + 1) + codes
            _, first_from_end = np.unique(pair[::-1], return_index=True)
            positions = np.sort(positions[::-1][first_from_end])
        index = pa.array(positions, pa.int64())
        texts = pc.fill_null(_texts(self.values.take(index)), "")
        return self.parents[positions], self.keys.take(index), texts


def _keys(n: int, key: pa.Array, extra: pa.Array) -> pa.Array:
    """The Kafka key (if any), then the words of the ``KEYS`` header, per record."""
    has_key = np.flatnonzero(_bools(pc.is_valid(key)))
    words = pc.split_pattern(pc.fill_null(extra, ""), " ")
    word_rows = entry_rows(words)
    flat = pc.list_flatten(words)
    nonempty = np.flatnonzero(_bools(pc.greater(pc.utf8_length(flat), 0)))
    values = pa.concat_arrays(
        [_texts(key.take(pa.array(has_key, pa.int64()))), flat.take(pa.array(nonempty, pa.int64()))]
    )
    offsets, order = grouped(n, np.concatenate([has_key, word_rows[nonempty]]))
    element = pa.field("element", pa.string(), nullable=False)
    return pa.ListArray.from_arrays(offsets, values.take(order), type=pa.list_(element))


def _properties(
    n: int, headers: _Headers, topic: pa.Array, partition: pa.Array, offset: pa.Array
) -> pa.Array:
    """Every other header, then where the record came from."""
    rows, names, texts = headers.others((*SPECIAL_HEADERS, *OWN_PROPERTIES))
    source_rows = np.repeat(np.arange(n, dtype=np.int64), len(SOURCE_PROPERTIES))
    source_names = pa.array(list(SOURCE_PROPERTIES) * n, pa.string())
    columns = pa.concat_arrays(
        [topic, pc.cast(partition, pa.string()), pc.cast(offset, pa.string())]
    )
    # row i's three values sit at i, n + i and 2n + i
    pick = (np.arange(len(SOURCE_PROPERTIES))[None, :] * n + np.arange(n)[:, None]).ravel()
    source_texts = columns.take(pa.array(pick, pa.int64()))
    offsets, order = grouped(n, np.concatenate([rows, source_rows]))
    return pa.MapArray.from_arrays(
        offsets,
        pa.concat_arrays([names, source_names]).take(order),
        pa.concat_arrays([texts, source_texts]).take(order),
        type=_PROPERTIES,
    )


def _integer(text: pa.Array, type_: pa.DataType) -> pa.Array:
    """Whole numbers (spaces around and a sign allowed) as ``type_``; null where ``text`` is
    not one or does not fit."""
    trimmed = pc.utf8_trim_whitespace(text)
    whole = _bools(pc.match_substring_regex(trimmed, r"^[+-]?[0-9]+$"))
    candidates = pc.replace_substring_regex(
        pc.if_else(pa.array(whole), trimmed, pa.scalar(None, pa.string())), r"^\+", ""
    )
    try:
        return pc.cast(candidates, type_)
    except pa.ArrowInvalid:  # one does not fit: value by value
        bits = type_.bit_width - 1
        return pa.array(
            [
                None if s is None or not -(2**bits) <= int(s) < 2**bits else int(s)
                for s in candidates.to_pylist()
            ],
            type_,
        )


def _made_ids(records: pa.Table, rows: np.ndarray) -> pa.Array:
    """Ids of records without ``UNIQ_KEY``: MD5 of topic, partition, offset and timestamp
    (the timestamp too: a topic deleted and made again reuses offsets), joined by ``:``.

    The text is joined with Arrow; only the digest is taken record by record.
    """
    picked = records.take(pa.array(rows, pa.int64()))
    parts = [
        picked["topic"],
        picked["partition"],
        picked["offset"],
        pc.cast(picked["timestamp"], pa.int64()),
    ]
    texts = [pc.cast(p, pa.string()) for p in parts]
    # A null part is left out, as before; a record with none at all is hashed from "" (the
    # join would drop its row).
    nothing = pc.and_kleene(
        pc.and_kleene(pc.is_null(texts[0]), pc.is_null(texts[1])),
        pc.and_kleene(pc.is_null(texts[2]), pc.is_null(texts[3])),
    )
    texts[0] = pc.if_else(nothing, pa.scalar("", pa.string()), texts[0])
    joined = pc.binary_join_element_wise(*texts, ":", null_handling="skip")
    digests = [hashlib.md5(t.encode()).hexdigest() for t in joined.to_pylist()]
    return pc.utf8_upper(pa.array(digests, pa.string()))


def _reasons(
    n: int,
    cfg: EngineConfig,
    texts: dict[str, pa.Array],
    numbers: dict[str, pa.Array],
    topic: pa.Array,
    real_topic: pa.Array,
    value: pa.Array,
) -> pa.Array:
    """Why each record is refused (null: it is not); the first rule broken names it."""
    longest = cfg.max_delay_ms
    given = np.zeros(n, dtype=np.int64)
    for name in TIMING_HEADERS:
        given += _bools(pc.is_valid(texts[name]))

    def out_of(name: str, low: int, high: int) -> np.ndarray:
        number = numbers[name]
        bad = pc.or_kleene(pc.less(number, low), pc.greater(number, high))
        broken: np.ndarray = _bools(pc.is_valid(texts[name])) & (
            _bools(pc.is_null(number)) | _bools(bad)
        )
        return broken

    lowered = pc.utf8_lower(real_topic)
    reserved = (
        _bools(pc.starts_with(lowered, RETRY_PREFIX))
        | _bools(pc.starts_with(lowered, DLQ_PREFIX))
        | _bools(pc.is_in(lowered, pa.array(sorted(RESERVED_TOPICS), pa.string())))
    )
    rules: list[tuple[np.ndarray, Any]] = [
        (given > 1, lambda _i: f"give only one of the headers {', '.join(TIMING_HEADERS)}"),
        (
            _bools(pc.is_valid(texts[HEADER_LEVEL])) & _bools(pc.is_null(numbers[HEADER_LEVEL])),
            lambda i: f"header {HEADER_LEVEL}='{texts[HEADER_LEVEL][i].as_py()}' is not a level",
        ),
        (
            out_of(HEADER_DELIVER_MS, 0, MAX_EPOCH_MS),
            lambda i: (
                f"header {HEADER_DELIVER_MS}='{texts[HEADER_DELIVER_MS][i].as_py()}' "
                "is not ms since the epoch"
            ),
        ),
        (
            out_of(HEADER_DELAY_SEC, 0, longest // 1000),
            lambda i: (
                f"header {HEADER_DELAY_SEC}='{texts[HEADER_DELAY_SEC][i].as_py()}' is not whole "
                f"seconds >= 0 within messages.max_delay={longest // 1000}s"
            ),
        ),
        (
            out_of(HEADER_DELAY_MS, 0, longest),
            lambda i: (
                f"header {HEADER_DELAY_MS}='{texts[HEADER_DELAY_MS][i].as_py()}' is not whole "
                f"milliseconds >= 0 within messages.max_delay={longest // 1000}s"
            ),
        ),
        (
            _bools(pc.is_null(real_topic)),
            lambda i: (
                f"no {HEADER_REAL_TOPIC} header and no kafka.topic_map entry for topic "
                f"'{topic[i].as_py()}'"
            ),
        ),
        (reserved, lambda i: f"topic '{real_topic[i].as_py()}' is reserved for the engine"),
        (_bools(pc.is_null(value)), lambda _i: "the record has no value (body)"),
    ]
    refused = np.zeros(n, dtype=bool)
    for broken, _ in rules:
        refused |= broken
    reasons: list[str | None] = [None] * n
    for i in np.flatnonzero(refused):
        reasons[i] = next(say(int(i)) for broken, say in rules if broken[i])
    return pa.array(reasons, pa.string())


def parse_records(records: pa.Table, cfg: EngineConfig, now: datetime) -> pa.Table:
    """Shape Kafka records (:data:`KAFKA_RECORD`) as ``commitlog`` rows plus ``reason``
    (null for a good record).

    Pure: the same records give the same rows (``store_ts`` is ``now``).

    Example:
        >>> from datetime import UTC, datetime
        >>> from engine.core.config import EngineConfig
        >>> at = kafka_records([{"value": b"x", "topic": "in", "offset": 0, "timestamp": 0,
        ...     "headers": [("REAL_TOPIC", b"o"), ("TIMER_DELAY_SEC", b"3")]}])
        >>> row = parse_records(at, EngineConfig(), datetime(2026, 1, 1, tzinfo=UTC))
        >>> row["deliver_at"][0].as_py().isoformat()
        '2026-01-01T00:00:03+00:00'
    """
    records = records.select(KAFKA_RECORD.names).cast(KAFKA_RECORD)
    batches = records.to_batches()
    if len(batches) > 1:  # batch by batch: one column of a whole micro-batch may pass 2 GiB
        return pa.concat_tables(
            parse_records(pa.Table.from_batches([batch]), cfg, now) for batch in batches
        )
    n = records.num_rows
    column = {name: batches[0].column(name) if batches else pa.array([], records[name].type)
              for name in KAFKA_RECORD.names}  # fmt: skip
    headers = _Headers(column["headers"])
    texts = {h: headers.last(h) for h in SPECIAL_HEADERS}
    numbers = {
        HEADER_LEVEL: _integer(texts[HEADER_LEVEL], pa.int32()),
        **{h: _integer(texts[h], pa.int64()) for h in TIMING_HEADERS if h != HEADER_LEVEL},
    }
    topic = column["topic"]
    mapping = cfg.kafka_topic_map
    mapped = pa.nulls(n, pa.string())
    if mapping:
        names = pc.dictionary_encode(topic)
        targets = [mapping.get(t) for t in names.dictionary.to_pylist()]
        mapped = pa.array(targets, pa.string()).take(names.indices)
    real_topic = pc.coalesce(texts[HEADER_REAL_TOPIC], mapped)
    reason = _reasons(n, cfg, texts, numbers, topic, real_topic, column["value"])

    # Good records only: the bounds checked above keep the arithmetic from overflowing.
    good = pc.is_null(reason)
    now_ms = to_millis(now)
    delay_ms = pc.coalesce(pc.multiply(numbers[HEADER_DELAY_SEC], 1000), numbers[HEADER_DELAY_MS])
    deliver_ms = pc.if_else(
        good,
        pc.coalesce(numbers[HEADER_DELIVER_MS], pc.add(delay_ms, now_ms)),
        pa.scalar(None, pa.int64()),
    )
    deliver_at = pc.cast(pc.multiply(deliver_ms, 1000), pa.int64()).cast(_TIME)

    uniq = texts[HEADER_UNIQ_KEY]
    without = np.flatnonzero(_bools(pc.is_null(uniq)))
    msg_id = uniq
    if without.size:
        place = np.zeros(n, dtype=np.int64)  # each row's made id (rows with a key: any)
        place[without] = np.arange(without.size)
        msg_id = pc.coalesce(uniq, _made_ids(records, without).take(pa.array(place)))
    return pa.table(
        {
            "msg_id": msg_id,
            "topic": pc.coalesce(real_topic, topic),
            "keys": _keys(n, column["key"], texts[HEADER_KEYS]),
            "tags": texts[HEADER_TAGS],
            "properties": _properties(n, headers, topic, column["partition"], column["offset"]),
            "body": column["value"],
            "delay_level": numbers[HEADER_LEVEL],
            "born_ts": column["timestamp"],
            "store_ts": pa.array(np.full(n, to_micros(now), dtype=np.int64)).cast(_TIME),
            "deliver_at": deliver_at,
            "reason": reason,
        }
    )
