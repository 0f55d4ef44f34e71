"""The naive path: `model.generate`, one request at a time, streaming through a callback.

It served the first version of the platform and stays as the baseline the engine benchmark beats."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.loading import load_causal_lm, load_tokenizer
from serving.engine.sequence import FinishReason, SamplingParams


@dataclass(slots=True)
class GenerationResult:
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason = FinishReason.LENGTH
    num_prompt_tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0


# Called with (token_id, index, text_delta); return False to stop generating.
OnToken = Callable[[int, int, str], bool]


class _Streamer:
    """The streamer protocol `generate` calls: put() with the prompt first, then each new token."""

    def __init__(self, on_new_token: Callable[[int], None]) -> None:
        self._on_new_token = on_new_token
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        for token_id in value.reshape(-1).tolist():
            self._on_new_token(int(token_id))

    def end(self) -> None:
        pass


class NaiveGenerator:
    def __init__(self, model_dir: str | Path, *, device: str | None = None) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_causal_lm(model_dir, device=device)
        self.max_model_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._lock = threading.Lock()  # one request at a time, by definition of this baseline

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request this model cannot serve, before any work."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; the model's context is {self.max_model_len}"
            )

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_token: OnToken | None = None,
        *,
        should_abort: Callable[[], bool] = lambda: False,
    ) -> GenerationResult:
        from transformers import StoppingCriteria, StoppingCriteriaList

        self.check(prompt_token_ids, params)
        result = GenerationResult(num_prompt_tokens=len(prompt_token_ids))
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        stop_requested: list[FinishReason] = []
        started = time.perf_counter()

        def on_new_token(token_id: int) -> None:
            if stop_requested:
                return
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - started
            if token_id in self.eos_token_ids and not params.ignore_eos:
                stop_requested.append(FinishReason.STOP)
                return
            result.output_token_ids.append(token_id)
            delta = detok.add(token_id)
            text_before = result.text
            result.text += delta
            hit = _find_stop(result.text, params.stop, search_from=len(text_before))
            if hit is not None:
                delta = result.text[len(text_before) : hit]
                result.text = result.text[:hit]
                stop_requested.append(FinishReason.STOP)
            elif token_id in params.stop_token_ids:
                stop_requested.append(FinishReason.STOP)
            if on_token is not None and not on_token(token_id, len(result.output_token_ids) - 1, delta):
                stop_requested.append(FinishReason.ABORT)

        class _Stop(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
                if should_abort() and not stop_requested:
                    stop_requested.append(FinishReason.ABORT)
                return torch.full((input_ids.shape[0],), bool(stop_requested), dtype=torch.bool)

        max_new_tokens = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        generate_kwargs: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "do_sample": not params.is_greedy,
            "pad_token_id": self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else next(iter(self.eos_token_ids), 0),
            "streamer": _Streamer(on_new_token),
            "stopping_criteria": StoppingCriteriaList([_Stop()]),
        }
        if params.ignore_eos:
            generate_kwargs["eos_token_id"] = None
        if not params.is_greedy:
            generate_kwargs.update(
                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or 0
            )
        input_ids = torch.tensor([prompt_token_ids], device=self.model.device)
        with self._lock, torch.inference_mode():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **generate_kwargs)
        if not stop_requested:
            tail = detok.flush()
            result.text += tail
        result.finish_reason = stop_requested[0] if stop_requested else FinishReason.LENGTH
        result.total_s = time.perf_counter() - started
        return result


def _find_stop(text: str, stops: tuple[str, ...], *, search_from: int) -> int | None:
    """Index where the earliest stop sequence begins, looking only where new text could complete one."""
    best: int | None = None
    for stop in stops:
        index = text.find(stop, max(0, search_from - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best
