"""Block bookkeeping for the paged KV cache: which fixed-size blocks (or, for a short tail, half of one:
half_blocks.py) each sequence holds, reference counts for shared prompt prefixes, and the free pools,
from which unused blocks of the prefix cache (prefix_cache.py) are evicted on demand. The tensors live
in the runner; this module only hands out block ids, so it imports no torch."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from serving.engine.half_blocks import HalfBlocks, TailCopy, entries_added, is_half, tail_half, tail_shape
from serving.engine.prefix_cache import PrefixCache
from serving.engine.sequence import Sequence


def num_blocks_for_budget(
    *,
    kv_cache_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    block_size: int,
) -> int:
    """How many blocks fit in `kv_cache_bytes`: each holds keys and values for `block_size` tokens in
    every layer."""
    sizes = {
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype_bytes": dtype_bytes,
        "block_size": block_size,
    }
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int) or kv_cache_bytes < 0:
        raise ValueError(f"kv_cache_bytes must be an integer >= 0, got {kv_cache_bytes!r}")
    bytes_per_block = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * block_size  # 2: K and V
    return kv_cache_bytes // bytes_per_block


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """Cached full blocks that hold a prefix of a waiting sequence's tokens (from `match_prefix`)."""

    block_ids: tuple[int, ...]
    num_tokens: int
    num_evictable: int  # of block_ids, how many are unused now, so reusing them shrinks the free pool
    parent: bytes | int  # what precedes the first block not matched (prefix_cache.py, _BlockKey)


def blocks_of_share(share: float, num_blocks: int) -> int:
    """A share of a pool of `num_blocks`, in whole blocks, at least one: a tenant's cap."""
    return max(1, int(share * num_blocks))


class KVCacheManager:
    """A pool of `num_blocks` blocks of `block_size` token slots. It owns `seq.block_table` of every
    sequence it allocates for, until `free(seq)`. With `half_block_tails`, a sequence's last block is a
    half (half_blocks.py) while its tail fits one, and the runner must carry out `take_copies()` before
    each step."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        is_prefix_caching_enabled: bool = True,
        salt_secret: bytes | None = None,
        half_block_tails: bool = False,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if half_block_tails and block_size % 2:
            raise ValueError(f"half-block tails need an even block_size, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.half_block_tails = half_block_tails
        self._halves = HalfBlocks(block_size)
        self.prefix_cache = PrefixCache(
            num_blocks, block_size, is_enabled=is_prefix_caching_enabled, salt_secret=salt_secret
        )
        self._ref_counts = [0] * num_blocks
        self._free_block_ids: collections.deque[int] = collections.deque(range(num_blocks))  # no contents
        # Unused blocks whose contents are still cached, least recently freed first: reusable until
        # the allocator runs out of empty blocks.
        self._evictable_block_ids: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._num_blocks_by_tenant: dict[str, int] = {}

    # --- gauges -----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks the allocator can hand out: empty ones plus unused cached ones (evicted on demand)."""
        return len(self._free_block_ids) + len(self._evictable_block_ids)

    @property
    def num_empty_blocks(self) -> int:
        """Free blocks without cached contents: taking one evicts nothing."""
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_blocks_by_tenant(self) -> Mapping[str, int]:
        """Block references held by each tenant's live sequences (a block shared by two sequences
        counts for both holders); tenants holding none are absent."""
        return self._num_blocks_by_tenant

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache.hit_rate

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # --- prefix cache -----------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The longest run of cached full blocks equal to the start of `seq.token_ids`, without taking
        them. At least one token is left out so the step that computes it yields logits."""
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"{seq.request_id}: match_prefix needs a sequence that holds no blocks")
        block_ids, parent = self.prefix_cache.match(seq)
        num_evictable = sum(self._ref_counts[block_id] == 0 for block_id in block_ids)
        return PrefixMatch(tuple(block_ids), len(block_ids) * self.block_size, num_evictable, parent)

    def commit_computed(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that became full and computed, so later sequences can reuse them.
        The scheduler calls this after every step that advanced `seq.num_computed_tokens`."""
        self.prefix_cache.commit(seq)

    # --- allocation -------------------------------------------------------------------------------

    def num_slots(self, seq: Sequence) -> int:
        """Token slots `seq`'s table gives it: a block each, half a block for a tail in a half."""
        table = seq.block_table
        return len(table) * self.block_size - (0 if tail_half(table) is None else self.block_size // 2)

    def num_entries_added(self, seq: Sequence, num_new_tokens: int) -> int:
        """Entries `allocate(seq, num_new_tokens)` adds to `seq`'s table: what its tenant is charged."""
        num_tokens = seq.num_computed_tokens + num_new_tokens
        return entries_added(seq.block_table, num_tokens, self.block_size, self.half_block_tails)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> int:
        """Free blocks that `allocate(seq, num_new_tokens, prefix)` would take from the pool."""
        table = seq.block_table
        tail = tail_half(table) if prefix is None else None
        num_computed, num_whole, num_taken = (
            (seq.num_computed_tokens, len(table) - (tail is not None), 0)
            if prefix is None
            else (prefix.num_tokens, len(prefix.block_ids), prefix.num_evictable)
        )
        num_full, wants_half = tail_shape(
            num_computed + num_new_tokens, self.block_size, self.half_block_tails
        )
        num_open = self._halves.num_open_blocks
        if tail is not None:
            if num_full <= num_whole:
                return num_taken  # the tokens fit the tail's half
            if self._halves.can_grow_in_place(tail):
                num_open -= 1  # its own block's other half, taken to make it whole
            else:
                num_taken += 1  # a whole block to move it into
            num_whole += 1
        num_taken += max(0, num_full - num_whole)
        return num_taken + (wants_half and num_open == 0)

    def num_tokens_fitting(self, seq: Sequence, num_blocks: int, num_entries: int | None = None) -> int:
        """The most new tokens `allocate(seq, n)` can give `seq` taking at most `num_blocks` free blocks
        and adding at most `num_entries` to its table (its tenant's room under a cap)."""
        room = num_blocks if num_entries is None else min(num_blocks, num_entries)
        num_slots = self.num_slots(seq) - seq.num_computed_tokens + room * self.block_size
        if not self.half_block_tails:
            return num_slots
        # Halves can add up to a block beyond that (the tail's own block made whole, an open half after
        # it); blocks and entries needed never shrink as n grows.
        return _largest(
            lambda n: (
                self.num_blocks_needed(seq, n) <= num_blocks
                and (num_entries is None or self.num_entries_added(seq, n) <= num_entries)
            ),
            num_slots + self.block_size,
        )

    def can_allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        prefix: PrefixMatch | None = None,
        *,
        num_reserved_blocks: int = 0,
    ) -> bool:
        num_needed = self.num_blocks_needed(seq, num_new_tokens, prefix)
        return num_needed + num_reserved_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> None:
        """Grow `seq.block_table` so positions [0, num_computed + num_new_tokens) have slots. With a
        `prefix` (admission of a sequence that holds nothing), first take its cached blocks and mark
        their tokens computed."""
        if num_new_tokens < 1:
            raise ValueError(f"{seq.request_id}: num_new_tokens must be >= 1, got {num_new_tokens}")
        if not self.can_allocate(seq, num_new_tokens, prefix):
            raise ValueError(f"{seq.request_id}: not enough free blocks; check can_allocate first")
        table = seq.block_table
        num_added = 0
        cache = self.prefix_cache
        if prefix is not None or not cache.has_chain(seq.request_id):
            if table or seq.num_computed_tokens:
                raise ValueError(f"{seq.request_id}: admission needs a sequence that holds no blocks")
            if prefix is None:
                prefix = PrefixMatch((), 0, 0, cache.salt_of(seq))
            for block_id in prefix.block_ids:
                assert cache.is_cached(block_id), "a matched block is still cached"
                if self._ref_counts[block_id] == 0:
                    del self._evictable_block_ids[block_id]
                self._ref_counts[block_id] += 1
                table.append(block_id)
            num_added = len(prefix.block_ids)
            seq.num_computed_tokens = prefix.num_tokens
            if seq.num_preemptions == 0:
                # What the user is told was served from the prompt cache. A recompute after our own
                # preemption reuses the sequence's own blocks: an internal saving, not a prompt-cache hit.
                seq.num_cached_prompt_tokens = min(prefix.num_tokens, seq.num_prompt_tokens)
            cache.start_chain(seq, num_added, prefix.parent, prefix.num_tokens)
        num_full, wants_half = tail_shape(
            seq.num_computed_tokens + num_new_tokens, self.block_size, self.half_block_tails
        )
        moved = None
        if tail_half(table) is not None:
            if num_full >= len(table):
                moved = self._make_tail_whole(seq)
            else:
                wants_half = False  # its half holds them
        while len(table) < num_full:
            table.append(block_id := self._take_empty_block())
            self._ref_counts[block_id] = 1
            num_added += 1
        if wants_half:
            entry = self._halves.take()
            table.append(self._halves.split(self._take_empty_block()) if entry is None else entry)
            num_added += 1
        if moved is not None:  # freed only now, so nothing above took its block while it was copied from
            self._release_half(moved)
        if num_added:
            tenant = seq.tenant_id
            self._num_blocks_by_tenant[tenant] = self._num_blocks_by_tenant.get(tenant, 0) + num_added

    def lend_empty_block(self, seq: Sequence) -> bool:
        """Give `seq`, which holds nothing, one block without contents, outside the prefix cache: no
        cached block is evicted for it and the cache's hit statistics do not see it (the engine's
        device probe). False, with nothing taken, when no block is empty. `free(seq)` returns it."""
        if seq.block_table or self.prefix_cache.has_chain(seq.request_id):
            raise ValueError(f"{seq.request_id}: a lent block needs a sequence that holds no blocks")
        if not self._free_block_ids:
            return False
        block_id = self._free_block_ids.popleft()
        self._ref_counts[block_id] = 1
        seq.block_table.append(block_id)
        tenant = seq.tenant_id
        self._num_blocks_by_tenant[tenant] = self._num_blocks_by_tenant.get(tenant, 0) + 1
        return True

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. A block returns to the pool only when its last user ends; one with
        cached contents stays findable until the allocator needs it."""
        self.prefix_cache.end_chain(seq.request_id)
        table = seq.block_table
        if not table:
            return
        if (tail := tail_half(table)) is not None:
            self._release_half(tail)
            self._halves.drop_copies_into(table)  # moves no step will read now
        # Tail first, so a chain's later blocks (useless without its head) are evicted before it.
        for block_id in reversed(table):
            if is_half(block_id):
                continue
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0, f"block {block_id} freed more often than taken"
            if self._ref_counts[block_id] == 0:
                if not self.prefix_cache.is_cached(block_id):
                    self._free_block_ids.append(block_id)
                else:
                    self._evictable_block_ids[block_id] = None
        num_left = self._num_blocks_by_tenant[seq.tenant_id] - len(table)
        if num_left:
            self._num_blocks_by_tenant[seq.tenant_id] = num_left
        else:
            del self._num_blocks_by_tenant[seq.tenant_id]
        table.clear()

    def take_copies(self) -> list[TailCopy]:
        """The tail moves allocated since the last call, in order: the runner carries them out before
        the step writes anything (half_blocks.py)."""
        return self._halves.take_copies()

    def _make_tail_whole(self, seq: Sequence) -> int | None:
        """Turn `seq`'s tail half into a whole block; the half left behind, to release once done."""
        table = seq.block_table
        num_tokens = seq.num_computed_tokens - (len(table) - 1) * self.block_size
        block_id, left = self._halves.make_whole(table[-1], num_tokens, self._take_empty_block)
        self._ref_counts[block_id] = 1
        table[-1] = block_id
        return left

    def _release_half(self, entry: int) -> None:
        block_id = self._halves.release(entry)
        if block_id is not None:
            self._free_block_ids.append(block_id)

    def _take_empty_block(self) -> int:
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        block_id, _ = self._evictable_block_ids.popitem(last=False)
        self.prefix_cache.forget(block_id)
        return block_id

    # --- checks -----------------------------------------------------------------------------------

    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Full O(blocks + tokens) consistency check against the sequences holding blocks; for tests."""
        expected_refs = [0] * self.num_blocks
        expected_by_tenant: dict[str, int] = {}
        halves: list[int] = []
        for seq in live_seqs:
            for index, block_id in enumerate(seq.block_table):
                if is_half(block_id):
                    assert index == len(seq.block_table) - 1, "only a table's last entry is a half"
                    halves.append(block_id)
                else:
                    expected_refs[block_id] += 1
            assert self.num_slots(seq) >= seq.num_computed_tokens, seq.request_id
            if seq.block_table:
                num_held = expected_by_tenant.get(seq.tenant_id, 0)
                expected_by_tenant[seq.tenant_id] = num_held + len(seq.block_table)
        assert expected_refs == self._ref_counts, "reference counts match the block tables"
        assert expected_by_tenant == self._num_blocks_by_tenant, "per-tenant counts match the block tables"
        free = set(self._free_block_ids)
        evictable = set(self._evictable_block_ids)
        used = {b for b, refs in enumerate(self._ref_counts) if refs > 0}
        assert len(free) == len(self._free_block_ids), "no block is free twice"
        assert not free & evictable, "empty and evictable pools are disjoint"
        assert not (free | evictable) & used, "a block in use is in no free pool"
        split = self._halves.check(halves)
        assert not split & (free | evictable | used), "a split block is neither free nor whole in use"
        assert len(free) + len(evictable) + len(used) + len(split) == self.num_blocks, "free + used = total"
        self.prefix_cache.check(free, evictable)


def _largest(holds: Callable[[int], bool], high: int) -> int:
    """The largest n in [0, high] for which `holds(n)`, where it holds up to some n and not past it."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if holds(mid) else (low, mid - 1)
    return low
