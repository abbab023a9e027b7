"""Reading the Kafka ingest's stream checkpoint: the offsets of the last stored batch."""

from __future__ import annotations

from pathlib import Path

from engine.produce.ingest_lag import stored_offsets


def _batch(folder: Path, batch: int, offsets: str, committed: bool) -> None:
    (folder / "offsets").mkdir(parents=True, exist_ok=True)
    (folder / "commits").mkdir(parents=True, exist_ok=True)
    metadata = '{"batchWatermarkMs":0,"batchTimestampMs":1}'
    (folder / "offsets" / str(batch)).write_text(f"v1\n{metadata}\n{offsets}\n")
    if committed:
        (folder / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}\n')


def test_the_last_committed_batch_counts_not_one_in_flight(tmp_path: Path) -> None:
    _batch(tmp_path, 0, '{"in":{"0":5,"1":2}}', committed=True)
    _batch(tmp_path, 1, '{"in":{"0":9,"1":4}}', committed=True)
    _batch(tmp_path, 2, '{"in":{"0":20,"1":7}}', committed=False)  # planned, not stored
    (tmp_path / "commits" / ".1.crc").write_text("")
    assert stored_offsets(str(tmp_path)) == {("in", 0): 9, ("in", 1): 4}


def test_no_stored_batch_is_no_figure(tmp_path: Path) -> None:
    assert stored_offsets(str(tmp_path)) is None
    _batch(tmp_path, 0, '{"in":{"0":5}}', committed=False)
    assert stored_offsets(str(tmp_path)) is None


def test_a_batch_stored_but_not_recorded_by_spark_counts(tmp_path: Path) -> None:
    _batch(tmp_path, 0, '{"in":{"0":5}}', committed=True)
    _batch(tmp_path, 1, '{"in":{"0":9}}', committed=False)  # in commitlog, Spark killed
    assert stored_offsets(str(tmp_path), stored_batch=1) == {("in", 0): 9}
    assert stored_offsets(str(tmp_path), stored_batch=0) == {("in", 0): 5}
    assert stored_offsets(str(tmp_path), stored_batch=4) == {("in", 0): 5}  # no offsets/4
