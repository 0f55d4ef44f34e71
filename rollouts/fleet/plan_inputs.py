"""What a capacity plan is asked about: a named scenario, or flags, or a scenario with flags over it.

`PlanOverrides` holds what the command was given (None: not given); `resolve` fills the rest from the
preset, and says which figures are missing where there is none."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rollouts.fleet.accelerators import Accelerator, accelerator_named
from rollouts.fleet.capacity_plan import Objectives, Workload
from rollouts.fleet.step_time_model import ModelSpec


@dataclass(frozen=True, slots=True)
class Scenario:
    model: ModelSpec
    accelerator: Accelerator
    workload: Workload
    objectives: Objectives


# Llama-13B's shape: 40 layers, 5120 hidden, 40 heads of 128; fp16.
_LLAMA_13B = ModelSpec(
    "13b-fp16",
    params=13e9,
    layers=40,
    hidden=5120,
    dtype_bytes=2,
    kv_heads=40,
    head_dim=128,
    max_context=2048,
)

SCENARIOS: dict[str, Scenario] = {
    # A 13B fp16 chat model on 40 GB A100s at 1,000 req/s, 500 prompt and 200 output tokens.
    "13b-a100": Scenario(
        _LLAMA_13B,
        accelerator_named("a100-40gb"),
        Workload(1000.0, (500, 500), (200, 200)),
        Objectives(p99_ttft_ms=500.0, tpot_ms=30.0, utilisation=0.7),
    ),
}


@dataclass(frozen=True, slots=True)
class PlanOverrides:
    # the model
    model_name: str | None = None
    params: float | None = None
    layers: int | None = None
    hidden: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    kv_bytes_per_token: float | None = None
    dtype_bytes: float | None = None
    max_context: int | None = None
    # the accelerator: a preset's name, or figures over it (all four without one)
    accelerator: str | None = None
    memory_gb: float | None = None
    bandwidth_gb_s: float | None = None
    tflops: float | None = None
    usd_per_hour: float | None = None
    # the workload and the objectives
    rate: float | None = None
    prompt_tokens: tuple[int, int] | None = None
    output_tokens: tuple[int, int] | None = None
    p99_ttft_ms: float | None = None
    tpot_ms: float | None = None
    utilisation: float | None = None


def scenario_named(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"no preset {name!r}; presets: {', '.join(SCENARIOS)}") from None


def resolve(preset: str | None, given: PlanOverrides) -> Scenario:
    """The scenario the flags describe, over `preset` when one is named. ValueError naming the missing
    flags, or the figure that is out of range."""
    base = scenario_named(preset) if preset is not None else None
    return Scenario(
        _model(base.model if base else None, given),
        _accelerator(base.accelerator if base else None, given),
        _workload(base.workload if base else None, given),
        _objectives(base.objectives if base else None, given),
    )


def _missing(flags: list[str], what: str) -> ValueError:
    names = ", ".join(f"--{f.replace('_', '-')}" for f in flags)
    return ValueError(f"{what} needs {names} (or a --preset)")


def _model(base: ModelSpec | None, given: PlanOverrides) -> ModelSpec:
    if base is None:
        missing = [f for f in ("params", "layers", "hidden") if getattr(given, f) is None]
        if missing:
            raise _missing(missing, "the model")
        base = ModelSpec(given.model_name or "model", params=1.0, layers=1, hidden=1)
    changes: dict[str, object] = {
        name: getattr(given, name)
        for name in ("params", "layers", "hidden", "kv_heads", "head_dim", "dtype_bytes", "max_context")
        if getattr(given, name) is not None
    }
    if given.model_name is not None:
        changes["name"] = given.model_name
    if given.kv_bytes_per_token is not None:
        changes["kv_bytes_override"] = given.kv_bytes_per_token
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]  # validated in __post_init__


def _accelerator(base: Accelerator | None, given: PlanOverrides) -> Accelerator:
    if given.accelerator is not None:
        base = accelerator_named(given.accelerator)
    figures = ("memory_gb", "bandwidth_gb_s", "tflops", "usd_per_hour")
    changes = {name: getattr(given, name) for name in figures if getattr(given, name) is not None}
    if base is None:
        missing = [f for f in figures if f not in changes]
        if missing:
            raise _missing(missing, "an accelerator without --accelerator")
        return Accelerator("custom", **changes)
    return dataclasses.replace(base, **changes)


def _workload(base: Workload | None, given: PlanOverrides) -> Workload:
    if base is None:
        missing = [f for f in ("rate", "prompt_tokens", "output_tokens") if getattr(given, f) is None]
        if missing:
            raise _missing(missing, "the workload")
    rate = given.rate if given.rate is not None else base.rate_per_s if base else 0.0
    prompt = given.prompt_tokens or (base.prompt_tokens if base else (1, 1))
    output = given.output_tokens or (base.output_tokens if base else (1, 1))
    return Workload(rate, prompt, output)


def _objectives(base: Objectives | None, given: PlanOverrides) -> Objectives:
    if base is None:
        missing = [f for f in ("p99_ttft_ms", "tpot_ms") if getattr(given, f) is None]
        if missing:
            raise _missing(missing, "the objectives")
        base = Objectives(p99_ttft_ms=1.0, tpot_ms=1.0, utilisation=0.7)
    changes = {
        name: getattr(given, name)
        for name in ("p99_ttft_ms", "tpot_ms", "utilisation")
        if getattr(given, name) is not None
    }
    return dataclasses.replace(base, **changes)
