"""The two stores keep one contract: a local folder, and an S3 bucket on a real S3 s3.

Put-if-absent is what every commit, plan and lease claim rests on: of writers racing for
one name exactly one wins, and readers see a file whole or not at all.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from engine.lakehouse.storage.location import register, store_for
from engine.lakehouse.storage.store import S3Settings
from jobs.tools.objectstore import Server

pytestmark = pytest.mark.integration


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path, s3: Server) -> str:
    if request.param == "local":
        return str(tmp_path / "lake")
    bucket = f"store-{abs(hash(str(tmp_path))) % 10**9}"
    s3.make_bucket(bucket)
    settings = S3Settings(s3.endpoint, "", s3.access_key, s3.secret_key)
    register(f"s3a://{bucket}/lake", settings)
    return f"s3a://{bucket}/lake"


def test_of_writers_racing_for_one_name_exactly_one_wins(root: str) -> None:
    store = store_for(root)
    names = [f"{root}/_delta_log/{v:020d}.json" for v in range(20)]
    wins: dict[str, list[int]] = {n: [] for n in names}
    start = threading.Barrier(6)

    def writer(who: int) -> None:
        start.wait()
        for name in names:
            if store.create(name, f"writer {who}\n".encode()):
                wins[name].append(who)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(w) == 1 for w in wins.values()), wins
    for name, (winner,) in wins.items():
        assert store.read(name) == f"writer {winner}\n".encode(), "the winner's bytes, whole"


def test_files_read_list_replace_and_delete_alike(root: str) -> None:
    store = store_for(root)
    folder = f"{root}/delay_offset"
    assert store.names(folder) == [] and store.read(f"{folder}/x.json") is None
    assert store.create(f"{folder}/00000000000000000001.json", b"one")
    store.write(f"{folder}/00000000000000000002.plan.json", b"plan")
    store.write(f"{folder}/.hidden", b"")
    store.write(f"{folder}/_also_hidden", b"")
    store.write(f"{folder}/sub/inner.json", b"")
    assert store.names(folder) == ["00000000000000000001.json", "00000000000000000002.plan.json"]
    assert store.folders(folder) == ["sub"]
    before = store.identity(f"{folder}/00000000000000000002.plan.json")
    store.write(f"{folder}/00000000000000000002.plan.json", b"plan, again")
    assert store.identity(f"{folder}/00000000000000000002.plan.json") != before
    assert store.read(f"{folder}/00000000000000000002.plan.json") == b"plan, again"
    assert not store.create(f"{folder}/00000000000000000001.json", b"another")
    if root.startswith("s3a://"):  # a PUT retried after its answer was lost finds its bytes
        assert store.create(f"{folder}/00000000000000000001.json", b"one")
    store.delete(f"{folder}/00000000000000000001.json")
    store.delete(f"{folder}/00000000000000000001.json")  # twice: nothing to delete
    assert not store.exists(f"{folder}/00000000000000000001.json")


def test_data_files_are_written_and_read_as_arrow(root: str) -> None:
    store = store_for(root)
    rows = pa.table({"msg_id": ["a", "b"], "n": [1, 2]})
    where = f"{root}/topics/orders/part-00000-x.snappy.parquet"
    size = store.write_parquet(where, rows)
    assert size == len(store.read(where) or b"")
    read = ds.dataset(
        [store.arrow_path(where)], format="parquet", filesystem=store.filesystem
    ).to_table()
    assert read.equals(rows)
