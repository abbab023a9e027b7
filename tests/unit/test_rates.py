"""Delivery rate caps as a pure split of a round's due rows (engine.deliver.rates)."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from engine.core.config import EngineConfig
from engine.core.errors import ConfigError
from engine.deliver.due import TS
from engine.deliver.rates import BURST_S, TopicRate, cap_rows, cursors, state_json, state_of

S = 1_000_000  # one second in us


def rows(topic: str, n: int, at_us: int, batch: int = 1, start: int = 0) -> pa.Table:
    return pa.table(
        {
            "topic": pa.array([topic] * n, pa.string()),
            "msg_id": pa.array([f"m{start + i:05d}" for i in range(n)], pa.string()),
            "revision": pa.array([None] * n, pa.int32()),
            "deliver_ts": pa.array([at_us] * n, TS),
            "stamp_batch": pa.array([batch] * n, pa.int64()),
            "queue_id": pa.array([-1] * n, pa.int32()),
        }
    )


def ids(table: pa.Table) -> list[str]:
    return table["msg_id"].to_pylist()  # type: ignore[no-any-return]


def test_a_burst_goes_at_the_cap_in_key_order_and_the_rest_waits_above_a_cursor() -> None:
    due = rows("Orders", 1000, 10 * S)
    first = cap_rows(due, {"orders": 100.0}, {}, watermark_us=10 * S + S // 10, after_us=9 * S)
    # 0.1 s after the instant at 100/s: the row at the instant and 10 more
    assert ids(first.deliver) == [f"m{i:05d}" for i in range(11)]
    assert first.new_waiting.num_rows == 989
    state = first.state["orders"]
    assert state.cursor == (10 * S, "m00010", 0)
    assert (state.waiting, state.rate) == (989, 100.0)
    assert state.clears_us() == 20 * S, "989 more at 100/s after the next allowed time"
    # the next round reads the rows above the cursor again, or has them kept; 0.5 s more
    # lets 50 go either way
    w2 = 10 * S + 6 * S // 10
    above = due.filter(pc.greater(due["msg_id"], "m00010"))
    again = cap_rows(above, {"orders": 100.0}, first.state, w2, 0)
    kept = cap_rows(due.slice(0, 0), {"orders": 100.0}, first.state, w2, 0, first.backlogs)
    for second in (again, kept):
        assert ids(second.deliver) == [f"m{i:05d}" for i in range(11, 61)]
        assert second.state["orders"].cursor == (10 * S, "m00060", 0)
    assert kept.new_waiting.num_rows == 0, "nothing read this round waits"


def test_uncapped_topics_pass_untouched_and_a_default_cap_covers_the_rest() -> None:
    due = pa.concat_tables([rows("audit", 5, S), rows("orders", 5, S, start=5)])
    out = cap_rows(due, {"*": 1.0, "audit": 0.0}, {}, watermark_us=S, after_us=0)
    assert sorted(ids(out.deliver)) == ["m00000", "m00001", "m00002", "m00003", "m00004", "m00005"]
    assert set(out.state) == {"orders"}


def test_rows_stamped_late_below_the_floor_always_go_and_the_cursor_never_drops_below_it() -> None:
    # the previous round's watermark was 5 s: a row due at 3 s stamped since must go now,
    # or a cursor behind it would make rows already delivered (due 3-5 s) look waiting
    late = rows("orders", 3, 3 * S, batch=9)
    new = rows("orders", 10, 6 * S, start=3)
    prior = {"orders": TopicRate(tat_ns=6 * S * 1000 + 10**9, cursor=None)}
    out = cap_rows(pa.concat_tables([new, late]), {"orders": 1.0}, prior, 6 * S, 5 * S)
    assert ids(out.deliver) == ["m00000", "m00001", "m00002"]
    assert out.state["orders"].cursor == (5 * S, "\U0010ffff", 2**62), "the floor, not 3 s"
    assert out.state["orders"].waiting == 10


def test_a_cap_taken_away_lets_every_waiting_row_go() -> None:
    waiting = {"orders": TopicRate(tat_ns=0, cursor=(S, "m00000", 0), waiting=4, rate=1.0)}
    out = cap_rows(rows("orders", 4, S, start=1), {}, waiting, watermark_us=2 * S, after_us=S)
    assert out.deliver.num_rows == 4 and out.state == {}


def test_unused_allowance_is_kept_one_second_at_most() -> None:
    idle = {"orders": TopicRate(tat_ns=0)}
    out = cap_rows(rows("orders", 500, 100 * S), {"orders": 100.0}, idle, 103 * S, 99 * S)
    assert out.deliver.num_rows == 100 * BURST_S + 1


def test_the_split_is_the_same_every_time_and_the_state_round_trips() -> None:
    due = pa.concat_tables([rows("orders", 50, 2 * S, start=50), rows("orders", 50, S)])
    one = cap_rows(due, {"orders": 7.0}, {}, 3 * S, 0)
    two = cap_rows(due.take(list(range(99, -1, -1))), {"orders": 7.0}, {}, 3 * S, 0)
    assert ids(one.deliver) == ids(two.deliver) and one.state == two.state
    assert state_of(state_json(one.state)) == one.state


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"delivery.max_rate": "fast"}, "delivery.max_rate='fast'"),
        ({"delivery.max_rate": "10/d"}, "delivery.max_rate='10/d'"),
        ({"topics.orders.max_rate": "-5/s"}, "topics.orders.max_rate='-5/s'"),
        ({"topics.orders.rate": "5/s"}, "topics.orders.rate='5/s'"),
        ({"topics.9x.max_rate": "5/s"}, "topics.9x.max_rate='5/s'"),
    ],
)
def test_a_bad_cap_fails_at_start_naming_key_and_value(
    settings: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=named.replace("/", "/").replace(".", r"\.")):
        EngineConfig.from_mapping(settings)


def test_caps_read_from_settings() -> None:
    cfg = EngineConfig.from_mapping({"delivery.max_rate": "6000/m", "topics.Audit.max_rate": "off"})
    assert cfg.rates() == {"*": 100.0, "audit": 0.0}
    assert EngineConfig().rates() == {}


def test_rounds_that_keep_the_backlog_deliver_what_rounds_reading_it_again_deliver() -> None:
    # rows arrive over time, some stamped late (due before the last watermark); each round
    # is split twice: reading every waiting row again, and keeping them from the last round
    rng = random.Random(5)
    arrivals = [
        rows("orders", rng.randint(0, 40), at, batch=b, start=1000 * b)
        for b, at in enumerate(rng.randint(0, 30) * S // 10 for _ in range(30))
    ]
    caps = {"orders": 25.0}
    state: dict[str, TopicRate] = {}
    backlogs: dict = {}  # type: ignore[type-arg]
    stamped: list[pa.Table] = []
    delivered: set[str] = set()
    w_prev = 0
    for b, batch in enumerate(arrivals):
        w = (b + 1) * S // 10
        stamped.append(batch)
        everything = pa.concat_tables(stamped)
        due = everything.filter(pc.less_equal(pc.cast(everything["deliver_ts"], pa.int64()), w))
        held = cursors(state).get("orders")
        keys = zip(
            pc.cast(due["deliver_ts"], pa.int64()).to_pylist(),
            due["msg_id"].to_pylist(),
            due["stamp_batch"].to_pylist(),
            strict=True,
        )
        # every row not delivered yet: new this round, above the cursor, or due since
        waiting = [
            bool(stamp >= b or ((us, i, 0) > held if held else us > w_prev))
            for us, i, stamp in keys
        ]
        full = cap_rows(due.filter(pa.array(waiting, pa.bool_())), caps, state, w, w_prev)
        recent = pc.or_(
            pc.greater(pc.cast(due["deliver_ts"], pa.int64()), w_prev),
            pc.greater_equal(due["stamp_batch"], b),
        )
        kept = cap_rows(due.filter(recent), caps, state, w, w_prev, backlogs)
        assert ids(full.deliver) == ids(kept.deliver), f"round {b}"
        assert full.state == kept.state
        assert not delivered & set(ids(full.deliver)), "delivered twice"
        delivered |= set(ids(full.deliver))
        state, backlogs, w_prev = full.state, kept.backlogs, w
    assert delivered <= set(ids(pa.concat_tables(stamped)))


def test_a_row_cancelled_while_it_waits_is_left_out_before_the_split_either_way() -> None:
    # a replay reads the waiting rows again, without the cancelled one: a round keeping them
    # must split the same way, or the replay would commit another cursor
    due = rows("orders", 100, 10 * S)
    first = cap_rows(due, {"orders": 10.0}, {}, 10 * S, 9 * S)
    gone = frozenset({"m00003\x000", "m00005\x000"})
    w = 10 * S + S // 2
    above = due.filter(pc.greater(due["msg_id"], "m00000"))
    read = above.filter(pc.invert(pc.is_in(above["msg_id"], pa.array(["m00003", "m00005"]))))
    again = cap_rows(read, {"orders": 10.0}, first.state, w, 0)
    kept = cap_rows(due.slice(0, 0), {"orders": 10.0}, first.state, w, 0, first.backlogs, gone)
    assert ids(kept.deliver) == ids(again.deliver) == ["m00001", "m00002", "m00004", "m00006",
                                                       "m00007"]  # fmt: skip
    assert kept.state == again.state


def test_rows_of_one_key_go_together() -> None:
    # (two rows with one id and time, possible with deduplication off): a cursor between
    # them would leave the second neither delivered nor waiting
    same = pa.concat_tables([rows("orders", 1, S), rows("orders", 1, S)])
    out = cap_rows(same, {"orders": 1.0}, {}, watermark_us=S, after_us=0)
    assert ids(out.deliver) == ["m00000", "m00000"]
