"""A model's size and a step's time on an accelerator, from the data sheet (a roofline).

A step reads every weight once and the KV of every position its sequences attend over, and does two
FLOPs per parameter for each token it computes. It takes the longer of the two:

    step = max((weights + KV read) / bandwidth, tokens x 2 x parameters / FLOP/s)

A decode step (one token a sequence) is memory-bound at small batches: its time is the weights' read,
shared by the batch, plus each sequence's KV. A prefill chunk (hundreds of tokens) is compute-bound.
Attention's own FLOPs (4 x layers x hidden x context a token) are left out: under 2% of a 13B model's
at a 600-token context. Peak figures: docs/capacity.md says what that assumes."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from rollouts.fleet.accelerators import Accelerator


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder's size. KV per token is 2 (K and V) x layers x KV heads x head dim x dtype bytes, or
    given outright (`kv_bytes_per_token`); with neither KV heads nor head dim, full multi-head
    attention: KV heads x head dim = hidden."""

    name: str
    params: float  # parameters
    layers: int
    hidden: int
    dtype_bytes: float = 2.0
    kv_heads: int | None = None
    head_dim: int | None = None
    kv_bytes_override: float | None = None
    max_context: int = 2048  # tokens: what a contiguous KV cache reserves for every sequence

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "dtype_bytes", "max_context"):
            _positive(f"the model's {name.replace('_', ' ')}", getattr(self, name))
        if (self.kv_heads is None) != (self.head_dim is None):
            raise ValueError("give both --kv-heads and --head-dim, or neither (full multi-head attention)")
        for name in ("kv_heads", "head_dim", "kv_bytes_override"):
            value = getattr(self, name)
            if value is not None:
                _positive(f"the model's {name.replace('_', ' ')}", value)

    @property
    def kv_bytes_per_token(self) -> float:
        if self.kv_bytes_override is not None:
            return self.kv_bytes_override
        width = (
            self.hidden if self.kv_heads is None or self.head_dim is None else self.kv_heads * self.head_dim
        )
        return 2 * self.layers * width * self.dtype_bytes

    @property
    def weights_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def flops_per_token(self) -> float:
        return 2 * self.params


class _Scheduled(Protocol):
    """What a step's time is read from: serving.engine.scheduler.ScheduledSequence, structurally."""

    @property
    def num_new_tokens(self) -> int: ...

    @property
    def seq(self) -> _Computed: ...


class _Computed(Protocol):
    @property
    def num_computed_tokens(self) -> int: ...


class _Step(Protocol):
    @property
    def scheduled(self) -> Iterable[_Scheduled]: ...


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """The roofline's three constants for one model on one accelerator, in seconds."""

    weights_s: float  # reading every weight once
    kv_token_s: float  # reading one position's KV
    token_s: float  # computing one token (2 x parameters FLOPs)

    @classmethod
    def fit(cls, model: ModelSpec, accelerator: Accelerator) -> StepTimeModel:
        return cls(
            weights_s=model.weights_bytes / accelerator.bandwidth_bytes_s,
            kv_token_s=model.kv_bytes_per_token / accelerator.bandwidth_bytes_s,
            token_s=model.flops_per_token / accelerator.flop_s,
        )

    def step_s(self, num_tokens: float, context_tokens: float) -> float:
        """A step computing `num_tokens` over `context_tokens` positions of KV in all."""
        return max(self.weights_s + context_tokens * self.kv_token_s, num_tokens * self.token_s)

    def decode_step_s(self, batch: float, context: float, prefill_tokens: float = 0.0) -> float:
        """`batch` sequences decoding at a mean `context`, with `prefill_tokens` of prompts riding along."""
        return self.step_s(batch + prefill_tokens, batch * context + prefill_tokens)

    def max_batch(self, step_s: float, context: float, prefill_per_decode: float = 0.0) -> int:
        """The most sequences decoding at `context` (each bringing `prefill_per_decode` prompt tokens a
        step) whose step stays within `step_s`: 0 where even the weights' read is longer."""
        memory = (step_s - self.weights_s) / ((context + prefill_per_decode) * self.kv_token_s)
        compute = step_s / ((1 + prefill_per_decode) * self.token_s)
        return max(0, math.floor(min(memory, compute) + 1e-9))

    def token_budget(self, step_s: float) -> int:
        """The most tokens one compute-bound step does within `step_s`: a prefill chunk's size."""
        return max(1, math.floor(step_s / self.token_s + 1e-9))

    def crossover_batch(self, context: float) -> float:
        """The batch at which a decode step turns compute-bound."""
        per_seq = self.token_s - context * self.kv_token_s
        return math.inf if per_seq <= 0 else self.weights_s / per_seq


@dataclass(frozen=True, slots=True)
class RooflineLatency:
    """The roofline as the fleet simulator's latency model (rollouts.fleet.simulator.StepLatency): a
    scheduled step's time from its tokens and the positions they attend over."""

    model: StepTimeModel

    def step_ms(self, output: _Step) -> float:
        """Between schedule() and update(), while num_computed_tokens is the step's start."""
        num_tokens = 0
        context = 0
        for item in output.scheduled:
            num_tokens += item.num_new_tokens
            context += item.seq.num_computed_tokens + item.num_new_tokens
        return 1000 * self.model.step_s(num_tokens, context)

    def base_step_ms(self, context_tokens: int = 0) -> float:
        """One sequence decoding over `context_tokens`: what a replica times at warm-up."""
        return 1000 * self.model.step_s(1, context_tokens)
