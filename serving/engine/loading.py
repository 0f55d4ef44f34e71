"""Loading a causal LM safely: safetensors only, never remote code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class ModelLoadError(ValueError):
    pass


def default_device_and_dtype() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)


def load_causal_lm(
    model_dir: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> Any:
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"no *.safetensors weights in {path}; other formats are refused")
    default_device, default_dtype = default_device_and_dtype()
    kwargs: dict[str, Any] = {
        "use_safetensors": True,
        "trust_remote_code": False,
        "dtype": dtype or default_dtype,
    }
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return model.to(device or default_device).eval()
