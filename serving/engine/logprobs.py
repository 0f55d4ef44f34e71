"""Output tokens' log probabilities as a request reports them: each sampled token's and its likeliest
alternatives', with their text and bytes (token_bytes.py), read from the model's own distribution."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """An output token's log probability and, likeliest first, the alternatives' at its place."""

    token: str  # its bytes as UTF-8 text, U+FFFD for part of a character (serving/engine/token_bytes.py)
    logprob: float
    top: list[tuple[str, float, list[int]]]  # each alternative's text, log probability and bytes
    bytes: list[int]  # what the token adds to the text, byte by byte


def _finite(logprob: float) -> float:
    # A token the model rules out has -inf (and a broken row NaN), which JSON cannot carry; -9999 reads
    # as impossible.
    return logprob if math.isfinite(logprob) else -9999.0


class LogprobReader:
    """Reads rows of log probabilities into TokenLogprobs, each token's text and bytes made once."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._pieces: dict[int, tuple[str, list[int]]] = {}  # each token's text and bytes

    def read(self, rows: torch.Tensor, num_top: list[int], sampled: torch.Tensor) -> list[TokenLogprob]:
        """Each row's sampled token's log probability and its `num_top[i]` top alternatives.
        `rows`: log probabilities [R, vocab]; `sampled`: the sampler's tokens for these rows, on their
        device."""
        k = max(num_top, default=0)
        token_ids = sampled.tolist()
        chosen = rows.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
        top = rows.topk(k, dim=-1) if k else None
        top_values = top.values.tolist() if top is not None else [[] for _ in num_top]
        top_ids = top.indices.tolist() if top is not None else [[] for _ in num_top]
        read = []
        for i, (n, token_id) in enumerate(zip(num_top, token_ids, strict=True)):
            alternatives = zip(top_ids[i][:n], top_values[i][:n], strict=True)
            text, raw = self._piece(token_id)
            ranked = [self._alternative(t, v) for t, v in alternatives]
            read.append(TokenLogprob(text, _finite(chosen[i]), ranked, raw))
        return read

    def _alternative(self, token_id: int, logprob: float) -> tuple[str, float, list[int]]:
        text, raw = self._piece(token_id)
        return text, _finite(logprob), raw

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self._token_bytes(token_id)
            piece = self._pieces[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return piece
