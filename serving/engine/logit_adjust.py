"""Logit adjustments a request asks for, applied to its row before the sampler picks: OpenAI's
logit_bias and presence and frequency penalties, and vLLM's and transformers' repetition_penalty and
min_tokens, each as transformers' logits processor of that name computes it (tests/serving/engine/
test_sampling_fields.py holds them to it). (Structured outputs' masks are grammar_mask.py's.)"""

from __future__ import annotations

import torch

from serving.engine.sequence import SamplingParams, Sequence


def adjust_logits(
    logits: torch.Tensor, rows: list[int], seqs: list[Sequence], *, eos_ids: tuple[int, ...] = ()
) -> torch.Tensor:
    """The logits with each listed row's logit_bias added and its presence and frequency penalties
    subtracted (over the tokens it has generated so far), as OpenAI defines them; its repetition penalty
    applied over its prompt and output tokens; and, while it has fewer than min_tokens out, its ends of
    sequence (`eos_ids`, the model's) and stop token ids ruled out. A copy in float32, so that the raw
    logits stay as they were and a bias is not rounded to the model's dtype. Every row's ids go to the
    device in one upload, with no sync."""
    out = logits.float()  # a copy, unless the model already computes in float32
    if out is logits:
        out = logits.clone()
    device = out.device
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    count_rows: list[int] = []  # which penalized row (its place in `penalized`) each generated id is in
    count_ids: list[int] = []
    penalized: list[int] = []
    penalties: list[SamplingParams] = []
    repeated_rows: list[int] = []  # (row, token id) pairs: every distinct token of its prompt and output
    repeated_ids: list[int] = []
    repeated_penalties: list[float] = []
    held_rows: list[int] = []  # (row, token id) pairs ruled out until min_tokens are out
    held_ids: list[int] = []
    for row, seq in zip(rows, seqs, strict=True):
        params = seq.params
        if params.repetition_penalty != 1.0:
            seen = set(seq.token_ids)
            repeated_rows += [row] * len(seen)
            repeated_ids += seen
            repeated_penalties += [params.repetition_penalty] * len(seen)
        if seq.num_output_tokens < params.min_tokens:
            ends = set(eos_ids) | set(params.stop_token_ids)
            held_rows += [row] * len(ends)
            held_ids += ends
        for token_id, bias in params.logit_bias:
            bias_rows.append(row)
            bias_ids.append(token_id)
            bias_values.append(bias)
        if params.presence_penalty or params.frequency_penalty:
            generated = seq.output_token_ids
            count_rows += [len(penalized)] * len(generated)
            count_ids += generated
            penalized.append(row)
            penalties.append(params)
    if bias_rows:
        index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device))
        out.index_put_(index, torch.tensor(bias_values, dtype=out.dtype, device=device), accumulate=True)
    if count_ids:
        counts = torch.zeros(len(penalized), out.shape[1], dtype=out.dtype, device=device)
        index = (torch.tensor(count_rows, device=device), torch.tensor(count_ids, device=device))
        counts.index_put_(index, torch.ones(len(count_ids), dtype=out.dtype, device=device), accumulate=True)
        frequency = torch.tensor([p.frequency_penalty for p in penalties], dtype=out.dtype, device=device)
        presence = torch.tensor([p.presence_penalty for p in penalties], dtype=out.dtype, device=device)
        at = torch.tensor(penalized, device=device)
        out[at] -= frequency[:, None] * counts + presence[:, None] * (counts > 0).to(out.dtype)
    if repeated_ids:
        index = (torch.tensor(repeated_rows, device=device), torch.tensor(repeated_ids, device=device))
        penalty = torch.tensor(repeated_penalties, dtype=out.dtype, device=device)
        seen_logits = out[index]
        out[index] = torch.where(seen_logits < 0, seen_logits * penalty, seen_logits / penalty)
    if held_ids:
        index = (torch.tensor(held_rows, device=device), torch.tensor(held_ids, device=device))
        out[index] = float("-inf")
    return out
