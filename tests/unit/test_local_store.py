"""A local commit whose link landed but answered "exists" (an NFS client that sent the link
again after losing the first answer) is this writer's, not another's."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.delta.log_append import LogAppender
from engine.lakehouse.storage.store import LocalStore


@pytest.fixture
def retried_links(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``os.link`` as a retrying NFS client answers it: the link is made, then the resent
    request finds it and fails with EEXIST."""
    real = os.link
    made: list[str] = []

    def link(src: str, dst: str) -> None:
        real(src, dst)
        made.append(dst)
        raise FileExistsError(17, "File exists", dst)

    monkeypatch.setattr(os, "link", link)
    return made


def test_a_link_that_landed_but_answered_exists_counts_as_ours(
    tmp_path: Path, retried_links: list[str]
) -> None:
    store = LocalStore()
    target = str(tmp_path / "_delta_log" / "00000000000000000000.json")
    assert store.create(target, b"ours\n") is True
    assert retried_links == [target]
    assert Path(target).read_bytes() == b"ours\n"
    assert [p.name for p in tmp_path.joinpath("_delta_log").iterdir()] == [Path(target).name]


def test_a_link_taken_by_another_writer_is_not_ours(tmp_path: Path) -> None:
    store = LocalStore()
    target = str(tmp_path / "v.json")
    assert store.create(target, b"theirs\n") is True
    assert store.create(target, b"theirs\n") is False, "same bytes, another writer's file"
    assert Path(target).read_bytes() == b"theirs\n"


def test_an_append_whose_commit_link_was_retried_keeps_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "orders")
    write_deltalake(path, pa.table({"n": pa.array([0], pa.int64())}))
    appender = LogAppender(path)
    real = os.link

    def link(src: str, dst: str) -> None:
        real(src, dst)
        raise FileExistsError(17, "File exists", dst)

    monkeypatch.setattr(os, "link", link)
    assert appender.append(pa.table({"n": pa.array([1, 2], pa.int64())}), txn=Txn("app", 1))
    monkeypatch.setattr(os, "link", real)
    table = DeltaTable(path)
    assert table.version() == 1, "one commit, not a second try at the next version"
    assert sorted(table.to_pyarrow_table()["n"].to_pylist()) == [0, 1, 2]
