"""Random PEFT LoRA adapters of a small base, saved as PEFT saves them, and the greedy output of the
merged model (peft's merge_and_unload) as the reference an engine serving the adapter must equal."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...] = ALL_TARGETS
    alpha: int = 16
    rslora: bool = False
    seed: int = 0


def load_base(base_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    from serving.engine.loading import MODEL_LOAD_LOCK

    with MODEL_LOAD_LOCK:
        return AutoModelForCausalLM.from_pretrained(
            base_dir, attn_implementation="sdpa", use_safetensors=True, dtype=torch.float32
        ).eval()


def save_adapter(base: Any, spec: AdapterSpec, out_dir: Path, **config: Any) -> Any:
    """`spec`'s adapter with random A and B (non-zero B: it changes the output) on `base` (which peft
    wraps: pass a fresh copy), saved under `out_dir` as safetensors; returns the peft model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(spec.seed)
    lora_config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.rslora,
        init_lora_weights=False,  # random B too: PEFT's default B = 0 would change nothing
        **config,
    )
    model = get_peft_model(base, lora_config)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return list(out[0, len(prompt) :].tolist())


class MergedReference:
    """An adapter's merged model (peft's merge_and_unload of a fresh base), generate() memoised."""

    def __init__(self, base_dir: Path, spec: AdapterSpec, adapter_dir: Path) -> None:
        self.model = save_adapter(load_base(base_dir), spec, adapter_dir).merge_and_unload().eval()
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._greedy:
            self._greedy[key] = greedy(self.model, prompt, max_tokens)
        return self._greedy[key]
