"""A random LoRA adapter for a local model, written as PEFT saves one (adapter_config.json and
adapter_model.safetensors): the README's adapter example (`manage.py create_demo_model DIR --adapter-of
MODEL_DIR`) and `bench lora` use it, where no fine-tune can be downloaded. A's scale is PEFT's
initialisation's; B is small and non-zero (PEFT starts it at zero, which would change nothing), enough
to move the random demo model's greedy choices within a few tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from serving.engine.lora import (
    ATTENTION_TARGETS,
    CONFIG_FILE,
    TARGET_MODULES,
    WEIGHTS_FILE,
    projection_shapes,
)


def write_random_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int,
    seed: int,
    targets: tuple[str, ...] = TARGET_MODULES,
) -> Path:
    """A random rank-`rank` adapter of `targets` of the model in `base_dir`, in `out_dir` (kept if one is
    there already)."""
    if (out_dir / WEIGHTS_FILE).exists():
        return out_dir
    config = json.loads((base_dir / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target, (num_in, num_out) in projection_shapes(config).items():
            if target not in targets:
                continue
            kind = "self_attn" if target in ATTENTION_TARGETS else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, num_in, generator=generator) / num_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(num_out, rank, generator=generator) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}
    (out_dir / CONFIG_FILE).write_text(json.dumps(adapter_config))
    return out_dir
