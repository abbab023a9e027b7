"""What a local commit flushes to the device before it shows: a power cut cannot leave a
reported commit (and a delivery round recorded after it) empty or naming missing bytes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from engine.lakehouse.delta.arrow_delta import create_table
from engine.lakehouse.delta.log_append import LogAppender


def test_data_files_then_the_commit_are_flushed_before_the_commit_is_linked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = tmp_path / "orders"
    schema = pa.schema([("msg_id", pa.string()), ("n", pa.int64())])
    create_table(str(table), schema)
    events: list[tuple[str, str]] = []
    real_fsync, real_link = os.fsync, os.link

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        events.append(("link", f"{src} -> {dst}"))
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    rows = pa.table({"msg_id": ["a", "b"], "n": [1, 2]}, schema=schema)
    assert LogAppender(str(table)).append(rows, file_rows=1)  # two data files

    linked = [i for i, (kind, what) in enumerate(events) if kind == "link" and ".json" in what]
    assert len(linked) == 1, events
    commit = events[linked[0]][1].split(" -> ")
    before = [what for kind, what in events[: linked[0]] if kind == "fsync"]
    data = [w for w in before if w.endswith(".parquet")]
    assert len(data) == 2, events  # each data file, before the commit names it
    assert before[-1] == commit[0], events  # the commit's own bytes, last, before its link
