"""Checkpoints follow the table's own settings, as Spark's Delta does: every
``delta.checkpointInterval`` versions, and no log clean-up when
``delta.enableExpiredLogCleanup`` is false."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.checkpoints import CHECKPOINTS


def _table(path: Path, configuration: dict[str, str]) -> ArrowDelta:
    write_deltalake(str(path), pa.table({"n": pa.array([0], pa.int64())}),
                    configuration=configuration)  # fmt: skip
    return ArrowDelta(str(path))


def _log(path: Path) -> tuple[list[int], list[int]]:
    names = [p.name for p in (path / "_delta_log").iterdir()]
    commits = sorted(int(n.split(".")[0]) for n in names if n.endswith(".json"))
    checkpoints = sorted(int(n.split(".")[0]) for n in names if ".checkpoint." in n)
    return commits, checkpoints


@pytest.mark.parametrize("cleanup", ["true", "false"])
def test_checkpoints_every_table_interval_and_clean_up_only_when_enabled(
    tmp_path: Path, cleanup: str
) -> None:
    settings = {"delta.checkpointInterval": "3", "delta.enableExpiredLogCleanup": cleanup,
                "delta.logRetentionDuration": "interval 0 seconds"}  # fmt: skip
    table = _table(tmp_path / "t", settings)
    for n in range(1, 8):  # versions 1..7
        table.append(pa.table({"n": pa.array([n], pa.int64())}))
        assert CHECKPOINTS.wait(timeout=30)
    commits, checkpoints = _log(tmp_path / "t")
    if cleanup == "false":
        assert checkpoints == [3, 6] and commits == list(range(8)), "all kept: clean-up is off"
    else:
        assert checkpoints[-1] == 6 and commits[0] > 0 and commits[-1] == 7, "cleaned before 6"
    assert sorted(DeltaTable(str(tmp_path / "t")).to_pyarrow_table()["n"].to_pylist()) == list(
        range(8)
    )
