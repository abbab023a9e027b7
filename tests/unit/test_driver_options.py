"""A driver maps the class archive `make jars` writes, and only when it is there."""

from __future__ import annotations

from pathlib import Path

from engine.core.config import EngineConfig
from engine.lakehouse.catalog.session import CLASS_ARCHIVE, DRIVER_JAVA_OPTIONS, driver_java_options


def test_without_an_archive_the_driver_starts_as_before(tmp_path: Path) -> None:
    cfg = EngineConfig(jars_dir=str(tmp_path))
    assert driver_java_options(cfg) == DRIVER_JAVA_OPTIONS


def test_with_an_archive_the_driver_maps_it_and_says_nothing_if_it_cannot(
    tmp_path: Path,
) -> None:
    (tmp_path / CLASS_ARCHIVE).write_bytes(b"stale")
    options = driver_java_options(EngineConfig(jars_dir=str(tmp_path))).split()
    assert options[:2] == DRIVER_JAVA_OPTIONS.split()
    assert f"-XX:SharedArchiveFile={tmp_path.resolve() / CLASS_ARCHIVE}" in options
    assert {"-Xlog:cds=off", "-Xlog:cds+dynamic=off"} <= set(options)
