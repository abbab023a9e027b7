"""A table the engine reads that is gone (its folder deleted while the lakehouse was in use)
stops the reader with an error naming it, not an ``OverflowError`` from delta-rs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from engine.core.errors import CheckpointError
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.live_files import LiveFiles


def test_reading_a_deleted_table_names_it_and_says_what_to_do(tmp_path: Path) -> None:
    path = str(tmp_path / "schedule")
    write_deltalake(path, pa.table({"msg_id": ["a", "b"]}))
    assert LiveFiles(path).dataset(0).count_rows() == 2
    shutil.rmtree(path)

    for reader in (LiveFiles(path), ArrowDelta(path)):
        version = reader.latest()
        assert version == -1
        with pytest.raises(CheckpointError, match=f"no Delta table at {path}: .* restore it"):
            reader.dataset(version)
