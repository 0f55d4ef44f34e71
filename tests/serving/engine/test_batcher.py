"""The dynamic batcher: a batch closes when full or when its oldest item has waited max_wait, and what
closes it groups items of like length."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.batcher import BatcherConfig, BatchItem, CloseReason, DynamicBatcher


def _batcher(max_batch_size: int = 4, max_wait_s: float = 0.010, max_batch_tokens: int = 10_000):
    return DynamicBatcher(BatcherConfig(max_batch_size, max_wait_s, max_batch_tokens))


def test_a_lone_item_waits_its_delay_then_goes_alone() -> None:
    batcher = _batcher()
    batcher.add(BatchItem("a", 5, arrived_at=1.0))
    assert batcher.wait_s(1.004) == pytest.approx(0.006)
    assert batcher.take(1.004) is None
    batch = batcher.take(1.010)
    assert batch is not None and [i.key for i in batch.items] == ["a"]
    assert batch.reason is CloseReason.TIMEOUT and batch.fill_time_s == pytest.approx(0.010)
    assert batcher.wait_s(1.010) is None and len(batcher) == 0


def test_a_full_batch_closes_at_once_and_the_next_item_starts_a_new_wait() -> None:
    batcher = _batcher(max_batch_size=3)
    for i, t in enumerate((1.0, 1.001, 1.002, 1.003)):
        batcher.add(BatchItem(i, 8, arrived_at=t))
    assert batcher.wait_s(1.003) == 0
    batch = batcher.take(1.003)
    assert batch is not None and batch.reason is CloseReason.FULL
    assert [i.key for i in batch.items] == [0, 1, 2]
    assert batcher.wait_s(1.003) == pytest.approx(0.010)  # item 3 arrived at 1.003
    assert batcher.num_closed == {CloseReason.FULL: 1, CloseReason.TIMEOUT: 0}


def test_a_batch_takes_items_nearest_the_oldest_in_length() -> None:
    batcher = _batcher(max_batch_size=3)
    lengths = {"oldest": 10, "long": 200, "near": 12, "short": 3, "nearest": 10}
    for t, (key, length) in enumerate(lengths.items()):
        batcher.add(BatchItem(key, length, arrived_at=1.0 + t * 0.001))
    batch = batcher.take(1.005)  # full: five pending
    assert batch is not None and [i.key for i in batch.items] == ["oldest", "nearest", "near"]
    assert batch.padded_tokens == 3 * 12


def test_a_backlog_is_grouped_by_length_and_an_odd_length_waits_only_until_it_is_oldest() -> None:
    batcher = _batcher(max_batch_size=2, max_wait_s=0.010)
    for t, (key, length) in enumerate([("a", 10), ("odd", 300), ("b", 11), ("c", 12), ("d", 9)]):
        batcher.add(BatchItem(key, length, arrived_at=1.0 + t * 0.001))
    now = 1.1  # every item has waited its delay
    batches = [[i.key for i in batcher.take(now).items] for _ in range(3)]  # type: ignore[union-attr]
    assert batches == [["a", "b"], ["odd", "c"], ["d"]]  # b before d: equally near, earlier


def test_the_padded_token_cap_skips_items_that_would_overflow_it() -> None:
    batcher = _batcher(max_batch_size=4, max_batch_tokens=100)
    batcher.add(BatchItem("a", 40, arrived_at=1.0))
    batcher.add(BatchItem("b", 60, arrived_at=1.001))  # 2 x 60 = 120 > 100
    batcher.add(BatchItem("c", 30, arrived_at=1.002))  # 2 x 40 = 80
    batch = batcher.take(1.010)
    assert batch is not None and [i.key for i in batch.items] == ["a", "c"]
    assert [i.key for i in batcher.take(1.020).items] == ["b"]  # type: ignore[union-attr]


def test_an_item_no_batch_could_hold_or_a_duplicate_key_is_refused_and_nothing_is_added() -> None:
    batcher = _batcher(max_batch_tokens=100)
    with pytest.raises(ValueError, match="does not fit"):
        batcher.add(BatchItem("big", 101, arrived_at=1.0))
    with pytest.raises(ValueError, match="does not fit"):
        batcher.add(BatchItem("empty", 0, arrived_at=1.0))
    batcher.add(BatchItem("a", 5, arrived_at=1.0))
    with pytest.raises(ValueError, match="already pending"):
        batcher.add(BatchItem("a", 5, arrived_at=1.0))
    assert len(batcher) == 1


def test_a_removed_item_is_never_batched_and_the_next_oldest_sets_the_wait() -> None:
    batcher = _batcher()
    batcher.add(BatchItem("a", 5, arrived_at=1.0))
    batcher.add(BatchItem("b", 5, arrived_at=1.005))
    assert batcher.remove("a") and not batcher.remove("a")
    assert batcher.wait_s(1.006) == pytest.approx(0.009)
    assert [i.key for i in batcher.take(1.015).items] == ["b"]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "config",
    [
        dict(max_batch_size=0),
        dict(max_wait_s=-0.001),
        dict(max_wait_s=float("nan")),
        dict(max_batch_tokens=0),
    ],
)
def test_a_config_that_could_never_close_a_batch_is_refused(config: dict) -> None:
    with pytest.raises(ValueError, match="must be at least"):
        BatcherConfig(**config)


# A run: items arrive (with a length) or are removed, and time passes; the caller takes every batch that
# is due at each moment, as the replica's model thread does.
_operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 64)),
        st.tuples(st.just("remove"), st.integers(0, 40)),
        st.tuples(st.just("advance"), st.floats(0.0, 0.02)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    operations=_operations,
    max_batch_size=st.integers(1, 6),
    max_wait_s=st.sampled_from([0.0, 0.001, 0.005, 0.01]),
    max_batch_tokens=st.integers(64, 256),
)
def test_every_item_is_batched_once_within_limits_whenever_a_batch_is_due(
    operations: list, max_batch_size: int, max_wait_s: float, max_batch_tokens: int
) -> None:
    batcher = _batcher(max_batch_size, max_wait_s, max_batch_tokens)
    now = 0.0
    added: dict[int, BatchItem] = {}
    removed: set[int] = set()
    batched: list[int] = []

    def take_due() -> None:
        while (due := batcher.wait_s(now)) == 0:
            oldest = min((k for k in added if k not in removed and k not in batched), key=lambda k: k)
            batch = batcher.take(now)
            assert batch is not None
            keys = [item.key for item in batch.items]
            assert keys[0] == oldest  # the oldest pending item always goes
            assert 1 <= len(keys) <= max_batch_size
            assert len(keys) == 1 or batch.padded_tokens <= max_batch_tokens
            if batch.reason is CloseReason.TIMEOUT:
                assert now - added[oldest].arrived_at >= max_wait_s - 1e-12
                assert len(keys) < max_batch_size or len(batcher) == 0
            batched.extend(keys)
        assert due is None or due > 0
        assert batcher.take(now) is None  # nothing more is due

    for operation, value in operations:
        if operation == "add":
            key = len(added)
            added[key] = BatchItem(key, value, arrived_at=now)
            batcher.add(added[key])
        elif operation == "remove":
            if batcher.remove(value):
                removed.add(value)
        else:
            now += value
        take_due()
    now += max_wait_s  # everything left is due by now
    take_due()
    assert len(batcher) == 0
    assert sorted(batched) == sorted(set(added) - removed)  # each item once, none removed batched
    assert not removed & set(batched)
