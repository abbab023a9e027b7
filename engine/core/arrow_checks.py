"""The rules of :func:`engine.core.message.rejection_reason`, on Arrow tables.

Stamping runs on the driver (no Spark job), so it checks ``commitlog`` rows as Arrow with
pyarrow's vectorised kernels. The rules, their order (the first broken one is the reason)
and the reasons' words are the Spark column's; a test runs the same bad rows through both.
A fast producer (:func:`engine.produce.send.send_table`) uses them too.

Example:
    >>> import pyarrow as pa
    >>> from engine.core.config import EngineConfig
    >>> rows = pa.table({"msg_id": ["A", None], "topic": ["orders", "orders"]})
    >>> rejection_reasons(rows, EngineConfig()).to_pylist()[1]
    'msg_id is missing'
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.core.config import EngineConfig
from engine.core.message import (
    MAX_MSG_ID,
    MAX_WINDOW_MS,
    MSG_ID_CHARS,
    PROP_WINDOW,
    PROPERTY_NAME_CHARS,
    WINDOW_CHARS,
    WINDOW_REFUSED,
)
from engine.core.topics import RESERVED_TOPICS, TOPIC_PATTERN

_TS = pa.timestamp("us", tz="UTC")
_FIRST = pa.scalar(datetime(1970, 1, 1, tzinfo=UTC), _TS)
_LAST = pa.scalar(datetime(9000, 1, 1, tzinfo=UTC), _TS)
#: RE2 (pyarrow's regex engine) reads ``\z`` as Java does: the very end, no line break after.
_MSG_ID = f"^{MSG_ID_CHARS}\\z"
_PROPERTY_NAME = f"^{PROPERTY_NAME_CHARS}\\z"


def rejection_reasons(rows: pa.Table, cfg: EngineConfig) -> pa.Array:
    """For each row of ``rows`` (``commitlog`` columns), null when valid, else why not.

    Columns ``rows`` lacks count as null. The reasons are word for word those of
    :func:`engine.core.message.rejection_reason`.

    Example:
        >>> import pyarrow as pa
        >>> from engine.core.config import EngineConfig
        >>> rows = pa.table({"msg_id": ["a b"], "topic": ["orders"]})
        >>> rejection_reasons(rows, EngineConfig()).to_pylist()
        ["msg_id 'a b' is not 1 to 128 characters of A-Z a-z 0-9 _ . - :"]
    """
    n = rows.num_rows
    reason = pa.nulls(n, pa.string())
    if n == 0:
        return reason

    def col(name: str, dtype: pa.DataType) -> pa.Array:
        if name not in rows.column_names:
            return pa.nulls(n, dtype)
        return rows[name].combine_chunks().cast(dtype)

    def flag(cond: pa.Array, text: Callable[[], pa.Array] | str) -> None:
        nonlocal reason
        hit = pc.and_kleene(pc.fill_null(cond, False), pc.is_null(reason))
        if pc.any(hit).as_py():
            value = pa.scalar(text, pa.string()) if isinstance(text, str) else text()
            reason = pc.if_else(hit, value, reason)

    def quoted(before: str, value: pa.Array, after: str) -> Callable[[], pa.Array]:
        # Built only for a batch with a row to refuse: most batches have none.
        return lambda: pc.binary_join_element_wise(before, value, after, "")

    msg_id = col("msg_id", pa.string())
    topic = col("topic", pa.string())
    body = col("body", pa.binary())
    store, deliver = col("store_ts", _TS), col("deliver_at", _TS)

    flag(pc.is_null(msg_id), "msg_id is missing")
    bad_id = pc.or_kleene(
        pc.invert(pc.match_substring_regex(msg_id, _MSG_ID)),
        pc.greater(pc.utf8_length(msg_id), MAX_MSG_ID),
    )
    chars = f"' is not 1 to {MAX_MSG_ID} characters of A-Z a-z 0-9 _ . - :"
    flag(bad_id, quoted("msg_id '", msg_id, chars))
    flag(pc.or_kleene(pc.is_null(topic), pc.equal(topic, "")), "topic is missing")
    flag(
        pc.invert(pc.match_substring_regex(topic, TOPIC_PATTERN)),
        quoted("topic '", topic, "' is not a valid topic name"),
    )
    reserved = pc.is_in(pc.utf8_lower(topic), pa.array(sorted(RESERVED_TOPICS)))
    flag(reserved, quoted("topic '", topic, "' is an engine table name"))
    flag(pc.is_null(body), "body is missing")
    size = pc.binary_length(body)
    if not cfg.allow_empty_body:
        flag(pc.equal(size, 0), "body is empty (messages.allow_empty_body is false)")
    over = f" bytes, over messages.max_body_bytes={cfg.max_body_bytes}"
    flag(pc.greater(size, cfg.max_body_bytes), quoted("body is ", pc.cast(size, pa.string()), over))
    flag(pc.is_null(store), "store_ts is missing")
    flag(_out_of_range(store), "store_ts is outside 1970-01-01..9000-01-01")
    flag(_out_of_range(deliver), "deliver_at is outside 1970-01-01..9000-01-01")
    ahead = pc.subtract(_millis(deliver), _millis(store))
    flag(
        pc.greater(ahead, cfg.max_delay_ms),
        f"deliver_at is more than messages.max_delay={cfg.max_delay_ms // 1000}s ahead",
    )
    if "properties" in rows.column_names:
        empty, first_bad = _property_checks(rows["properties"].combine_chunks(), n, cfg)
        flag(pa.array(empty), "a property has an empty name or no value")
        window = window_property(rows["properties"].combine_chunks())
        bad_window = pc.or_kleene(
            pc.invert(pc.match_substring_regex(window, f"^{WINDOW_CHARS}$")),
            pc.greater(pc.utf8_length(window), 8),
        )
        too_long = pc.greater(
            pc.cast(pc.if_else(bad_window, pa.scalar(None, pa.string()), window), pa.int64()),
            MAX_WINDOW_MS,
        )
        flag(
            pc.or_kleene(bad_window, too_long),
            quoted(f"property {PROP_WINDOW} '", window, WINDOW_REFUSED),
        )
        limit = cfg.max_property_name
        flag(
            pc.is_valid(first_bad),
            quoted(
                "property name '",
                first_bad,
                f"' is longer than messages.max_property_name_length={limit} "
                "or holds characters other than A-Z a-z 0-9 _ . - :",
            ),
        )
    return reason


def window_property(properties: pa.Array) -> pa.Array:
    """Each row's ``DELAYQ_WINDOW_MS`` property (null when it has none).

    Example:
        >>> props = pa.array([[("DELAYQ_WINDOW_MS", "500")], None],
        ...                  pa.map_(pa.string(), pa.string()))
        >>> window_property(props).to_pylist()
        ['500', None]
    """
    if len(properties) == 0 or properties.null_count == len(properties):
        return pa.nulls(len(properties), pa.string())
    return pc.map_lookup(properties, pa.scalar(PROP_WINDOW, pa.string()), "first")


def _out_of_range(ts: pa.Array) -> pa.Array:
    return pc.or_kleene(pc.less(ts, _FIRST), pc.greater_equal(ts, _LAST))


def _millis(ts: pa.Array) -> pa.Array:
    """Milliseconds since the epoch, as Spark's ``unix_millis`` (rows before 1970 are refused
    before this is used, so truncating equals rounding down)."""
    return pc.divide(pc.cast(pc.cast(ts, pa.timestamp("us")), pa.int64()), 1000)


def _property_checks(
    properties: pa.Array, n: int, cfg: EngineConfig
) -> tuple[np.ndarray, pa.Array]:
    """Per row: whether a property has an empty name or no value, and the first name that
    is too long or holds other characters (null when none)."""
    first_bad = pa.nulls(n, pa.string())
    if len(properties) == 0 or properties.null_count == n:
        return np.zeros(n, dtype=bool), first_bad
    # As a list of entries: pyarrow's list kernels do not take maps.
    entry = pa.struct([("key", pa.string()), ("value", pa.string())])
    as_list = properties.cast(pa.list_(entry))
    parents = pc.list_parent_indices(as_list).to_numpy()
    entries = pc.list_flatten(as_list)
    keys = entries.field("key")
    values = entries.field("value")
    empty_entry = pc.fill_null(
        pc.or_kleene(pc.equal(pc.utf8_length(keys), 0), pc.is_null(values)), False
    ).to_numpy(zero_copy_only=False)
    empty = np.bincount(parents[empty_entry], minlength=n) > 0
    bad_entry = pc.fill_null(
        pc.or_kleene(
            pc.invert(pc.match_substring_regex(keys, _PROPERTY_NAME)),
            pc.greater(pc.utf8_length(keys), cfg.max_property_name),
        ),
        False,
    ).to_numpy(zero_copy_only=False)
    if bad_entry.any():
        bad = np.flatnonzero(bad_entry)
        rows_with_bad, first = np.unique(parents[bad], return_index=True)
        names = np.full(n, None, dtype=object)
        names[rows_with_bad] = keys.take(pa.array(bad[first])).to_pylist()
        first_bad = pa.array(names.tolist(), pa.string())
    return empty, first_bad
