"""Loading a causal LM safely: safetensors only, never remote code."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

# transformers builds a model under process-global state (its default-device and dtype contexts, lazy
# module imports); two loads in two threads at once can leave one of them with meta tensors ("Cannot
# copy out of meta tensor"). An embedded server loads one replica per version in threads, so loads
# take turns. Anything else in the process that calls from_pretrained should hold it too.
MODEL_LOAD_LOCK = threading.RLock()


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
    with MODEL_LOAD_LOCK:
        model: Any = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        return model.to(device or default_device).eval()
