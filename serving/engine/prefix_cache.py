"""The prefix cache's registry: which full blocks hold which contents, keyed so a hit is an exact match
and one cache group can neither reuse nor probe another's. The pool (kv_cache.py) owns the blocks and
decides when an unused cached block is evicted; this only names contents. It imports no torch."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass

from serving.engine.sequence import Sequence

# A cached block is found by (what precedes it, its tokens). What precedes the first block is its
# cache group's salt, so one group can neither reuse nor probe (by timing) another group's entries;
# what precedes any later block is the id its parent got when it was cached. Cache ids are never
# reused, so a key names exactly one chain of contents, and the dict compares the token tuples on a
# hit: a hit is an exact match, never a bet on a hash.
_BlockKey = tuple[bytes | int, tuple[int, ...]]


@dataclass(slots=True)
class _CacheChain:
    """How far a live sequence's full blocks are registered in the prefix cache."""

    num_committed_blocks: int
    parent: bytes | int


class PrefixCache:
    """Contents of full, computed blocks, per cache group, and each live sequence's chain through them."""

    def __init__(
        self, num_blocks: int, block_size: int, *, is_enabled: bool, salt_secret: bytes | None
    ) -> None:
        self.block_size = block_size
        self.is_enabled = is_enabled
        # Server-side and never shown to clients; a fresh one per process is fine because the cache
        # itself does not outlive the process.
        self._salt_secret = os.urandom(32) if salt_secret is None else salt_secret
        self._group_to_salt: dict[str, bytes] = {}
        self._adapter_salts: dict[tuple[str, str], bytes] = {}  # (group, adapter id) -> salt
        self._block_keys: list[_BlockKey | None] = [None] * num_blocks
        self._block_cache_ids: list[int | None] = [None] * num_blocks
        self._key_to_block_id: dict[_BlockKey, int] = {}
        self._next_cache_id = 0
        self._request_to_chain: dict[str, _CacheChain] = {}
        self.num_queries = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_to_block_id)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def is_cached(self, block_id: int) -> bool:
        return self._block_keys[block_id] is not None

    def has_chain(self, request_id: str) -> bool:
        return request_id in self._request_to_chain

    # --- salts ------------------------------------------------------------------------------------

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

    # --- lookups and registration -------------------------------------------------------------------

    def match(self, seq: Sequence) -> tuple[list[int], bytes | int]:
        """The cached blocks holding the longest run of full blocks at the start of `seq.token_ids` (at
        least one token left out), and what precedes the first block not matched."""
        parent: bytes | int = self.salt_of(seq)
        block_ids: list[int] = []
        if self.is_enabled:
            bs = self.block_size
            token_ids = seq.token_ids
            for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
                block_id = self._key_to_block_id.get((parent, tuple(token_ids[start : start + bs])))
                if block_id is None:
                    break
                block_ids.append(block_id)
                cache_id = self._block_cache_ids[block_id]
                assert cache_id is not None, "a block in the key map has a cache id"
                parent = cache_id
        return block_ids, parent

    def start_chain(self, seq: Sequence, num_blocks: int, parent: bytes | int, num_hit_tokens: int) -> None:
        """`seq` was admitted holding `num_blocks` cached blocks (`num_hit_tokens` tokens)."""
        self._request_to_chain[seq.request_id] = _CacheChain(num_blocks, parent)
        if self.is_enabled:
            self.num_queries += 1
            self.num_query_tokens += len(seq.token_ids)
            self.num_hit_tokens += num_hit_tokens

    def end_chain(self, request_id: str) -> None:
        self._request_to_chain.pop(request_id, None)

    def commit(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that became full and computed, so later sequences can reuse them."""
        if not self.is_enabled:
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

    def forget(self, block_id: int) -> None:
        """The pool evicts `block_id`: its contents are no longer findable."""
        key = self._block_keys[block_id]
        assert key is not None
        assert self._key_to_block_id[key] == block_id
        del self._key_to_block_id[key]
        self._block_keys[block_id] = None
        self._block_cache_ids[block_id] = None

    def check(self, empty: Iterable[int], evictable: Iterable[int]) -> None:
        """Empty blocks have no contents, unused kept ones do, and the key map matches; for tests."""
        assert all(self._block_keys[b] is None for b in empty), "empty blocks have no key"
        assert all(self._block_keys[b] is not None for b in evictable), "evictable blocks are cached"
        for key, block_id in self._key_to_block_id.items():
            assert self._block_keys[block_id] == key
            assert self._block_cache_ids[block_id] is not None
        assert sum(k is not None for k in self._block_keys) == len(self._key_to_block_id)
