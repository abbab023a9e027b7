"""Which store holds a location, and the settings that reach an S3 lakehouse.

An S3 lakehouse's settings (endpoint, region, credentials) are registered with
:func:`register` for its root, which :func:`engine.lakehouse.storage.layout.layout` does for the
configuration it is given; what is not set there comes from the standard ``AWS_*``
environment variables. A registration reaches this process's Spark too (Hadoop's S3A
settings of the bucket), so Spark's reads and commits go where the engine's own go.

Example:
    >>> type(store_for("/lake/_engine/lease/1.json")).__name__
    'LocalStore'
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from engine.core.errors import SetupError
from engine.lakehouse.storage.store import LocalStore, S3Settings, Store, local_path, split_s3

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_SETTINGS: dict[tuple[str, str], S3Settings] = {}  # (bucket, key prefix) -> settings
_STORES: dict[Any, Store] = {}
_LOCAL_STORE = LocalStore()


def register(root: str, settings: S3Settings) -> None:
    """Use ``settings`` for the S3 lakehouse at ``root`` and everything under it, here and
    in this process's Spark, if one runs (Hadoop's S3A settings of its bucket).

    The first registration of a root holds for the process: a command an engine carries
    out for a client builds a configuration of its own, and must not move the engine's
    lakehouse to other settings (another endpoint) under it.

    Example:
        >>> register("s3a://delayq/lh", S3Settings(endpoint="http://127.0.0.1:9000"))
    """
    found = split_s3(root)
    if found is None:
        return
    key = (found[0], found[1].rstrip("/"))
    with _LOCK:
        known = _SETTINGS.get(key)
        if known is None:
            _SETTINGS[key] = settings
    if known is None:
        _tell_spark(found[0], settings_for(root))
    elif known != settings:
        log.info("%s keeps the storage settings it was first given", root)


def carried(location: str) -> dict[str, Any] | None:
    """The settings that reach ``location``, as plain values another process (a Spark task)
    takes with :func:`arrive`; ``None`` for a location that is not on S3.

    Example:
        >>> carried("/lake/schedule") is None
        True
    """
    if split_s3(location) is None:
        return None
    return dataclasses.asdict(settings_for(location))


def arrive(location: str, settings: dict[str, Any] | None) -> None:
    """Register the settings :func:`carried` gave for ``location`` in this process.

    Example:
        >>> arrive("/lake/schedule", None)  # a local lakehouse needs none
    """
    found = split_s3(location)
    if found is not None and settings is not None:
        register(f"s3a://{found[0]}", S3Settings(**settings))


def s3a_conf(bucket: str, settings: S3Settings) -> dict[str, str]:
    """Hadoop's S3A settings that reach ``bucket`` as ``settings`` say (per bucket:
    ``fs.s3a.bucket.<bucket>.*``, so lakehouses in other buckets keep theirs).

    Example:
        >>> s3a_conf("delayq", S3Settings("http://127.0.0.1:9000"))["fs.s3a.bucket.delayq.endpoint"]
        'http://127.0.0.1:9000'
    """
    prefix = f"fs.s3a.bucket.{bucket}"
    conf = {
        f"{prefix}.endpoint.region": settings.region or "us-east-1",
        f"{prefix}.path.style.access": str(settings.path_style).lower(),
        # put-if-absent for Delta's commits through Spark (its s3a LogStore asks for it)
        f"{prefix}.create.conditional.enabled": "true",
        # the classic input stream: Hadoop 3.5's default (analytics) is new and not needed
        f"{prefix}.input.stream.type": "classic",
    }
    if settings.endpoint:
        conf[f"{prefix}.endpoint"] = settings.endpoint
        conf[f"{prefix}.connection.ssl.enabled"] = str(
            settings.endpoint.startswith("https://")
        ).lower()
    if settings.access_key:
        conf[f"{prefix}.access.key"] = settings.access_key
        conf[f"{prefix}.secret.key"] = settings.secret_key
    if settings.session_token:
        conf[f"{prefix}.session.token"] = settings.session_token
        conf[f"{prefix}.aws.credentials.provider"] = (
            "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
        )
    return conf


def _tell_spark(bucket: str, settings: S3Settings) -> None:
    """Set the bucket's S3A settings in the running Spark, if any (a Spark started later
    gets them from :func:`engine.lakehouse.catalog.session.build_spark`)."""
    from pyspark import SparkContext

    context = SparkContext._active_spark_context
    if context is None or context._jsc is None:
        return
    hadoop = context._jsc.hadoopConfiguration()
    for key, value in s3a_conf(bucket, settings).items():
        hadoop.set(key, value)


def settings_for(location: str) -> S3Settings:
    """The settings that reach ``location`` (an S3 location), resolved.

    Example:
        >>> settings_for("s3a://delayq/lh/schedule").path_style
        True
    """
    found = split_s3(location)
    assert found is not None, f"{location} is not an S3 location"
    bucket, key = found
    with _LOCK:
        best = max(
            (p for (b, p) in _SETTINGS if b == bucket and (not p or f"{key}/".startswith(f"{p}/"))),
            key=len,
            default=None,
        )
        chosen = _SETTINGS[(bucket, best)] if best is not None else S3Settings()
    return chosen.resolved()


def store_for(location: str) -> Store:
    """The store that holds ``location``.

    Raises:
        SetupError: a scheme other than a local path, ``file:``, ``s3a:`` or ``s3:``.

    Example:
        >>> store_for("file:///lake").exists("file:///lake/nothing/here")
        False
    """
    if local_path(location) is not None:
        return _LOCAL_STORE
    found = split_s3(location)
    if found is None:
        raise SetupError(
            f"{location}: the lakehouse must be a local folder, a file:// URI or an "
            "s3a://bucket/prefix location"
        )
    settings = settings_for(location)
    key = (found[0], settings)
    with _LOCK:
        store = _STORES.get(key)
        if store is None:
            from engine.lakehouse.storage.s3 import S3Store  # (obstore, pyarrow: on S3 only)

            store = _STORES[key] = S3Store(found[0], settings)
    return store


__all__ = ["register", "s3a_conf", "settings_for", "store_for"]
