"""Read what a finished query scanned, from its executed plan's SQL metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame


@dataclass(frozen=True)
class ScanMetrics:
    """Files and rows a query read from storage (after partition pruning and data skipping)."""

    files: int = 0
    rows: int = 0


def scan_metrics(df: DataFrame) -> ScanMetrics:
    """Sum the file-scan metrics of ``df``'s executed plan; call after an action on ``df``.

    Example:
        >>> counts = df.groupBy("queue_id").count(); counts.collect()  # doctest: +SKIP
        >>> scan_metrics(counts)  # doctest: +SKIP
        ScanMetrics(files=2, rows=1000)
    """
    found: list[tuple[int, int]] = []
    _walk(df._jdf.queryExecution().executedPlan(), found)
    return ScanMetrics(sum(f for f, _ in found), sum(r for _, r in found))


def _walk(node: Any, found: list[tuple[int, int]]) -> None:
    name = node.nodeName()
    if name.startswith("AdaptiveSparkPlan"):
        _walk(node.executedPlan(), found)
        return
    if "QueryStage" in name:
        _walk(node.plan(), found)
        return
    if name.startswith("InMemoryTableScan"):
        # A persisted frame: the scan that built the cache holds the file metrics.
        _walk(node.relation().cachedPlan(), found)
        return
    metrics = node.metrics()
    if metrics.contains("numFiles"):
        has_rows = metrics.contains("numOutputRows")
        rows = metrics.get("numOutputRows").get().value() if has_rows else 0
        found.append((int(metrics.get("numFiles").get().value()), int(rows)))
    children = node.children()
    for i in range(children.size()):
        _walk(children.apply(i), found)
