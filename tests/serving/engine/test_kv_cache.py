"""KVCacheManager: exact block ids and eviction order on small cases, tenant isolation of the prefix
cache, and a hypothesis state machine over random allocate / compute / free sequences."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from serving.engine.kv_cache import KVCacheManager, PrefixMatch, num_blocks_for_budget
from serving.engine.sequence import Sequence


def make_seq(
    request_id: str, prompt: list[int], tenant_id: str = "t", cache_group: str | None = None
) -> Sequence:
    return Sequence(request_id, prompt, tenant_id=tenant_id, cache_group=cache_group)


def compute(
    kv: KVCacheManager, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None
) -> None:
    """What the scheduler and runner do for one step: allocate, compute, register full blocks."""
    kv.allocate(seq, num_new_tokens, prefix)
    seq.num_computed_tokens += num_new_tokens
    kv.commit_computed(seq)


def next_chunk(seq: Sequence, chunk: int, token: int) -> int:
    """The token the last step sampled appended, if it sampled one; then how many to compute, up to
    `chunk`: a decode's one, or a prefill's next chunk."""
    if seq.num_computed_tokens == seq.num_tokens:
        seq.append_token(token)
    return min(chunk, seq.num_tokens - seq.num_computed_tokens)


def admit(kv: KVCacheManager, seq: Sequence) -> None:
    prefix = kv.match_prefix(seq)
    compute(kv, seq, seq.num_tokens - prefix.num_tokens, prefix)


def test_num_blocks_for_budget_counts_keys_and_values_in_every_layer() -> None:
    # 2 (K, V) * 2 layers * 4 heads * 8 dims * 2 bytes * 16 tokens = 4096 bytes per block
    kwargs = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "dtype_bytes": 2, "block_size": 16}
    assert num_blocks_for_budget(kv_cache_bytes=4096 * 3 + 4095, **kwargs) == 3
    assert num_blocks_for_budget(kv_cache_bytes=0, **kwargs) == 0
    with pytest.raises(ValueError, match="head_dim"):
        num_blocks_for_budget(kv_cache_bytes=4096, **{**kwargs, "head_dim": 0})
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        num_blocks_for_budget(kv_cache_bytes=-1, **kwargs)


def test_bad_pool_sizes_raise() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, block_size=0)


def test_allocate_grows_the_block_table_one_block_at_a_time() -> None:
    kv = KVCacheManager(10, block_size=4)
    seq = make_seq("a", list(range(10)))
    compute(kv, seq, 6)
    assert seq.block_table == [0, 1]
    compute(kv, seq, 4)
    assert seq.block_table == [0, 1, 2]
    seq.append_token(99)
    assert kv.num_blocks_needed(seq, 1) == 0  # position 10 fits in block 2
    compute(kv, seq, 1)
    seq.append_token(98)
    assert kv.num_blocks_needed(seq, 1) == 0
    compute(kv, seq, 1)  # position 11 fills block 2
    seq.append_token(97)
    assert kv.num_blocks_needed(seq, 1) == 1
    compute(kv, seq, 1)
    assert seq.block_table == [0, 1, 2, 3]
    assert kv.num_free_blocks == 6
    assert kv.usage == pytest.approx(0.4)
    assert kv.num_blocks_by_tenant == {"t": 4}
    kv.free(seq)
    assert seq.block_table == []
    assert kv.num_free_blocks == 10
    assert kv.num_blocks_by_tenant == {}


def test_allocate_beyond_the_pool_raises_and_changes_nothing() -> None:
    kv = KVCacheManager(2, block_size=4)
    seq = make_seq("a", list(range(12)))
    assert not kv.can_allocate(seq, 12)
    with pytest.raises(ValueError, match="not enough free blocks"):
        kv.allocate(seq, 12)
    assert seq.block_table == []
    assert kv.num_free_blocks == 2
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate(seq, 0)


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(10, block_size=4)
    a = make_seq("a", list(range(10)))
    admit(kv, a)  # blocks 0, 1 full and cached; block 2 holds tokens 8-9
    assert a.block_table == [0, 1, 2]
    assert kv.prefix_cache.num_cached_blocks == 2

    b = make_seq("b", [*range(8), 50, 51, 52])
    prefix = kv.match_prefix(b)
    assert prefix.block_ids == (0, 1)
    assert prefix.num_tokens == 8
    assert prefix.num_evictable == 0  # a still uses them
    compute(kv, b, 3, prefix)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_prompt_tokens == 8
    assert [kv.ref_count(i) for i in range(4)] == [2, 2, 1, 1]

    # A prompt that is exactly two full cached blocks reuses only the first: the last token must be
    # computed for its logits.
    c = make_seq("c", list(range(8)))
    assert kv.match_prefix(c).block_ids == (0,)
    assert kv.prefix_cache.num_queries == 2
    assert kv.prefix_cache.num_hit_tokens == 8
    assert kv.prefix_cache_hit_rate == pytest.approx(8 / (10 + 11))


def test_shared_block_returns_to_the_pool_only_when_its_last_user_ends() -> None:
    kv = KVCacheManager(6, block_size=4, is_prefix_caching_enabled=True)
    a = make_seq("a", list(range(9)))
    admit(kv, a)
    b = make_seq("b", list(range(9)))
    admit(kv, b)
    assert a.block_table[:2] == b.block_table[:2] == [0, 1]
    kv.free(a)
    assert kv.ref_count(0) == kv.ref_count(1) == 1
    assert kv.num_free_blocks == 6 - 3  # b holds 0, 1 and its own last block
    kv.free(b)
    assert kv.num_free_blocks == 6
    assert kv.num_used_blocks == 0


def test_freed_cached_blocks_are_evicted_least_recently_freed_first_tail_before_head() -> None:
    kv = KVCacheManager(6, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])  # blocks 0, 1 full; 2 partial
    admit(kv, a)
    b = make_seq("b", [7, 8, 9])  # block 3 full; 4 partial
    admit(kv, b)
    kv.free(a)  # 2 goes back empty; 1 then 0 become evictable
    kv.free(b)  # 4 empty; 3 evictable
    assert kv.num_free_blocks == 6
    assert kv.prefix_cache.num_cached_blocks == 3

    c = make_seq("c", list(range(100, 108)))
    kv.allocate(c, 8)
    # Empty blocks first (5 was never used, then 2 and 4 in the order freed), then evict 1, then 0.
    assert c.block_table == [5, 2, 4, 1]
    assert kv.prefix_cache.num_cached_blocks == 2
    assert not kv.prefix_cache.is_cached(1)
    assert kv.match_prefix(make_seq("a2", [1, 2, 3, 4, 5])).block_ids == (0,)  # the head outlived the tail
    assert kv.match_prefix(make_seq("b2", [7, 8, 9])).block_ids == (3,)


def test_reusing_an_evictable_block_takes_it_out_of_the_free_pool() -> None:
    kv = KVCacheManager(3, block_size=2)
    a = make_seq("a", [1, 2, 3])
    admit(kv, a)
    kv.free(a)
    b = make_seq("b", [1, 2, 5, 6, 7])
    prefix = kv.match_prefix(b)
    assert prefix.block_ids == (0,)
    assert prefix.num_evictable == 1
    assert kv.num_blocks_needed(b, 3, prefix) == 3  # two empty blocks plus the reused one
    compute(kv, b, 3, prefix)
    assert b.block_table == [0, 2, 1]
    assert kv.num_free_blocks == 0


def test_identical_blocks_computed_twice_keep_one_cached_copy_and_the_chain_continues() -> None:
    kv = KVCacheManager(10, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    b = make_seq("b", [1, 2, 3, 4, 5])
    kv.allocate(a, 5, kv.match_prefix(a))
    kv.allocate(b, 5, kv.match_prefix(b))  # admitted in the same step: nothing cached yet
    for seq in (a, b):
        seq.num_computed_tokens = 5
        kv.commit_computed(seq)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3, 4, 5]
    assert kv.prefix_cache.num_cached_blocks == 2  # a's; b's twins stay private
    b.append_token(6)
    b.append_token(7)
    compute(kv, b, 1)  # b fills its third block [5, 6], chained after a's block 1
    c = make_seq("c", [1, 2, 3, 4, 5, 6, 7])
    assert kv.match_prefix(c).block_ids == (0, 1, 5)
    kv.free(b)
    assert sorted(kv._free_block_ids) == [3, 4, 6, 7, 8, 9]  # b's private twins are plain free blocks


def test_prefix_cache_is_private_to_a_tenant_unless_the_group_is_shared() -> None:
    kv = KVCacheManager(16, block_size=4, salt_secret=b"server-secret")
    prompt = list(range(12))
    admit(kv, make_seq("a", prompt, tenant_id="tenant-a"))
    assert kv.match_prefix(make_seq("b", prompt, tenant_id="tenant-b")).block_ids == ()
    assert kv.match_prefix(make_seq("a2", prompt, tenant_id="tenant-a")).block_ids == (0, 1)

    admit(kv, make_seq("c", prompt, tenant_id="tenant-c", cache_group="team"))
    assert kv.match_prefix(make_seq("d", prompt, tenant_id="tenant-d", cache_group="team")).num_tokens == 8
    # A tenant naming another tenant's id as its group is a server-side decision, not a client one;
    # the group "team" is not the same salt as tenant-c's own.
    assert kv.match_prefix(make_seq("c2", prompt, tenant_id="tenant-c")).block_ids == ()
    assert kv.prefix_cache.salt_for("team") != kv.prefix_cache.salt_for("tenant-c")
    other = KVCacheManager(1, salt_secret=b"other")
    assert other.prefix_cache.salt_for("team") != kv.prefix_cache.salt_for("team")


def test_disabled_prefix_caching_never_hits_and_frees_blocks_empty() -> None:
    kv = KVCacheManager(8, block_size=2, is_prefix_caching_enabled=False)
    a = make_seq("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    assert kv.prefix_cache.num_cached_blocks == 0
    kv.free(a)
    assert kv.match_prefix(make_seq("b", [1, 2, 3, 4, 5])).block_ids == ()
    assert kv.prefix_cache.num_queries == 0


def test_match_prefix_needs_a_sequence_without_blocks() -> None:
    kv = KVCacheManager(8, block_size=2)
    a = make_seq("a", [1, 2, 3])
    admit(kv, a)
    with pytest.raises(ValueError, match="holds no blocks"):
        kv.match_prefix(a)
    with pytest.raises(ValueError, match="holds no blocks"):
        kv.allocate(a, 1, kv.match_prefix(make_seq("x", [1, 2, 3])))


# --- property tests -------------------------------------------------------------------------------

BLOCK_SIZE = 2
BASES: tuple[list[int], ...] = ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [7, 7, 7, 7], [])


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions (with prefix hits), chunked computation, decoding and frees over a small pool.
    The model: for every full block a sequence computed, the cache group and all tokens up to the
    block's end, i.e. what its keys and values depend on."""

    @initialize(num_blocks=st.integers(1, 16))
    def setup(self, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, salt_secret=b"test")
        self.live: dict[str, Sequence] = {}
        self.block_to_contents: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.num_added = 0

    @rule(
        base=st.sampled_from(BASES),
        suffix=st.lists(st.integers(0, 3), max_size=4),
        tenant=st.sampled_from(["a", "b"]),
        is_shared=st.booleans(),
        chunk=st.integers(1, 8),
    )
    def admit(self, base: list[int], suffix: list[int], tenant: str, is_shared: bool, chunk: int) -> None:
        prompt = base + suffix or [0]
        seq = make_seq(f"r{self.num_added}", prompt, tenant, "shared" if is_shared else None)
        self.num_added += 1
        prefix = self.kv.match_prefix(seq)
        for index, block_id in enumerate(prefix.block_ids):
            # A hit is exactly what this sequence would have computed itself.
            expected = (seq.prefix_cache_group, tuple(seq.token_ids[: (index + 1) * BLOCK_SIZE]))
            assert self.block_to_contents[block_id] == expected
        assert prefix.num_tokens < seq.num_tokens
        num_new = min(chunk, seq.num_tokens - prefix.num_tokens)
        if not self.kv.can_allocate(seq, num_new, prefix):
            return
        compute(self.kv, seq, num_new, prefix)
        self.live[seq.request_id] = seq
        self._record_on_compute(seq)

    def _record_on_compute(self, seq: Sequence) -> None:
        # Blocks newly full this step were (re)written by this sequence: overwrite the model.
        for index in range(seq.num_computed_tokens // BLOCK_SIZE):
            block_id = seq.block_table[index]
            if self.kv.ref_count(block_id) == 1 or block_id not in self.block_to_contents:
                contents = (seq.prefix_cache_group, tuple(seq.token_ids[: (index + 1) * BLOCK_SIZE]))
                self.block_to_contents[block_id] = contents

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000), chunk=st.integers(1, 8), token=st.integers(0, 3))
    def step(self, pick: int, chunk: int, token: int) -> None:
        seq = list(self.live.values())[pick % len(self.live)]
        num_new = next_chunk(seq, chunk, token)
        if not self.kv.can_allocate(seq, num_new):
            return
        compute(self.kv, seq, num_new)
        self._record_on_compute(seq)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000))
    def free(self, pick: int) -> None:
        seq = list(self.live.values())[pick % len(self.live)]
        del self.live[seq.request_id]
        held = list(seq.block_table)
        self.kv.free(seq)
        still_held = {b for other in self.live.values() for b in other.block_table}
        for block_id in held:
            # A shared block survives until its last user ends.
            assert (self.kv.ref_count(block_id) > 0) == (block_id in still_held)

    @rule(tenant=st.sampled_from(["a", "b"]))
    def lend_for_a_probe(self, tenant: str) -> None:
        """The engine's device probe borrows an empty block: the prefix cache loses nothing and its
        statistics do not see it."""
        kv, cache = self.kv, self.kv.prefix_cache
        before = (cache.num_cached_blocks, cache.num_queries, cache.num_query_tokens)
        num_empty = kv.num_empty_blocks
        probe = make_seq(f"probe{self.num_added}", [0], tenant, None)
        lent = kv.lend_empty_block(probe)
        assert lent == (num_empty > 0)
        assert len(probe.block_table) == int(lent)
        kv.check_invariants([*self.live.values(), probe])
        kv.free(probe)
        assert (cache.num_cached_blocks, cache.num_queries, cache.num_query_tokens) == before

    @rule()
    def free_all(self) -> None:
        for seq in self.live.values():
            self.kv.free(seq)
        self.live.clear()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.num_used_blocks == 0
        assert self.kv.num_blocks_by_tenant == {}

    @invariant()
    def consistent(self) -> None:
        kv = self.kv
        kv.check_invariants(self.live.values())
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
        for seq in self.live.values():
            # Tables cover exactly what was computed: waste under one block per sequence.
            assert len(seq.block_table) * BLOCK_SIZE - seq.num_computed_tokens < BLOCK_SIZE
            assert len(set(seq.block_table)) == len(seq.block_table)


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
