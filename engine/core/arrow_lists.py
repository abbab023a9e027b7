"""Building Arrow list and map columns from entries that each name their row.

Example:
    >>> import numpy as np
    >>> offsets, order = grouped(3, np.array([2, 0, 2]))
    >>> offsets.to_pylist(), order.to_pylist()
    ([0, 1, 1, 3], [1, 0, 2])
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def grouped(n: int, rows: np.ndarray) -> tuple[pa.Array, pa.Array]:
    """List offsets for ``n`` rows, and the order that groups entries by row (``rows[i]``
    is entry i's row), keeping the given order within a row.

    Example:
        >>> offsets, order = grouped(2, np.array([1, 0, 1]))
        >>> pa.ListArray.from_arrays(offsets, pa.array(["b1", "a", "b2"]).take(order))
        ... # doctest: +ELLIPSIS
        <pyarrow.lib.ListArray object at ...>
        [
          [
            "a"
          ],
          [
            "b1",
            "b2"
          ]
        ]
    """
    rows = np.asarray(rows, dtype=np.int64)
    order = np.lexsort((np.arange(len(rows)), rows))
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(rows, minlength=n), out=offsets[1:])
    return pa.array(offsets), pa.array(order, pa.int64())


def entry_rows(lists: pa.Array) -> np.ndarray:
    """The row of each entry of a list column, in the order ``pc.list_flatten`` gives the
    entries (a null list has none, whatever its offsets span), as :func:`grouped` takes them.

    Example:
        >>> entry_rows(pa.array([["a", "b"], None, ["c"]])).tolist()
        [0, 0, 2]
    """
    counts = np.asarray(pc.fill_null(pc.list_value_length(lists), 0), dtype=np.int64)
    return np.repeat(np.arange(len(lists), dtype=np.int64), counts)


def take_or_null(values: pa.Array, index: np.ndarray) -> pa.Array:
    """``values[index]``, null where ``index`` is -1.

    Example:
        >>> take_or_null(pa.array(["a", "b"]), np.array([1, -1])).to_pylist()
        ['b', None]
    """
    missing = index < 0
    if missing.all():
        return pa.nulls(len(index), values.type)
    return pc.take(values, pa.array(np.where(missing, 0, index), mask=missing))
