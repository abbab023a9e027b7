"""A real S3 server (S3Proxy) per test run, and configs whose lakehouse is a bucket of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from engine.core.config import EngineConfig
from engine.lakehouse.catalog.session import REPO_ROOT
from engine.lakehouse.storage.layout import layout
from jobs.tools.objectstore import Server, start, stop
from tests.support.kafka import free_port


def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real S3 server on a free port; use as a fixture's body."""
    home = tmp_path_factory.mktemp("s3")
    server = start(home, free_port(), bucket=None, lib=REPO_ROOT / ".s3" / "lib")
    try:
        yield server
    finally:
        stop(home)


def s3_cfg(make_cfg: Any, server: Server, **changes: Any) -> EngineConfig:
    """A config whose lakehouse is a new bucket of ``server`` (one per test: Hadoop's S3A
    caches a filesystem per bucket, so a bucket is never reused with other settings)."""
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    server.make_bucket(bucket)
    settings: dict[str, Any] = {
        "lakehouse": f"s3a://{bucket}/lh",
        "s3_endpoint": server.endpoint,
        "s3_access_key": server.access_key,
        "s3_secret_key": server.secret_key,
        "sql_catalog": "memory",
    }
    settings.update(changes)
    cfg: EngineConfig = make_cfg(**settings)
    layout(cfg)  # registers the bucket's settings, as every entry point's first layout does
    return cfg
