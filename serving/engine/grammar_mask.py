"""The constrained rows' logits masked to what each row's grammar allows next, before the sampler picks
(docs/architecture.md, "Structured outputs").

Only the rows of constrained sequences are touched: a step with none pays one scan of the batch for a
`constraint` attribute. For the others, llguidance fills one bit per vocabulary entry, row by row on the
model thread, the bits are unpacked on the host and the disallowed logits set to -inf in place, on the
logits' device: ~130 us a row for a 32k vocabulary, all told (docs/benchmarks.md, "Structured
outputs"). The sampler's temperature, top-k, top-p and seeded draw then run on the masked rows as on
any other, so a constrained row and a free one share the step, and a seeded constrained request
reproduces whatever else is in its batch. The log probabilities a request asked for are the model's
own, taken before this (engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from serving.engine.sequence import Sequence


def blocked_tokens(seqs: Seq[Sequence], vocab_size: int) -> np.ndarray:
    """[len(seqs), vocab_size] bool, True where each (constrained) sequence's grammar does not allow
    the token next. A row that would allow nothing (a matcher in an error state) allows its grammar's
    end of sequence, so that the sampler never draws from a row of -inf."""
    words = (vocab_size + 31) // 32
    bitmask = np.zeros((len(seqs), words), dtype=np.uint32)
    address, row_bytes = bitmask.ctypes.data, words * 4
    for row, seq in enumerate(seqs):
        assert seq.constraint is not None
        # On this thread, one row after another: llguidance's executor spreads rows over a thread pool
        # of its own, whose threads then fought torch's for the cores and doubled the step's time.
        seq.constraint.matcher.unsafe_compute_mask_ptr(address + row * row_bytes, row_bytes)
    for row in np.flatnonzero(~bitmask.any(axis=1)).tolist():
        constraint = seqs[row].constraint
        assert constraint is not None
        for token_id in constraint.grammar.eos_token_ids or (0,):
            bitmask[row, token_id // 32] |= np.uint32(1 << (token_id % 32))
    blocked = np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return blocked.view(np.bool_)


def mask_logits(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """`logits` [N, V] with each constrained sequence's row masked in place (seqs: one per row); the
    same tensor, untouched, when no row is constrained."""
    rows = [i for i, seq in enumerate(seqs) if seq.constraint is not None]
    if not rows:
        return logits
    blocked = blocked_tokens([seqs[i] for i in rows], logits.shape[1])
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # Through numpy, row by row on this thread: each torch operation on these rows would wait at
        # its threads' barrier, which on busy cores cost milliseconds (docs/benchmarks.md, "Structured
        # outputs"); numpy's copy of -inf into the blocked places costs microseconds a row.
        values = logits.numpy()
        for i, row in enumerate(rows):
            np.copyto(values[row], -np.inf, where=blocked[i])
        return logits
    mask = torch.from_numpy(blocked).to(logits.device, non_blocking=True)
    index = torch.tensor(rows, device=logits.device)
    with torch.inference_mode():  # in place: the runner's logits are inference tensors
        logits[index] = logits[index].masked_fill(mask, float("-inf"))
    return logits
