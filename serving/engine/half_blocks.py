"""Half blocks: where a sequence's last, partial block lives when it holds at most half a block of
tokens, so two sequences' tails share one block (docs/architecture.md, "Half-block tails").

Why: a sequence's last block is on average half empty, and with 16-token blocks that floor is most of
the paged cache's waste (3.3% on the bench workload). A tail of up to 8 tokens in a half halves it.
Full blocks stay 16 tokens everywhere else: the kernel's vector width, the prefix cache's unit, the
block table's length.

A half is named in a block table by a negative entry, `~(2 * block + half)`: the kernel reads half 1
from column block_size / 2 of the block. Nothing here touches tensors: when a tail outgrows its half
and its block's other half is taken, the allocator moves it into a whole block and records the move
(`TailCopy`), which the runner carries out before the step writes anything."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass


def half_entry(block_id: int, half: int) -> int:
    """The block-table entry of `half` (0 or 1) of `block_id`."""
    return ~(2 * block_id + half)


def is_half(entry: int) -> bool:
    return entry < 0


def half_of(entry: int) -> tuple[int, int]:
    """(block id, half) of a half's table entry."""
    code = ~entry
    return code >> 1, code & 1


def tail_half(table: list[int]) -> int | None:
    """The entry of `table`'s tail when it is in half a block (only a last entry can be), else None."""
    return table[-1] if table and is_half(table[-1]) else None


def tail_shape(num_tokens: int, block_size: int, half_block_tails: bool) -> tuple[int, bool]:
    """What `num_tokens` take: whole blocks, and whether half a block more (a tail that fits one)."""
    num_full, rest = divmod(num_tokens, block_size)
    if half_block_tails and 0 < rest <= block_size // 2:
        return num_full, True
    return num_full + (rest > 0), False


def entries_added(table: list[int], num_tokens: int, block_size: int, half_block_tails: bool) -> int:
    """Entries `table` gains to hold `num_tokens` (a tenant's block count is charged them): a whole block
    or a half each, while a tail moved out of its half into a whole block keeps its one entry."""
    num_full, wants_half = tail_shape(num_tokens, block_size, half_block_tails)
    if tail_half(table) is not None and num_full < len(table):
        return 0  # its half holds them
    return max(0, num_full + wants_half - len(table))


@dataclass(slots=True, frozen=True)
class TailCopy:
    """Move a tail's first `num_tokens` keys and values from column `src_column` of block `src_block`
    to column 0 of block `dst_block`, in every layer, before the step's writes."""

    src_block: int
    src_column: int
    dst_block: int
    num_tokens: int


class HalfBlocks:
    """Blocks split into two halves, each owned by one sequence's tail or free. A block is split when
    its first half is handed out and goes back whole to its pool when both halves are free. Also the
    tail moves made since the runner last took them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._copies: list[TailCopy] = []
        self._owned: dict[int, list[bool]] = {}  # split block -> [half 0 taken, half 1 taken]
        # Split blocks with one free half, oldest first: a tail takes one of these before a new block.
        self._open: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_open_blocks(self) -> int:
        """Split blocks with a free half."""
        return len(self._open)

    def take(self) -> int | None:
        """A free half's entry, taken; None when no split block has one."""
        if not self._open:
            return None
        block_id = next(iter(self._open))
        del self._open[block_id]
        owned = self._owned[block_id]
        half = owned.index(False)
        owned[half] = True
        return half_entry(block_id, half)

    def split(self, block_id: int) -> int:
        """Split an empty block taken from the pool and hand out its first half."""
        assert block_id not in self._owned
        self._owned[block_id] = [True, False]
        self._open[block_id] = None
        return half_entry(block_id, 0)

    def can_grow_in_place(self, entry: int) -> bool:
        """A first half whose other half is free: its block can become the tail's whole block."""
        block_id, half = half_of(entry)
        return half == 0 and not self._owned[block_id][1]

    def grow_in_place(self, entry: int) -> int:
        """Take the other half of `entry`'s block: the block leaves the split set, whole to its owner."""
        assert self.can_grow_in_place(entry)
        block_id, _ = half_of(entry)
        del self._owned[block_id]
        del self._open[block_id]
        return block_id

    def make_whole(
        self, entry: int, num_tokens: int, take_block: Callable[[], int]
    ) -> tuple[int, int | None]:
        """A whole block for the tail in `entry`, holding `num_tokens`: its own block when the other half
        is free, else `take_block()`'s, with a move recorded. Returns the block and the half left behind,
        for the caller to release once it has taken whatever else it needs (so nothing it takes is
        the block being copied from)."""
        if self.can_grow_in_place(entry):
            return self.grow_in_place(entry), None
        block_id = take_block()
        src_block, half = half_of(entry)
        if num_tokens > 0:
            self._copies.append(TailCopy(src_block, half * self.block_size // 2, block_id, num_tokens))
        return block_id, entry

    def take_copies(self) -> list[TailCopy]:
        copies, self._copies = self._copies, []
        return copies

    def drop_copies_into(self, block_ids: Iterable[int]) -> None:
        """Forget moves into blocks freed before a step read them (their sequence preempted)."""
        if self._copies:
            dropped = set(block_ids)
            self._copies = [move for move in self._copies if move.dst_block not in dropped]

    def release(self, entry: int) -> int | None:
        """Free a half; the block id when that frees its whole block (back to the pool), else None."""
        block_id, half = half_of(entry)
        owned = self._owned[block_id]
        assert owned[half], f"half {half} of block {block_id} freed but not taken"
        owned[half] = False
        if not any(owned):
            del self._owned[block_id]
            self._open.pop(block_id, None)
            return block_id
        self._open[block_id] = None
        return None

    def check(self, held_entries: Iterable[int]) -> set[int]:
        """Every taken half is held by exactly one table; returns the split blocks (for the pool's
        own check)."""
        held = collections.Counter(held_entries)
        assert all(count == 1 for count in held.values()), "a half is held by one sequence"
        taken = {half_entry(b, h) for b, owned in self._owned.items() for h in (0, 1) if owned[h]}
        assert set(held) == taken, "the taken halves are the ones tables hold"
        assert all(any(owned) for owned in self._owned.values()), "a split block has a taken half"
        assert set(self._open) == {b for b, owned in self._owned.items() if not all(owned)}
        return set(self._owned)
