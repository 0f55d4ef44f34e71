"""The forward pass's input: `ForwardBatch`, one step's tokens, positions, slots and block tables, and
`BatchBuilder`, which checks the scheduled sequences against the runner's limits and assembles the
batch in buffers it reuses every step (filled on the host through numpy, then copied to a GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from serving.engine.sequence import Sequence


@dataclass(slots=True)
class ForwardBatch:
    """One step's input, built by `ModelRunner.build_batch`. The tensors are views of the runner's
    persistent buffers: a batch is valid until the next `build_batch` call."""

    input_ids: torch.Tensor  # [T] long: the new tokens of every sequence, concatenated in batch order
    positions: torch.Tensor  # [T] long: each token's position in its own sequence
    slot_mapping: torch.Tensor  # [T] long: pool slot where each token's key/value is written
    block_tables: torch.Tensor  # [B, W] long, padded with block 0 (masked out by context_lens)
    query_lens: np.ndarray  # [B] int64: new tokens per sequence
    context_lens: np.ndarray  # [B] int64: cached + new tokens per sequence
    sample_indices: torch.Tensor  # [S] long: rows of T whose logits `execute` returns, in batch order
    sampled_seq_indices: np.ndarray  # [S] int64: which sequences of the batch those rows belong to

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class BatchBuilder:
    """Builds a runner's `ForwardBatch`es, checked against its limits, in buffers it reuses every step."""

    def __init__(
        self,
        *,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # Host-side metadata lives in persistent arrays filled in place each step; building tensors
        # from Python lists every step was measured at milliseconds per step at a few hundred sequences.
        pin = device.type == "cuda"
        max_tokens = max_num_batched_tokens
        self._host_tokens = torch.zeros((3, max_tokens), dtype=torch.long, pin_memory=pin)  # ids, pos, slot
        # A table lists distinct blocks, so no row is wider than the pool.
        max_table_width = min(max_blocks_per_seq, num_blocks)
        self._host_tables = torch.zeros(max_num_seqs * max_table_width, dtype=torch.long, pin_memory=pin)
        if pin:
            self._dev_tokens = torch.zeros_like(self._host_tokens, device=device)
            self._dev_tables = torch.zeros_like(self._host_tables, device=device)
        else:
            self._dev_tokens, self._dev_tables = self._host_tokens, self._host_tables

    def build(self, seqs: list[Sequence], num_new_tokens: list[int]) -> ForwardBatch:
        """The step's tokens are seq.token_ids[num_computed_tokens : num_computed_tokens + n] for each
        sequence; a sequence is sampled iff that range reaches the end of its token_ids."""
        num_seqs = len(seqs)
        if len(num_new_tokens) != num_seqs:
            raise ValueError(f"{num_seqs} sequences but {len(num_new_tokens)} token counts")
        if not 1 <= num_seqs <= self.max_num_seqs:
            raise ValueError(f"a batch holds 1..{self.max_num_seqs} sequences, got {num_seqs}")
        bs = self.block_size
        query_lens = np.fromiter(num_new_tokens, np.int64, num_seqs)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num_seqs)
        num_held = np.fromiter((len(s.token_ids) for s in seqs), np.int64, num_seqs)
        num_owned_blocks = np.fromiter((len(s.block_table) for s in seqs), np.int64, num_seqs)
        context_lens = starts + query_lens
        num_needed_blocks = (context_lens + bs - 1) // bs
        num_tokens = int(query_lens.sum())
        if (query_lens < 1).any():
            raise ValueError(f"every sequence needs >= 1 new token, got {query_lens.tolist()}")
        if (context_lens > num_held).any():
            row = int(np.argmax(context_lens > num_held))
            raise ValueError(
                f"{seqs[row].request_id}: computing up to {context_lens[row]} tokens but it holds "
                f"{num_held[row]}"
            )
        if (context_lens > self.max_model_len).any():
            raise ValueError(f"a sequence exceeds the model's context of {self.max_model_len} tokens")
        if (num_owned_blocks < num_needed_blocks).any():
            row = int(np.argmax(num_owned_blocks < num_needed_blocks))
            raise ValueError(
                f"{seqs[row].request_id}: {context_lens[row]} tokens need {num_needed_blocks[row]} "
                f"blocks, its block table has {num_owned_blocks[row]}"
            )
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"{num_tokens} tokens exceed max_num_batched_tokens={self.max_num_batched_tokens}"
            )

        host_ids, host_pos, host_slots = self._host_tokens.numpy()[:, :num_tokens]
        if num_tokens == num_seqs:  # all single-token rows, the common decode step
            host_ids[:] = np.fromiter(
                (s.token_ids[c] for s, c in zip(seqs, starts.tolist(), strict=True)), np.int64, num_seqs
            )
        else:
            host_ids[:] = np.fromiter(
                chain.from_iterable(
                    s.token_ids[c : c + n]
                    for s, c, n in zip(seqs, starts.tolist(), query_lens.tolist(), strict=True)
                ),
                np.int64,
                num_tokens,
            )
        width = int(num_needed_blocks.max())
        tables = self._host_tables.numpy()[: num_seqs * width].reshape(num_seqs, width)
        tables.fill(0)
        total_blocks = int(num_needed_blocks.sum())
        flat_blocks = np.fromiter(
            chain.from_iterable(
                s.block_table[:n] for s, n in zip(seqs, num_needed_blocks.tolist(), strict=True)
            ),
            np.int64,
            total_blocks,
        )
        physical = _first_slots(flat_blocks, bs) // bs
        if total_blocks and not 0 <= int(physical.min()) <= int(physical.max()) < self.num_blocks:
            bad = flat_blocks[(physical < 0) | (physical >= self.num_blocks)]
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {bad[:8].tolist()}")
        if (flat_blocks < 0).any():
            self._check_halves(seqs, flat_blocks, num_needed_blocks, context_lens)
        block_rows = np.repeat(np.arange(num_seqs), num_needed_blocks)
        block_cols = np.arange(total_blocks) - np.repeat(
            np.cumsum(num_needed_blocks) - num_needed_blocks, num_needed_blocks
        )
        tables[block_rows, block_cols] = flat_blocks

        token_ends = np.cumsum(query_lens)
        token_rows = np.repeat(np.arange(num_seqs), query_lens)
        host_pos[:] = np.arange(num_tokens) + np.repeat(starts - (token_ends - query_lens), query_lens)
        host_slots[:] = _first_slots(tables[token_rows, host_pos // bs], bs) + host_pos % bs
        is_sampled = context_lens == num_held
        sampled_seq_indices = np.flatnonzero(is_sampled)

        dev_tokens = self._dev_tokens[:, :num_tokens]
        dev_tables = self._dev_tables[: num_seqs * width]
        if self._dev_tokens is not self._host_tokens:
            dev_tokens.copy_(self._host_tokens[:, :num_tokens], non_blocking=True)
            dev_tables.copy_(self._host_tables[: num_seqs * width], non_blocking=True)
        sample_indices = torch.from_numpy(token_ends[sampled_seq_indices] - 1).to(self.device)
        return ForwardBatch(
            input_ids=dev_tokens[0],
            positions=dev_tokens[1],
            slot_mapping=dev_tokens[2],
            block_tables=dev_tables.view(num_seqs, width),
            query_lens=query_lens,
            context_lens=context_lens,
            sample_indices=sample_indices,
            sampled_seq_indices=sampled_seq_indices,
        )

    def _check_halves(
        self,
        seqs: list[Sequence],
        flat_blocks: np.ndarray,
        num_needed_blocks: np.ndarray,
        context_lens: np.ndarray,
    ) -> None:
        """Halves only where the kernel reads them: a table's last entry, holding at most half a block."""
        if self.device.type != "cpu":
            raise ValueError("half-block tails are read by the CPU's native kernel only")
        last = np.cumsum(num_needed_blocks) - 1
        is_last = np.zeros(len(flat_blocks), dtype=bool)
        is_last[last] = True
        if (flat_blocks[~is_last] < 0).any():
            raise ValueError("only a block table's last entry may be half a block")
        has_half = flat_blocks[last] < 0
        over = has_half & (context_lens > (num_needed_blocks - 1) * self.block_size + self.block_size // 2)
        if over.any():
            row = int(np.argmax(over))
            name = seqs[row].request_id
            raise ValueError(f"{name}: {context_lens[row]} tokens overflow the half block its table ends in")


def _first_slots(entries: np.ndarray, block_size: int) -> np.ndarray:
    """The pool slot where each block-table entry's tokens start: a whole block's first, or, for a
    negative entry (half a block, `~(2 * block + half)`: half_blocks.py), its half's first."""
    if not (entries < 0).any():
        return entries * block_size
    codes = np.invert(entries)
    halves = (codes >> 1) * block_size + (codes & 1) * (block_size // 2)
    return np.where(entries >= 0, entries * block_size, halves)
