"""Configuration: defaults, overrides, and start-up failures that name key and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.config import DEFAULT_CONF, EngineConfig, load_config, parse_override
from engine.core.errors import ConfigError


def test_shipped_conf_loads_with_rocketmq_defaults() -> None:
    cfg = load_config(DEFAULT_CONF)
    assert cfg.levels.max_level == 18
    assert cfg.poll_interval_ms == 200
    assert cfg.max_body_bytes == 4 * 1024 * 1024
    assert cfg.database == "delayq"
    assert cfg.spark_conf["spark.sql.shuffle.partitions"] == "2"
    assert cfg.control_enabled and cfg.control_warm_up


def test_overrides_win_over_the_file() -> None:
    cfg = load_config(DEFAULT_CONF, {"levels.delays": "1s 2s 3s", "delivery.poll_interval": "1s"})
    assert cfg.levels.delays_ms == (1_000, 2_000, 3_000)
    assert cfg.poll_interval_ms == 1_000


def test_dedup_window_defaults_to_the_longest_level_and_can_be_off() -> None:
    assert load_config(DEFAULT_CONF).dedup_window_ms == 2 * 3_600_000
    assert load_config(DEFAULT_CONF, {"messages.dedup_window": "0"}).dedup_window_ms == 0
    short = {"levels.delays": "1s 2s 3s", "messages.dedup_window": "3s"}
    assert load_config(DEFAULT_CONF, short).dedup_window_ms == 3_000


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("levels.delays", "1s 2q", "'2q'"),
        ("delivery.poll_interval", "fast", "fast"),
        ("lease.timeout", "500ms", "at least 1s"),
        ("lease.standby", "later", "true or false"),
        ("delivery.poll_interval", "0ms", "greater than 0"),
        ("messages.max_body_bytes", "-1", "greater than 0"),
        ("lakehouse.database", "my-db", "SQL identifier"),
        ("sql.register_tables", "maybe", "true or false"),
        ("control.warm_up", "later", "true or false"),
        ("delivery.pol_interval", "1s", "unknown key"),
        ("messages.max_property_name_length", "16", "at least 32"),
        ("messages.allow_empty_body", "perhaps", "true or false"),
        ("lakehouse.path", "gs://bucket/lh", "local folder"),
        ("lakehouse.path", "dbfs:/mnt/lh", "local folder"),
        ("lakehouse.path", "file://otherhost/lh", "local folder"),
        ("messages.dedup_window", "1h", "at least the longest level"),
        ("messages.dedup_window", "soon", "soon"),
        ("sql.catalog", "hive", "embedded, spark, memory"),
        ("sql.server.jdbc_port", "70000", "between 0"),
        ("sql.server.connect_port", "10000", "must differ from sql.server.jdbc_port"),
    ],
)
def test_bad_values_fail_naming_key_and_value(key: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT_CONF, {key: value})
    message = str(err.value)
    assert key in message
    assert needle in message


def test_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[levels\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


def test_config_is_frozen() -> None:
    cfg = EngineConfig()
    with pytest.raises(AttributeError):
        cfg.database = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.spark_conf["x"] = "y"  # type: ignore[index]


def test_parse_override() -> None:
    assert parse_override("levels.delays=1s 2s") == ("levels.delays", "1s 2s")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("levels.delays")


def test_spark_settings_default_to_one_machine_and_can_be_raised() -> None:
    assert EngineConfig().spark_conf["spark.sql.shuffle.partitions"] == "2"
    raised = EngineConfig.from_mapping({"spark.conf.spark.sql.shuffle.partitions": "64"})
    assert raised.spark_conf["spark.sql.shuffle.partitions"] == "64"
    assert raised.spark_conf["spark.databricks.delta.snapshotPartitions"] == "2"


def test_file_uris_are_local_paths() -> None:
    for given in ("file:///lake/x", "file://localhost/lake/x", "file:/lake/x", "/lake/x"):
        assert load_config(DEFAULT_CONF, {"lakehouse.path": given}).lakehouse_path == "/lake/x"
    with pytest.raises(ConfigError, match=r"lakehouse\.path='hdfs://nn/lh'"):
        load_config(DEFAULT_CONF).with_overrides(lakehouse="hdfs://nn/lh")


def test_an_s3_lakehouse_is_an_s3a_uri_and_needs_a_catalog_other_than_the_embedded_one() -> None:
    cfg = load_config(DEFAULT_CONF, {"lakehouse.path": "s3://delayq/lh/", "sql.catalog": "memory"})
    assert (cfg.lakehouse_path, cfg.on_object_store) == ("s3a://delayq/lh", True)
    with pytest.raises(ConfigError, match=r"sql\.catalog='embedded'.*sql\.catalog=memory"):
        load_config(DEFAULT_CONF, {"lakehouse.path": "s3a://delayq/lh"})
    with pytest.raises(ConfigError, match=r"lakehouse\.path='s3a://Bad_Bucket/lh'"):
        load_config(DEFAULT_CONF, {"lakehouse.path": "s3a://Bad_Bucket/lh"})
    with pytest.raises(ConfigError, match=r"storage\.s3\.endpoint='127.0.0.1:9000'"):
        load_config(DEFAULT_CONF, {"storage.s3.endpoint": "127.0.0.1:9000"})
    secret = load_config(DEFAULT_CONF, {"storage.s3.secret_key": "hunter2"})
    assert "hunter2" not in repr(secret), "the secret stays out of logs"
