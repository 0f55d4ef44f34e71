"""Block bookkeeping for the paged KV cache: which fixed-size blocks each sequence holds, reference
counts for shared prompt prefixes, and a prefix cache of full blocks. The tensors live in the runner;
this module only hands out block ids, so it imports no torch."""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from serving.engine.sequence import Sequence

# A cached block is found by (what precedes it, its tokens). What precedes the first block is its
# cache group's salt, so one group can neither reuse nor probe (by timing) another group's entries;
# what precedes any later block is the id its parent got when it was cached. Cache ids are never
# reused, so a key names exactly one chain of contents, and the dict compares the token tuples on a
# hit: a hit is an exact match, never a bet on a hash.
_BlockKey = tuple[bytes | int, tuple[int, ...]]


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
    parent: bytes | int  # what precedes the first block not matched (see _BlockKey)


@dataclass(slots=True)
class _CacheChain:
    """How far a live sequence's full blocks are registered in the prefix cache."""

    num_committed_blocks: int
    parent: bytes | int


def blocks_of_share(share: float, num_blocks: int) -> int:
    """A share of a pool of `num_blocks`, in whole blocks, at least one: a tenant's cap."""
    return max(1, int(share * num_blocks))


class KVCacheManager:
    """A pool of `num_blocks` blocks of `block_size` token slots. It owns `seq.block_table` of every
    sequence it allocates for, until `free(seq)`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        is_prefix_caching_enabled: bool = True,
        salt_secret: bytes | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.is_prefix_caching_enabled = is_prefix_caching_enabled
        # Server-side and never shown to clients; a fresh one per process is fine because the cache
        # itself does not outlive the process.
        self._salt_secret = os.urandom(32) if salt_secret is None else salt_secret
        self._group_to_salt: dict[str, bytes] = {}
        self._adapter_salts: dict[tuple[str, str], bytes] = {}  # (group, adapter id) -> salt
        self._ref_counts = [0] * num_blocks
        self._free_block_ids: collections.deque[int] = collections.deque(range(num_blocks))  # no contents
        # Unused blocks whose contents are still cached, least recently freed first: reusable until
        # the allocator runs out of empty blocks.
        self._evictable_block_ids: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._block_keys: list[_BlockKey | None] = [None] * num_blocks
        self._block_cache_ids: list[int | None] = [None] * num_blocks
        self._key_to_block_id: dict[_BlockKey, int] = {}
        self._next_cache_id = 0
        self._request_to_chain: dict[str, _CacheChain] = {}
        self._num_blocks_by_tenant: dict[str, int] = {}
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_query_tokens = 0
        self.num_prefix_cache_hit_tokens = 0

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
    def num_cached_blocks(self) -> int:
        return len(self._key_to_block_id)

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
        if self.num_prefix_cache_query_tokens == 0:
            return 0.0
        return self.num_prefix_cache_hit_tokens / self.num_prefix_cache_query_tokens

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_block_cached(self, block_id: int) -> bool:
        return self._block_keys[block_id] is not None

    # --- prefix cache -----------------------------------------------------------------------------

    def salt_for(self, cache_group: str) -> bytes:
        salt = self._group_to_salt.get(cache_group)
        if salt is None:
            salt = hmac.new(self._salt_secret, cache_group.encode(), hashlib.sha256).digest()
            self._group_to_salt[cache_group] = salt
        return salt

    def salt_of(self, seq: Sequence) -> bytes:
        """What precedes `seq`'s first block: its cache group's salt, or, for a sequence of a LoRA adapter,
        a salt of the group and the adapter both (keyed apart from every group's own), so that the base
        and each adapter never share blocks, whose keys and values differ."""
        if seq.adapter_id is None:
            return self.salt_for(seq.prefix_cache_group)
        key = (seq.prefix_cache_group, seq.adapter_id)
        salt = self._adapter_salts.get(key)
        if salt is None:
            adapter_secret = hmac.new(self._salt_secret, b"lora adapters", hashlib.sha256).digest()
            named = f"{len(key[1])}:{key[1]}:{key[0]}".encode()
            salt = self._adapter_salts[key] = hmac.new(adapter_secret, named, hashlib.sha256).digest()
        return salt

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The longest run of cached full blocks equal to the start of `seq.token_ids`, without taking
        them. At least one token is left out so the step that computes it yields logits."""
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"{seq.request_id}: match_prefix needs a sequence that holds no blocks")
        parent: bytes | int = self.salt_of(seq)
        block_ids: list[int] = []
        num_evictable = 0
        if self.is_prefix_caching_enabled:
            bs = self.block_size
            token_ids = seq.token_ids
            for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
                block_id = self._key_to_block_id.get((parent, tuple(token_ids[start : start + bs])))
                if block_id is None:
                    break
                block_ids.append(block_id)
                num_evictable += self._ref_counts[block_id] == 0
                cache_id = self._block_cache_ids[block_id]
                assert cache_id is not None, "a block in the key map has a cache id"
                parent = cache_id
        return PrefixMatch(tuple(block_ids), len(block_ids) * self.block_size, num_evictable, parent)

    def commit_computed(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that became full and computed, so later sequences can reuse them.
        The scheduler calls this after every step that advanced `seq.num_computed_tokens`."""
        if not self.is_prefix_caching_enabled:
            return
        chain = self._request_to_chain.get(seq.request_id)
        if chain is None:
            return
        num_full_blocks = seq.num_computed_tokens // self.block_size
        if num_full_blocks <= chain.num_committed_blocks:
            return
        bs = self.block_size
        for index in range(chain.num_committed_blocks, num_full_blocks):
            key = (chain.parent, tuple(seq.token_ids[index * bs : (index + 1) * bs]))
            block_id = self._key_to_block_id.get(key)
            if block_id is None:
                # Blocks past the matched prefix were handed out empty, so this one has no key yet.
                block_id = seq.block_table[index]
                assert self._block_keys[block_id] is None, "a freshly computed block is not yet cached"
                self._block_keys[block_id] = key
                self._block_cache_ids[block_id] = self._next_cache_id
                self._next_cache_id += 1
                self._key_to_block_id[key] = block_id
            # else: another sequence computed identical contents first; ours stays private, and the
            # chain continues from the cached twin so later blocks are found from either.
            cache_id = self._block_cache_ids[block_id]
            assert cache_id is not None
            chain.parent = cache_id
        chain.num_committed_blocks = num_full_blocks

    # --- allocation -------------------------------------------------------------------------------

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> int:
        """Free blocks that `allocate(seq, num_new_tokens, prefix)` would take from the pool."""
        num_computed = seq.num_computed_tokens if prefix is None else prefix.num_tokens
        num_held = len(seq.block_table) if prefix is None else len(prefix.block_ids)
        num_total = -(-(num_computed + num_new_tokens) // self.block_size)
        num_taken = max(0, num_total - num_held)
        return num_taken if prefix is None else num_taken + prefix.num_evictable

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
        if prefix is not None or seq.request_id not in self._request_to_chain:
            if table or seq.num_computed_tokens:
                raise ValueError(f"{seq.request_id}: admission needs a sequence that holds no blocks")
            if prefix is None:
                prefix = PrefixMatch((), 0, 0, self.salt_of(seq))
            for block_id in prefix.block_ids:
                assert self._block_keys[block_id] is not None, "a matched block is still cached"
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
            self._request_to_chain[seq.request_id] = _CacheChain(num_added, prefix.parent)
            if self.is_prefix_caching_enabled:
                self.num_prefix_cache_queries += 1
                self.num_prefix_cache_query_tokens += len(seq.token_ids)
                self.num_prefix_cache_hit_tokens += prefix.num_tokens
        num_total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(table) < num_total:
            block_id = self._take_empty_block()
            self._ref_counts[block_id] = 1
            table.append(block_id)
            num_added += 1
        if num_added:
            tenant = seq.tenant_id
            self._num_blocks_by_tenant[tenant] = self._num_blocks_by_tenant.get(tenant, 0) + num_added

    def lend_empty_block(self, seq: Sequence) -> bool:
        """Give `seq`, which holds nothing, one block without contents, outside the prefix cache: no
        cached block is evicted for it and the cache's hit statistics do not see it (the engine's
        device probe). False, with nothing taken, when no block is empty. `free(seq)` returns it."""
        if seq.block_table or seq.request_id in self._request_to_chain:
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
        self._request_to_chain.pop(seq.request_id, None)
        table = seq.block_table
        if not table:
            return
        # Tail first, so a chain's later blocks (useless without its head) are evicted before it.
        for block_id in reversed(table):
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0, f"block {block_id} freed more often than taken"
            if self._ref_counts[block_id] == 0:
                if self._block_keys[block_id] is None:
                    self._free_block_ids.append(block_id)
                else:
                    self._evictable_block_ids[block_id] = None
        num_left = self._num_blocks_by_tenant[seq.tenant_id] - len(table)
        if num_left:
            self._num_blocks_by_tenant[seq.tenant_id] = num_left
        else:
            del self._num_blocks_by_tenant[seq.tenant_id]
        table.clear()

    def _take_empty_block(self) -> int:
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        block_id, _ = self._evictable_block_ids.popitem(last=False)
        key = self._block_keys[block_id]
        assert key is not None
        assert self._key_to_block_id[key] == block_id
        del self._key_to_block_id[key]
        self._block_keys[block_id] = None
        self._block_cache_ids[block_id] = None
        return block_id

    # --- checks -----------------------------------------------------------------------------------

    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Full O(blocks + tokens) consistency check against the sequences holding blocks; for tests."""
        expected_refs = [0] * self.num_blocks
        expected_by_tenant: dict[str, int] = {}
        for seq in live_seqs:
            for block_id in seq.block_table:
                expected_refs[block_id] += 1
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens, seq.request_id
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
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "free + used = total"
        assert all(self._block_keys[b] is None for b in free), "empty blocks have no key"
        assert all(self._block_keys[b] is not None for b in evictable), "evictable blocks are cached"
        for key, block_id in self._key_to_block_id.items():
            assert self._block_keys[block_id] == key
            assert self._block_cache_ids[block_id] is not None
        assert sum(k is not None for k in self._block_keys) == len(self._key_to_block_id)
