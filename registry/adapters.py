"""A LoRA adapter's registration checks (docs/architecture.md, "Adapters on a shared base"): a PEFT
directory (adapter_config.json and adapter_model.safetensors) checked against the base version it applies
to, from its config and the safetensors headers alone (no torch in the registry): the LoRA kinds a
replica serves, its rank and alpha, and every lora_A/lora_B pair against the base's weight of that
module. A replica reads the same directory again with the engine's own checks
(serving/engine/lora.py); these refuse, at registration, what it would refuse on the first request."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from registry.artifacts import ArtifactError, compute_manifest
from registry.models import Model, ModelVersion
from registry.safetensors_header import SafetensorsHeaderError, tensor_shapes

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's key for a module's pair: base_model.model.<module>.lora_A.weight (lora_B: [out, r]; lora_A: [r, in]).
KEY_PREFIX = "base_model.model."
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})
# The projections a replica applies LoRA to (the Llama family's; serving/engine/lora.py's TARGET_MODULES,
# which a test holds equal).
SERVED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# What PEFT can set that a replica's batched LoRA (scaling alpha / r on the base's Linear layers) does not
# apply: refused at registration rather than when a replica loads it (serving/engine/lora.py's
# UNSUPPORTED_FIELDS, and bias, which a test holds in step). Each is the value that means "not used".
UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "trainable_token_indices": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "target_parameters": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
}


class AdapterRefused(ArtifactError):
    """An adapter that cannot be registered on that base; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class AdapterSummary:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # the module names it adapts (q_proj, v_proj, …)
    num_modules: int  # the layers' modules it adapts


def check_base(base: ModelVersion, *, owner_id: int | None) -> None:
    """Refuse a base an adapter cannot apply to: not a causal LM, an adapter itself, or a tenant's own
    model when the adapter is not that tenant's (`owner_id`: the adapter model's owner; None: the
    platform's), which is answered as not found, as that tenant's model is to any other."""
    label = f"{base.model.name}:{base.version}"
    if base.model.owner_id not in (None, owner_id):
        raise AdapterRefused(f"no base version {label}")
    if base.model.kind != Model.Kind.CAUSAL_LM:
        raise AdapterRefused(
            f"{label} is a {base.model.kind} model; an adapter's base must be a causal-lm one"
        )
    if base.adapter_of_id is not None:
        raise AdapterRefused(f"{label} is itself an adapter; an adapter's base must be a full model")


def check_adapter(directory: Path, base: ModelVersion) -> AdapterSummary:
    """Refuse an adapter directory that does not fit `base`'s weights (read from its artifact)."""
    config = _config(directory / ADAPTER_CONFIG)
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterRefused(f"no {ADAPTER_WEIGHTS} in the adapter directory")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    max_rank = settings.REPLICA_MAX_LORA_RANK
    if type(rank) is not int or not 1 <= rank <= max_rank:
        raise AdapterRefused(f"adapter rank r={rank!r}: must be an integer from 1 to {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
        raise AdapterRefused(f"adapter lora_alpha={alpha!r}: must be a positive number")
    targets = config.get("target_modules")
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterRefused(f"target_modules must be a list of module names, got {targets!r}")
    unserved = sorted(set(targets) - set(SERVED_TARGETS))
    if unserved:
        raise AdapterRefused(
            f"target modules {', '.join(unserved)} are not served (only {', '.join(SERVED_TARGETS)})"
        )
    pairs = _pairs(weights)
    base_shapes = _base_shapes(Path(base.artifact_uri))
    label = f"{base.model.name}:{base.version}"
    for target in sorted(set(targets)):
        if not any(
            _is_linear(shape) and _names(name[: -len(".weight")], target)
            for name, shape in base_shapes.items()
        ):
            raise AdapterRefused(f"target module {target!r} matches no Linear layer of {label}")
    for module, (a_shape, b_shape) in sorted(pairs.items()):
        if not any(_names(module, target) for target in targets):
            raise AdapterRefused(f"{module} has LoRA weights but is not among target_modules")
        base_shape = base_shapes.get(f"{module}.weight")
        if base_shape is None or not _is_linear(base_shape):
            raise AdapterRefused(f"{module} is no Linear layer of {label}")
        out_features, in_features = base_shape
        if a_shape != [rank, in_features] or b_shape != [out_features, rank]:
            raise AdapterRefused(
                f"{module}: lora_A {a_shape} and lora_B {b_shape} do not fit rank {rank} on {label}'s "
                f"weight {base_shape} (expected [{rank}, {in_features}] and [{out_features}, {rank}])"
            )
    return AdapterSummary(rank, float(alpha), tuple(sorted(set(targets))), len(pairs))


def verify_adapter_dir(directory: Path, *, sha256: str) -> None:
    """A replica's check before it reads an adapter: the files are those the registry recorded (their
    digest), with no symbolic link among them, as artifacts.verify checks a model's."""
    if not directory.is_dir():
        raise ArtifactError(f"adapter directory {directory} is missing")
    if directory.is_symlink() or any(p.is_symlink() for p in directory.rglob("*")):
        raise ArtifactError(f"adapter {directory} contains symbolic links; refusing to load")
    if compute_manifest(directory).sha256 != sha256:
        raise ArtifactError(
            f"adapter {directory} does not match its registered digest {sha256[:12]}…; refusing to load"
        )


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AdapterRefused(f"{ADAPTER_CONFIG} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterRefused(f"{ADAPTER_CONFIG} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterRefused(
            f"{ADAPTER_CONFIG} has peft_type {config.get('peft_type')!r}; only LORA is served"
        )
    for key, unused in UNSUPPORTED.items():
        value = config.get(key, unused)
        if value != unused and value not in (None, False, {}, []):
            raise AdapterRefused(f"{ADAPTER_CONFIG} sets {key}={value!r}, which replicas do not serve")
    return config


def _pairs(weights: Path) -> dict[str, tuple[list[int], list[int]]]:
    """Module -> (lora_A's shape, lora_B's shape); refuses a tensor of any other name or a lone half."""
    try:
        tensors = tensor_shapes(weights)
    except SafetensorsHeaderError as exc:
        raise AdapterRefused(f"{ADAPTER_WEIGHTS} is not a valid safetensors file: {exc}") from None
    halves: dict[str, dict[str, list[int]]] = {}
    for name, (dtype, shape) in tensors.items():
        if not name.startswith(KEY_PREFIX) or not name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterRefused(f"{ADAPTER_WEIGHTS} holds {name!r}, which is no LoRA A or B weight")
        if dtype not in FLOAT_DTYPES:
            raise AdapterRefused(f"{name} is {dtype}; LoRA weights must be F32, F16 or BF16")
        module, half = name[len(KEY_PREFIX) : -len(".weight")].rsplit(".", 1)
        halves.setdefault(module, {})[half] = shape
    if not halves:
        raise AdapterRefused(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    for module, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterRefused(f"{module} has {', '.join(sorted(pair))} without its other half")
    return {module: (pair["lora_A"], pair["lora_B"]) for module, pair in halves.items()}


def _base_shapes(base_dir: Path) -> dict[str, list[int]]:
    """Every tensor's shape over the base artifact's safetensors files."""
    shapes: dict[str, list[int]] = {}
    try:
        for path in sorted(base_dir.glob("*.safetensors")):
            shapes.update({name: shape for name, (_, shape) in tensor_shapes(path).items()})
    except (OSError, SafetensorsHeaderError) as exc:
        raise AdapterRefused(f"the base's weights in {base_dir} could not be read: {exc}") from None
    if not shapes:
        raise AdapterRefused(f"the base's artifact {base_dir} holds no weights")
    return shapes


def _names(module: str, target: str) -> bool:
    """Whether a target_modules entry names the module, as PEFT matches a name: the whole name or its end."""
    return module == target or module.endswith(f".{target}")


def _is_linear(shape: list[int]) -> bool:
    return len(shape) == 2
