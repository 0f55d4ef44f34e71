"""Greedy decoding through a ModelRunner driven by a tiny hand-written block allocator (no scheduler),
checked token for token against transformers' `generate`; shared by the runner and forward tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from serving.engine.runner import ModelRunner
from serving.engine.sequence import Sequence

BLOCK_SIZE = 16


class BlockAllocator:
    """Test-only: hands out free blocks; shared prefix blocks are simply listed in two tables."""

    def __init__(self, num_blocks: int) -> None:
        # Hand out blocks in a scrambled order so that block tables are not contiguous ranges.
        self._free = [(i * 7) % num_blocks for i in range(num_blocks)]

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK_SIZE < num_tokens:
            seq.block_table.append(self._free.pop())


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    arrival_step: int
    max_new_tokens: int
    prefix_from: str | None = None  # reuse that request's full prompt blocks (already computed)


@dataclass
class Result:
    tokens: list[int]
    logits: list[torch.Tensor]


def run_greedy(
    runner: ModelRunner,
    requests: list[Request],
    *,
    chunk_size: int,
    decodes_first: bool,
    eos_token_id: int | None = None,
) -> dict[str, Result]:
    allocator = BlockAllocator(runner.num_blocks)
    pending = sorted(requests, key=lambda r: r.arrival_step)
    by_id: dict[str, Sequence] = {}
    budgets: dict[str, int] = {}
    results: dict[str, Result] = {}
    running: list[Sequence] = []
    step = 0
    while pending or running:
        while pending and pending[0].arrival_step <= step:
            request = pending[0]
            seq = Sequence(request_id=request.request_id, prompt_token_ids=request.prompt)
            if request.prefix_from is not None:
                owner = by_id[request.prefix_from]
                num_shared = min(owner.num_computed_tokens, len(request.prompt) - 1) // BLOCK_SIZE
                if num_shared < 2:
                    break  # wait until the owner has computed the shared blocks
                assert owner.token_ids[: num_shared * BLOCK_SIZE] == request.prompt[: num_shared * BLOCK_SIZE]
                seq.block_table = owner.block_table[:num_shared]
                seq.num_computed_tokens = num_shared * BLOCK_SIZE
            pending.pop(0)
            by_id[seq.request_id] = seq
            budgets[seq.request_id] = request.max_new_tokens
            results[seq.request_id] = Result([], [])
            running.append(seq)
        if not running:
            step += 1
            continue
        # sorted() copies, so finishing sequences below does not shift the rows of this step.
        order = sorted(running, key=lambda s: decodes_first and s.num_computed_tokens < s.num_prompt_tokens)
        num_new = [min(chunk_size, s.num_tokens - s.num_computed_tokens) for s in order]
        for seq, n in zip(order, num_new, strict=True):
            allocator.grow(seq, seq.num_computed_tokens + n)
        batch = runner.build_batch(order, num_new)
        logits = runner.execute(batch)
        assert logits.shape == (len(batch.sampled_seq_indices), runner.vocab_size)
        for seq, n in zip(order, num_new, strict=True):
            seq.num_computed_tokens += n
        for row, seq_index in enumerate(batch.sampled_seq_indices.tolist()):
            seq = order[seq_index]
            token = int(logits[row].argmax())
            result = results[seq.request_id]
            result.tokens.append(token)
            result.logits.append(logits[row].clone())
            seq.append_token(token)
            if len(result.tokens) == budgets[seq.request_id] or token == eos_token_id:
                running.remove(seq)
        step += 1
    return results


def check_against_reference(model_dir: Path, requests: list[Request], results: dict[str, Result]) -> None:
    from transformers import AutoModelForCausalLM

    from serving.engine.loading import MODEL_LOAD_LOCK

    with MODEL_LOAD_LOCK:  # as every load in the process does
        reference = AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation="sdpa", use_safetensors=True
        )
    reference.eval()
    with torch.inference_mode():
        for request in requests:
            prompt = torch.tensor([request.prompt])
            generated = reference.generate(prompt, max_new_tokens=request.max_new_tokens, do_sample=False)
            expected = generated[0, len(request.prompt) :].tolist()
            got = results[request.request_id].tokens
            assert got == expected, f"{request.request_id}: engine {got} != generate {expected}"
            full = torch.tensor([request.prompt + got])
            ref_logits = reference(full).logits[0, len(request.prompt) - 1 : -1]
            ours = torch.stack(results[request.request_id].logits)
            torch.testing.assert_close(ours, ref_logits, atol=1e-4, rtol=1e-4)


def mixed_requests(vocab_size: int, seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=g).tolist()

    shared = prompt(37)
    return [
        Request("short", prompt(3), arrival_step=0, max_new_tokens=12),
        Request("block-exact", prompt(16), arrival_step=0, max_new_tokens=10),
        Request("owner", shared, arrival_step=0, max_new_tokens=8),
        Request("long", prompt(41), arrival_step=2, max_new_tokens=9),
        Request("late", prompt(11), arrival_step=5, max_new_tokens=12),
        # Arrives once "owner" has its prompt computed: reuses 2 full blocks, computes only the tail.
        Request(
            "prefix-tail", [*shared[:32], *prompt(9)], arrival_step=12, max_new_tokens=8, prefix_from="owner"
        ),
        # Shares 2 blocks and has exactly one uncached prompt token.
        Request(
            "prefix-one", [*shared[:32], *prompt(1)], arrival_step=13, max_new_tokens=6, prefix_from="owner"
        ),
    ]
