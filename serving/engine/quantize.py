"""Writing a quantized sibling of a model directory: weight-only int8, one symmetric scale per output
channel, for every Linear layer but the LM head (docs/architecture.md, "Quantized siblings").

The LM head and the embeddings stay in their dtype: the embedding is a lookup, not a matmul (int8 would
save bytes but nothing of a forward's time), and the LM head sets every logit, so its error lands on
every token's choice; in a small model it is also, very often, the embedding itself (tied). The sibling
is a safetensors directory like any other (the int8 weights under their own names, `<layer>.weight_scale`
beside each), with config.json's `switchyard_quantization` entry saying which layers are int8; transformers'
own `quantization_config` is not used, because each of its methods needs a library (torchao,
bitsandbytes, …) or code this platform never loads."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from serving.engine.int8_linear import quantize_per_channel
from serving.engine.int8_loading import INT8_WEIGHT, METHODS, QUANTIZATION_KEY, quantization_of
from serving.engine.loading import load_causal_lm

WEIGHTS_FILE = "model.safetensors"
SCHEME = "per-output-channel symmetric"


class QuantizationError(ValueError):
    """A directory that cannot be quantized (or not by that method); the message says why."""


@dataclass(frozen=True, slots=True)
class QuantizedArtifact:
    directory: Path
    method: str
    modules: tuple[str, ...]  # the layers made int8
    kept: tuple[str, ...]  # the Linear layers left in their dtype (the LM head)
    weight_bytes: int  # the sibling's safetensors files
    source_weight_bytes: int

    @property
    def weight_ratio(self) -> float:
        return self.weight_bytes / self.source_weight_bytes


def quantizable_linears(model: nn.Module) -> tuple[list[str], list[str]]:
    """(the Linear layers to make int8, those kept): every nn.Linear but the model's output embeddings."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    chosen: list[str] = []
    kept: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            (kept if module is head else chosen).append(name)
    return chosen, kept


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def write_int8_sibling(
    source_dir: str | Path, out_dir: str | Path, *, method: str = INT8_WEIGHT
) -> QuantizedArtifact:
    """Write the int8 sibling of the model in `source_dir` into `out_dir` (empty or new)."""
    source, out = Path(source_dir), Path(out_dir)
    if method not in METHODS:
        raise QuantizationError(f"unknown quantization method {method!r}; known: {', '.join(METHODS)}")
    if quantization_of(source) is not None:
        raise QuantizationError(f"{source} is already quantized ({quantization_of(source)})")
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise QuantizationError(f"{source} is already quantized (its config has a quantization_config)")
    # The model, to know which tensors are Linear weights; the tensors themselves come from the files,
    # as saved (a tied LM head is not there twice).
    model = load_causal_lm(source, device="cpu", dtype=torch.float32)
    chosen, kept = quantizable_linears(model)
    del model
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for name in chosen:
        key = f"{name}.weight"
        if key not in tensors:
            raise QuantizationError(f"{source}: the checkpoint has no {key} (saved under other names?)")
        tensors[key], tensors[f"{name}.weight_scale"] = quantize_per_channel(tensors[key])
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"}
    )
    for file in sorted(source.iterdir()):
        if file.is_file() and not file.name.startswith(".") and ".safetensors" not in file.name:
            shutil.copyfile(file, out / file.name)
    config[QUANTIZATION_KEY] = quantization_entry(method, chosen, kept)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return QuantizedArtifact(
        directory=out,
        method=method,
        modules=tuple(chosen),
        kept=tuple(kept),
        weight_bytes=weight_bytes(out),
        source_weight_bytes=weight_bytes(source),
    )


def quantization_entry(method: str, modules: list[str], kept: list[str]) -> dict[str, Any]:
    return {"method": method, "bits": 8, "scheme": SCHEME, "modules": modules, "kept": kept}
