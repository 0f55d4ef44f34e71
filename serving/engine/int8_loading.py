"""Loading a quantized sibling (serving/engine/quantize.py wrote it): the model built from its config with
no weights initialised, the layers the config lists swapped for Int8Linear, and every tensor loaded from
its safetensors. Nothing may be missing (but a tied LM head) or left over: a weight not in the checkpoint
would otherwise be uninitialised memory.

The caller (loading.py) holds the process's model lock and has checked that the directory has
safetensors; this module imports nothing of loading.py, which imports it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from serving.engine.int8_linear import Int8Linear

QUANTIZATION_KEY = "switchyard_quantization"  # config.json's entry that marks a quantized sibling
INT8_WEIGHT = "int8-weight"
METHODS = (INT8_WEIGHT,)


class Int8LoadError(ValueError):
    pass


def quantization_of(model_dir: str | Path) -> dict[str, Any] | None:
    """config.json's quantization entry (method, scheme, modules), or None for a float model."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # transformers' own load says what is wrong with it
    entry = config.get(QUANTIZATION_KEY) if isinstance(config, dict) else None
    return entry if isinstance(entry, dict) else None


def load_int8_pretrained(
    auto_class: Any,
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    attn_implementation: str | None,
) -> Any:
    """The quantized model in `model_dir` on the CPU, in `dtype` (its scales and float tensors too)."""
    path = Path(model_dir)
    entry = quantization_of(path) or {}
    if entry.get("method") not in METHODS:
        raise Int8LoadError(f"{path}: unknown quantization method {entry.get('method')!r}")
    modules = entry.get("modules")
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise Int8LoadError(f"{path}: config.json's {QUANTIZATION_KEY} lists no modules")
    # Deferred as loading.py's are: transformers is only imported under the model lock.
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with no_init_weights():  # every tensor is loaded below, and checked to be
        model = auto_class.from_config(config, **kwargs)
    for name in modules:
        _swap(model, name, dtype)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape that does not match its module
        raise Int8LoadError(f"{path}: {exc}") from None
    tied = {"lm_head.weight"} if getattr(config.get_text_config(), "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise Int8LoadError(
            f"{path}: the checkpoint does not match its model (missing: {', '.join(missing[:4]) or 'none'}; "
            f"unexpected: {', '.join(unexpected[:4]) or 'none'}); refused rather than initialised at random"
        )
    if tied:
        model.tie_weights()
    return model


def _swap(model: nn.Module, name: str, dtype: torch.dtype) -> None:
    parent_name, _, attribute = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    linear = getattr(parent, attribute, None)
    if not isinstance(linear, nn.Linear):
        raise Int8LoadError(f"{name} is not a Linear layer of this model ({type(linear).__name__})")
    setattr(
        parent,
        attribute,
        Int8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=dtype),
    )


def num_int8_linears(model: nn.Module) -> int:
    return sum(1 for module in model.modules() if isinstance(module, Int8Linear))
