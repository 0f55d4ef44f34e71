"""Half-block tails (serving/engine/half_blocks.py, kv_cache.py): a hypothesis state machine over a pool
whose slots hold what a runner would write there. Through admissions (with prefix hits), chunks,
decodes, tail moves and frees, every computed position of every live sequence reads, through its
block table, exactly the keys and values it wrote (modelled as its cache group and tokens so far), and
the allocator's forecasts (blocks needed, tokens fitting) hold."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from serving.engine.half_blocks import HalfBlocks, half_entry, half_of, is_half
from serving.engine.kv_cache import KVCacheManager
from serving.engine.sequence import Sequence
from tests.serving.engine.test_kv_cache import next_chunk

BLOCK_SIZE = 4
PROMPTS: tuple[list[int], ...] = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5], [7, 7], [3])

Contents = tuple[str, tuple[int, ...]]


def slot_of(entry: int, position: int) -> int:
    if is_half(entry):
        block, half = half_of(entry)
        return block * BLOCK_SIZE + half * BLOCK_SIZE // 2 + position % BLOCK_SIZE
    return entry * BLOCK_SIZE + position % BLOCK_SIZE


def test_a_half_entry_names_its_block_and_half() -> None:
    assert [half_of(half_entry(b, h)) for b in (0, 1, 7) for h in (0, 1)] == [
        (b, h) for b in (0, 1, 7) for h in (0, 1)
    ]
    assert all(is_half(half_entry(b, h)) for b in (0, 5) for h in (0, 1))


def test_two_tails_share_a_block_and_it_returns_whole_when_both_leave() -> None:
    halves = HalfBlocks(BLOCK_SIZE)
    first = halves.split(3)
    second = halves.take()
    assert (half_of(first), second is not None and half_of(second)) == ((3, 0), (3, 1))
    assert halves.take() is None
    assert halves.release(first) is None  # the other tail still lives there
    assert second is not None and halves.release(second) == 3


def test_half_block_tails_need_an_even_block_size() -> None:
    with pytest.raises(ValueError, match="even block_size"):
        KVCacheManager(4, block_size=5, half_block_tails=True)


def test_a_short_tail_takes_half_a_block_and_a_longer_one_grows_in_place() -> None:
    kv = KVCacheManager(4, BLOCK_SIZE, half_block_tails=True, salt_secret=b"test")
    seq = Sequence("a", [1, 2, 3, 4, 5, 6])
    kv.allocate(seq, 6)  # a whole block and 2 tokens: half a block
    assert seq.block_table[0] >= 0 and is_half(seq.block_table[1])
    assert kv.num_slots(seq) == 6
    seq.num_computed_tokens = 6
    seq.append_token(7)
    kv.allocate(seq, 1)  # a third token in the tail: its block's other half is free, so it takes it
    assert not is_half(seq.block_table[1])
    assert kv.take_copies() == []


class HalfBlocksMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12))
    def setup(self, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, salt_secret=b"test", half_block_tails=True)
        self.live: dict[str, Sequence] = {}
        self.pool: dict[int, Contents] = {}  # slot -> what was written there
        self.num_added = 0

    def _contents(self, seq: Sequence, position: int) -> Contents:
        return seq.prefix_cache_group, tuple(seq.token_ids[: position + 1])

    def _step(self, seq: Sequence, num_new: int, prefix: object = None) -> None:
        """Allocate as the scheduler does, then move tails and write as the runner does, then commit."""
        kv = self.kv
        predicted = kv.num_blocks_needed(seq, num_new, prefix)  # type: ignore[arg-type]
        charged = kv.num_entries_added(seq, num_new) if prefix is None else None
        num_free, num_entries = kv.num_free_blocks, len(seq.block_table)
        kv.allocate(seq, num_new, prefix)  # type: ignore[arg-type]
        assert num_free - kv.num_free_blocks <= predicted, "allocate takes no more than forecast"
        assert charged is None or len(seq.block_table) - num_entries == charged, "its tenant charged as said"
        for move in kv.take_copies():
            src = move.src_block * BLOCK_SIZE + move.src_column
            for i in range(move.num_tokens):
                self.pool[move.dst_block * BLOCK_SIZE + i] = self.pool[src + i]
        table = seq.block_table
        for position in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            self.pool[slot_of(table[position // BLOCK_SIZE], position)] = self._contents(seq, position)
        seq.num_computed_tokens += num_new
        kv.commit_computed(seq)

    @rule(
        prompt=st.sampled_from(PROMPTS),
        suffix=st.lists(st.integers(0, 3), max_size=3),
        is_shared=st.booleans(),
        chunk=st.integers(1, 9),
    )
    def admit(self, prompt: list[int], suffix: list[int], is_shared: bool, chunk: int) -> None:
        seq = Sequence(f"r{self.num_added}", prompt + suffix, cache_group="shared" if is_shared else None)
        self.num_added += 1
        prefix = self.kv.match_prefix(seq)
        num_new = min(chunk, seq.num_tokens - prefix.num_tokens)
        if not self.kv.can_allocate(seq, num_new, prefix):
            return
        self._step(seq, num_new, prefix)
        self.live[seq.request_id] = seq

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000), chunk=st.integers(1, 9), token=st.integers(0, 3))
    def step(self, pick: int, chunk: int, token: int) -> None:
        seq = list(self.live.values())[pick % len(self.live)]
        num_new = next_chunk(seq, chunk, token)
        if not self.kv.can_allocate(seq, num_new):
            return
        self._step(seq, num_new)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000), num_blocks=st.integers(0, 3), num_entries=st.none() | st.integers(0, 3))
    def tokens_fitting(self, pick: int, num_blocks: int, num_entries: int | None) -> None:
        """The chunk a prefill may take: within the free blocks and its tenant's room, and the most."""
        kv = self.kv
        seq = list(self.live.values())[pick % len(self.live)]
        n = kv.num_tokens_fitting(seq, num_blocks, num_entries)

        def fits(count: int) -> bool:
            within_room = num_entries is None or kv.num_entries_added(seq, count) <= num_entries
            return kv.num_blocks_needed(seq, count) <= num_blocks and within_room

        assert n == 0 or fits(n)
        assert not fits(n + 1), "the most that fits"

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000))
    def free(self, pick: int) -> None:
        seq = list(self.live.values())[pick % len(self.live)]
        del self.live[seq.request_id]
        self.kv.free(seq)

    @invariant()
    def every_sequence_reads_what_it_wrote(self) -> None:
        kv = self.kv
        kv.check_invariants(self.live.values())
        for seq in self.live.values():
            for position in range(seq.num_computed_tokens):
                slot = slot_of(seq.block_table[position // BLOCK_SIZE], position)
                assert self.pool.get(slot) == self._contents(seq, position), (seq.request_id, position)
            # The tail: in half a block while it fits one, else in a whole block more than half full.
            assert kv.num_slots(seq) - seq.num_computed_tokens < BLOCK_SIZE // 2, seq.block_table


TestHalfBlocksMachine = HalfBlocksMachine.TestCase
TestHalfBlocksMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
