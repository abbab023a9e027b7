"""Work split into groups of about equal weight, for Spark tasks.

Example:
    >>> balanced([9, 1, 1, 7], 2)
    [[0], [1, 2, 3]]
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced(weights: Sequence[int], count: int) -> list[list[int]]:
    """Indices of ``weights`` in at most ``count`` groups of about equal total weight (the
    heaviest first into the lightest group), each group in index order, none empty.

    Example:
        >>> balanced([5, 5, 5], 8)
        [[0], [1], [2]]
    """
    size = max(1, min(count, len(weights)))
    groups: list[list[int]] = [[] for _ in range(size)]
    loads = [0] * size
    for index in sorted(range(len(weights)), key=lambda i: -weights[i]):
        lightest = loads.index(min(loads))
        groups[lightest].append(index)
        loads[lightest] += weights[index]
    return [sorted(group) for group in groups if group]


__all__ = ["balanced"]
