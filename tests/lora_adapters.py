"""PEFT LoRA adapter directories for tests: made by peft itself from a base model directory, saved as
safetensors, with random A and B (PEFT's default B is zero, which would change nothing)."""

from __future__ import annotations

from pathlib import Path


def build_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int = 4,
    alpha: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
) -> Path:
    """A PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) for the model in `base_dir`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, config)
    with torch.no_grad():  # large enough to move the random demo model's greedy choices
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.mul_(4.0)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return Path(out_dir)
