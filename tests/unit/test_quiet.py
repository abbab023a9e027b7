"""When the delivery query may hold its watermark (``engine.deliver.quiet``)."""

from __future__ import annotations

from pathlib import Path

from engine.deliver.quiet import Quiet, load_quiet, next_due_us, next_offset, save_quiet
from engine.lakehouse.delta.live_files import DataFile


def _file(low: int | None, high: int | None) -> DataFile:
    stats = {"deliver_ts": low} if low is not None else {}
    tops = {"deliver_ts": high} if high is not None else {}
    return DataFile("f", {}, 1, low=stats, high=tops)


def test_the_next_due_time_is_the_earliest_minimum_above_the_watermark() -> None:
    files = [_file(10, 20), _file(300, 400), _file(150, 160)]
    assert next_due_us(files, watermark_us=100) == 150


def test_nothing_left_above_the_watermark_means_no_due_time() -> None:
    assert next_due_us([_file(10, 20), _file(30, 100)], watermark_us=100) is None
    assert next_due_us([], watermark_us=100) is None


def test_a_file_straddling_the_watermark_or_without_statistics_may_be_due_at_once() -> None:
    assert next_due_us([_file(50, 200), _file(500, 600)], watermark_us=100) == 101
    assert next_due_us([_file(None, None), _file(500, 600)], watermark_us=100) == 101


def _quiet(due_us: int | None = 5_000_000) -> Quiet:
    return Quiet(batch_end_ms=1_000, due_us=due_us, schedule=3, commands=-1)


def _never(_q: Quiet) -> bool:
    return False


def test_a_hold_needs_a_record_of_the_last_batch() -> None:
    assert next_offset(_quiet(), 1_000, 1_200, 1_400, 1_000, _never) == 1_000  # held
    assert next_offset(None, 1_000, 1_200, 1_400, 1_000, _never) == 1_200
    assert next_offset(_quiet(), 800, 1_200, 1_400, 1_000, _never) == 1_200  # (another batch's)


def test_a_hold_ends_when_the_planned_watermark_reaches_the_next_due_time() -> None:
    assert next_offset(_quiet(due_us=1_200_000), 1_000, 1_200, 1_400, 1_000, _never) == 1_200
    assert next_offset(_quiet(due_us=None), 1_000, 1_900, 2_100, 1_000, _never) == 1_000


def test_a_row_due_before_the_next_trigger_gets_a_batch_planned_at_its_time() -> None:
    """Held, the next trigger (200 ms on) would plan past the row and show it up to a poll
    interval late; this batch is planned at its time instead (rounded up to the ms)."""
    assert next_offset(_quiet(due_us=1_300_001), 1_000, 1_150, 1_350, 1_000, _never) == 1_301
    assert next_offset(_quiet(due_us=1_350_000), 1_000, 1_150, 1_350, 1_000, _never) == 1_350
    assert next_offset(_quiet(due_us=1_350_001), 1_000, 1_150, 1_350, 1_000, _never) == 1_000
    # without a lead (delivery.max_lead = off) the reach is the planned watermark: held
    assert next_offset(_quiet(due_us=1_300_000), 1_000, 1_150, 1_150, 1_000, _never) == 1_000
    assert (
        next_offset(_quiet(due_us=1_300_000), 1_000, 1_150, 1_350, 100, _never) == 1_300
    )  # (idle)


def test_a_hold_lasts_at_most_the_idle_interval_and_never_with_it_off() -> None:
    assert next_offset(_quiet(), 1_000, 1_999, 2_199, 1_000, _never) == 1_000
    assert next_offset(_quiet(), 1_000, 2_000, 2_200, 1_000, _never) == 2_000
    assert next_offset(_quiet(), 1_000, 1_001, 1_201, 0, _never) == 1_001


def test_a_new_version_of_schedule_or_commands_ends_a_hold() -> None:
    asked: list[Quiet] = []

    def newer(q: Quiet) -> bool:
        asked.append(q)
        return True

    assert next_offset(_quiet(), 1_000, 1_200, 1_400, 1_000, newer) == 1_200
    assert next_offset(_quiet(due_us=1_300_000), 1_000, 1_200, 1_400, 1_000, newer) == 1_200
    assert asked == [_quiet(), _quiet(due_us=1_300_000)]


def test_the_record_is_saved_whole_and_removed(tmp_path: Path) -> None:
    path = str(tmp_path / "quiet.json")
    save_quiet(path, _quiet())
    assert load_quiet(path) == _quiet()
    save_quiet(path, None)
    assert load_quiet(path) is None
    (tmp_path / "quiet.json").write_text("{not json")
    assert load_quiet(path) is None
    assert [p.name for p in tmp_path.iterdir()] == ["quiet.json"]  # (no part left)
