"""Reading a Prometheus endpoint as a scraper would."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

#: Sample values by metric name and sorted ``(label, value)`` pairs.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample at ``url``, by name and sorted labels."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
