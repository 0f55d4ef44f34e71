"""Next-token choice for the sampled rows of a step: greedy, temperature, top-k, top-p, min-p, per-request
seeds.

Each sampled row draws exactly one uniform number per step, from its own generator when the request
has a seed, and picks a token by inverse CDF over its filtered distribution. The rest is deterministic
per row, so a seeded request reproduces whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serving.engine.sequence import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A request's own generator when it has a seed, else None (it draws from the sampler's). Keep one
    per request for its whole life: a fresh generator every step would repeat the same draw."""
    if params.seed is None:
        return None
    generator = torch.Generator(device="cpu")  # uniforms are drawn on CPU so seeds mean the same everywhere
    generator.manual_seed(params.seed)
    return generator


class Sampler:
    def __init__(self, *, seed: int | None = None) -> None:
        self._generator = torch.Generator(device="cpu")
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """logits [N, V] and one SamplingParams (and generator, or None) per row -> token ids [N] long
        on the logits' device."""
        num_rows = logits.shape[0]
        if len(params) != num_rows:
            raise ValueError(f"{num_rows} logits rows but {len(params)} SamplingParams")
        if generators is not None and len(generators) != num_rows:
            raise ValueError(f"{num_rows} logits rows but {len(generators)} generators")
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return logits.argmax(dim=-1)
        tokens = logits.argmax(dim=-1) if len(random_rows) < num_rows else None
        chosen = self._sample(
            logits[random_rows] if tokens is not None else logits,
            [params[i] for i in random_rows],
            [generators[i] if generators is not None else None for i in random_rows],
        )
        if tokens is None:
            return chosen
        tokens[torch.tensor(random_rows, device=logits.device)] = chosen
        return tokens

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """A row with a top-k or top-p cut picks by its sorted distribution, one without in vocabulary
        order: each by its own parameters alone, or a seeded row's token would depend on whether a row
        with a cut shared its step (the same uniform lands on another token in the other order)."""
        vocab_size = logits.shape[1]
        cuts = [p.top_p < 1.0 or (p.top_k is not None and p.top_k < vocab_size) for p in params]
        if all(cuts) or not any(cuts):
            return self._pick(logits, params, generators, is_sorted=cuts[0])
        chosen = torch.empty(len(params), dtype=torch.long, device=logits.device)
        for is_sorted in (True, False):
            rows = [i for i, cut in enumerate(cuts) if cut is is_sorted]
            chosen[torch.tensor(rows, device=logits.device)] = self._pick(
                logits[rows], [params[i] for i in rows], [generators[i] for i in rows], is_sorted=is_sorted
            )
        return chosen

    def _pick(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        *,
        is_sorted: bool,
    ) -> torch.Tensor:
        device = logits.device
        vocab_size = logits.shape[1]
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        scaled = logits.float() / temperatures[:, None]
        has_top_k = any(p.top_k is not None and p.top_k < vocab_size for p in params)
        has_top_p = any(p.top_p < 1.0 for p in params)
        order = None
        if is_sorted:
            # Sorted descending, every cut keeps a prefix; stable so ties always break the same way.
            scaled, order = scaled.sort(dim=-1, descending=True, stable=True)
            if has_top_k:
                ks = torch.tensor(
                    [p.top_k if p.top_k is not None else vocab_size for p in params], device=device
                )
                ranks = torch.arange(vocab_size, device=device)
                scaled.masked_fill_(ranks[None, :] >= ks[:, None], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if has_top_p:
            top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
            # Keep token j iff the mass strictly before it is below top_p: the smallest prefix whose mass
            # reaches top_p. The first token always stays: nothing is before it, and a top_p below float32's
            # smallest (1e-50, say) rounds to 0, which its 0 would otherwise reach. With every token cut,
            # the draw fell back to the last in the order: the least likely of the vocabulary.
            mass_before = probs.cumsum(dim=-1) - probs
            cut = mass_before >= top_ps[:, None]
            cut[:, 0] = False
            probs.masked_fill_(cut, 0.0)
        if any(p.min_p > 0 for p in params):
            # As transformers' MinPLogitsWarper: after the other cuts, a token must have at least min_p
            # times the likeliest's probability. The likeliest always stays; no order is needed.
            min_ps = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            probs.masked_fill_(probs < min_ps[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        cdf = probs.cumsum(dim=-1)
        uniforms = self._uniforms(generators).to(device)
        targets = uniforms * cdf[:, -1]
        picks = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)
        # searchsorted never lands on a zero-probability token (its CDF equals its predecessor's), except
        # past the end when rounding makes target == total: fall back to the last token with mass.
        last_with_mass = vocab_size - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
        picks = torch.minimum(picks, last_with_mass)
        if order is None:
            return picks
        return order.gather(1, picks[:, None]).squeeze(1)

    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        uniforms = torch.empty(len(generators), dtype=torch.float32)
        shared_rows = [i for i, g in enumerate(generators) if g is None]
        if shared_rows:
            uniforms[shared_rows] = torch.rand(len(shared_rows), generator=self._generator)
        for i, generator in enumerate(generators):
            if generator is not None:
                uniforms[i] = torch.rand((), generator=generator)
        return uniforms
