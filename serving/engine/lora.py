"""A LoRA adapter as the engine serves it: `read_adapter` reads a PEFT LoRA directory
(adapter_config.json + adapter_model.safetensors, never a pickle) into a `LoraAdapter` of CPU tensors,
checked against its base model's config. Pure: callable off the model thread (the replica's preparing
thread, or the registry when it registers one); installing it into a runner is lora_slots.py's.

What it serves is PEFT's plain LoRA on the Llama family's seven projections: a projection W of the
base becomes W x + scaling * B (A x), A [rank, in] and B [out, rank] per layer and target, scaling
lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). Whatever changes that arithmetic is refused by name
(AdapterError), never served wrong: DoRA, LoRA biases, bias training, modules_to_save, per-module
rank or alpha patterns, trainable tokens, other target modules (embeddings, the LM head)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = (*ATTENTION_TARGETS, *MLP_TARGETS)
MAX_CONFIG_BYTES = 1 << 20

# adapter_config.json fields that change what a LoRA computes; each must be unset (falsy).
UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class AdapterError(ValueError):
    """An adapter directory the engine cannot serve, with the reason."""


@dataclass(frozen=True, slots=True, eq=False)
class LoraPair:
    """One projection's low-rank update: A [rank, in] and B [out, rank] (float32, CPU)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    """A checked LoRA adapter. `adapter_id` names its content: the engine's slots and its prefix cache
    key on it, so another version of an adapter must come with another id. `layers[i]` maps each target
    the adapter has in decoder layer i (a name of TARGET_MODULES) to its A and B; a layer it leaves
    alone maps nothing. Compared by identity."""

    adapter_id: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    target_modules: tuple[str, ...]  # in TARGET_MODULES order
    layers: tuple[Mapping[str, LoraPair], ...]

    @property
    def num_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for layer in self.layers for p in layer.values() for t in (p.a, p.b)
        )


def _field(config: Any, name: str, default: Any = None) -> Any:
    """A base config's field, from a transformers config or a config.json mapping."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def projection_shapes(base_config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection in the base model, from its config."""
    text_config = base_config
    get_text_config = getattr(base_config, "get_text_config", None)
    if callable(get_text_config):
        text_config = get_text_config()
    hidden = int(_field(text_config, "hidden_size"))
    heads = int(_field(text_config, "num_attention_heads"))
    kv_heads = int(_field(text_config, "num_key_value_heads") or heads)
    head_dim = int(_field(text_config, "head_dim") or hidden // heads)
    inter = int(_field(text_config, "intermediate_size"))
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{directory} has no {CONFIG_FILE}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(config: dict[str, Any], max_rank: int | None) -> tuple[int, float]:
    """The adapter's rank and scaling, or AdapterError for a config the engine cannot serve."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r}: only LoRA adapters are served")
    unsupported = [label for name, label in UNSUPPORTED_FIELDS.items() if config.get(name)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config.get('bias')!r} (trained biases of the base)")
    if unsupported:
        raise AdapterError(f"the adapter uses what the engine does not serve: {', '.join(unsupported)}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"target_modules must list module names, got {config.get('target_modules')!r}")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise AdapterError(
            f"target modules {', '.join(unknown)} are not served (only {', '.join(TARGET_MODULES)})"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"r must be an integer >= 1, got {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"rank {rank} is over the limit of {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def read_adapter(
    directory: str | Path, adapter_id: str, base_config: Any, *, max_rank: int | None = None
) -> LoraAdapter:
    """The adapter in a PEFT LoRA directory, checked against `base_config` (a transformers config or
    the base's config.json as a mapping): its targets, rank (at most `max_rank` when given) and every
    tensor's shape. Raises AdapterError, naming what is wrong. Only safetensors are read: a directory
    with nothing but adapter_model.bin (a pickle, which can run code when loaded) is refused."""
    directory = Path(directory)
    if not adapter_id:
        raise AdapterError("an adapter needs a non-empty id")
    config = _read_config(directory)
    rank, scaling = _check_config(config, max_rank)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        pickles = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
        found = f" (found {', '.join(sorted(pickles))}: pickles are never loaded)" if pickles else ""
        raise AdapterError(f"{directory} has no {WEIGHTS_FILE}{found}")
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    num_layers = int(_field(base_config, "num_hidden_layers"))
    shapes = projection_shapes(base_config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    others: list[str] = []
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            others.append(key)
            continue
        layer, target, which = int(match[1]), match[2], match[3]
        if target not in TARGET_MODULES:
            others.append(key)
            continue
        if layer >= num_layers:
            raise AdapterError(f"{key}: the base has {num_layers} layers")
        pairs.setdefault((layer, target), {})[which] = tensor
    if others:
        shown = ", ".join(sorted(others)[:5]) + (", …" if len(others) > 5 else "")
        raise AdapterError(f"tensors of modules the engine does not serve: {shown}")
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    layers: list[dict[str, LoraPair]] = [{} for _ in range(num_layers)]
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {target}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        num_in, num_out = shapes[target]
        if tuple(a.shape) != (rank, num_in) or tuple(b.shape) != (num_out, rank):
            raise AdapterError(
                f"layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                f"the base (expected {(rank, num_in)} and {(num_out, rank)})"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"layer {layer} {target}: LoRA weights must be floating point")
        layers[layer][target] = LoraPair(a.float().contiguous(), b.float().contiguous())
    present = {target for _, target in pairs}
    return LoraAdapter(
        adapter_id=adapter_id,
        rank=rank,
        scaling=scaling,
        target_modules=tuple(t for t in TARGET_MODULES if t in present),
        layers=tuple(layers),
    )


def check_adapter_fits(adapter: LoraAdapter, base_config: Any, *, max_rank: int) -> None:
    """AdapterError unless the adapter's rank is at most `max_rank` and its layers and shapes are those
    of the model `base_config` describes (read_adapter checked them against the config it was given,
    which may be another model's)."""
    if adapter.rank > max_rank:
        raise AdapterError(
            f"adapter {adapter.adapter_id!r} has rank {adapter.rank}, over this engine's limit of {max_rank}"
        )
    num_layers = int(_field(base_config, "num_hidden_layers"))
    if len(adapter.layers) != num_layers:
        raise AdapterError(
            f"adapter {adapter.adapter_id!r} has {len(adapter.layers)} layers; the model has {num_layers}"
        )
    shapes = projection_shapes(base_config)
    for index, layer in enumerate(adapter.layers):
        for target, pair in layer.items():
            num_in, num_out = shapes[target]
            if tuple(pair.a.shape) != (adapter.rank, num_in) or tuple(pair.b.shape) != (
                num_out,
                adapter.rank,
            ):
                raise AdapterError(
                    f"adapter {adapter.adapter_id!r}: layer {index} {target} is {num_in} -> {num_out} in "
                    f"the model, {pair.a.shape[1]} -> {pair.b.shape[0]} in the adapter"
                )
