"""How many accelerators a load needs under latency objectives: the closed-form arithmetic.

From a model, an accelerator, a workload and the objectives (docs/capacity.md says each assumption):

1. KV bytes per token (ModelSpec) and the memory left for KV: the accelerator's, less the weights and
   an activation reserve, cut into blocks of `block_size` tokens.
2. Sequences a replica holds: paged, each holds the blocks of its mean resident context (its prompt and
   half its output: a sequence's KV grows from the prompt to prompt + output while it decodes), rounded
   up to whole blocks; contiguous, each reserves the model's whole context (and, for comparison, only
   its own longest request).
3. The batch cap that holds TPOT: the most sequences whose decode step, with the prompt tokens that ride
   along in steady state (mean prompt / mean output a sequence a step), stays within the objective.
4. The batch a replica runs is the smaller of the two; its throughput is batch / step / output tokens
   requests a second, and the replicas are the rate over that throughput at the target utilisation.
5. The monthly cost: replicas x $/hour x 730 hours.

rollouts.fleet.plan_simulation runs the plan through the fleet simulator."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollouts.fleet.accelerators import GB, Accelerator
from rollouts.fleet.step_time_model import ModelSpec, StepTimeModel

HOURS_PER_MONTH = 730


@dataclass(frozen=True, slots=True)
class Workload:
    rate_per_s: float
    prompt_tokens: tuple[int, int]  # uniform between the two, inclusive
    output_tokens: tuple[int, int]

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s > 0):
            raise ValueError(f"the rate must be > 0 requests a second, got {self.rate_per_s!r}")
        for name, (low, high) in (("prompt", self.prompt_tokens), ("output", self.output_tokens)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} tokens need 1 <= low <= high, got {low}-{high}")

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompt_tokens) / 2

    @property
    def mean_output(self) -> float:
        return sum(self.output_tokens) / 2

    @property
    def longest(self) -> int:
        return self.prompt_tokens[1] + self.output_tokens[1]

    @property
    def mean_resident_context(self) -> float:
        """A running sequence's mean KV length: its prompt, and half its output on average."""
        return self.mean_prompt + self.mean_output / 2


@dataclass(frozen=True, slots=True)
class Objectives:
    p99_ttft_ms: float
    tpot_ms: float
    utilisation: float  # the share of a replica's throughput the fleet is sized to use

    def __post_init__(self) -> None:
        if not (self.p99_ttft_ms > 0 and self.tpot_ms > 0 and math.isfinite(self.p99_ttft_ms + self.tpot_ms)):
            raise ValueError("the TTFT and TPOT objectives must be > 0 ms")
        if not 0 < self.utilisation <= 1:
            raise ValueError(f"the target utilisation must be in (0, 1], got {self.utilisation!r}")


@dataclass(frozen=True, slots=True)
class Memory:
    """One replica's memory, in bytes, and the KV cache it leaves."""

    total: float
    weights: float
    reserve: float  # activations, the CUDA context, workspaces
    kv_budget: float
    kv_per_token: float
    block_size: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class Concurrency:
    """How many sequences one replica runs, and what holds it there."""

    blocks_per_seq: int  # the mean resident context, rounded up to whole blocks
    paged_seqs: int
    contiguous_seqs: int  # each reserving the model's max context
    contiguous_own_seqs: int  # each reserving only the workload's longest request
    tpot_batch_cap: int
    batch: int  # min(paged_seqs, tpot_batch_cap)
    limited_by: str


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    model: ModelSpec
    accelerator: Accelerator
    workload: Workload
    objectives: Objectives
    step_time: StepTimeModel
    memory: Memory
    concurrency: Concurrency
    step_s: float  # a decode step at `batch`, prompts riding along
    token_budget: int  # tokens a compute-bound step does within the TPOT objective (the prefill chunk)
    replica_req_s: float  # one replica's throughput at `batch`
    replicas: int
    monthly_usd: float

    @property
    def prefill_per_decode(self) -> float:
        return self.workload.mean_prompt / self.workload.mean_output


def plan_capacity(
    model: ModelSpec,
    accelerator: Accelerator,
    workload: Workload,
    objectives: Objectives,
    *,
    reserve_gb: float = 1.0,
    block_size: int = 16,
) -> CapacityPlan:
    """The closed form (the module's docstring). ValueError, saying why, where no replica can hold
    the objective or a request."""
    if not (math.isfinite(reserve_gb) and reserve_gb >= 0):
        raise ValueError(f"the activation reserve must be >= 0 GB, got {reserve_gb!r}")
    if block_size < 1:
        raise ValueError(f"the block size must be >= 1 token, got {block_size}")
    if workload.longest > model.max_context:
        raise ValueError(
            f"a request of up to {workload.longest} tokens does not fit the model's "
            f"{model.max_context}-token context"
        )
    memory = _memory(model, accelerator, reserve_gb * GB, block_size)
    step_time = StepTimeModel.fit(model, accelerator)
    concurrency = _concurrency(model, workload, objectives, memory, step_time)
    prefill_per_decode = workload.mean_prompt / workload.mean_output
    batch = concurrency.batch
    step_s = step_time.decode_step_s(batch, workload.mean_resident_context, batch * prefill_per_decode)
    replica_req_s = batch / step_s / workload.mean_output
    replicas = math.ceil(workload.rate_per_s / (replica_req_s * objectives.utilisation) - 1e-9)
    return CapacityPlan(
        model=model,
        accelerator=accelerator,
        workload=workload,
        objectives=objectives,
        step_time=step_time,
        memory=memory,
        concurrency=concurrency,
        step_s=step_s,
        token_budget=step_time.token_budget(objectives.tpot_ms / 1000),
        replica_req_s=replica_req_s,
        replicas=replicas,
        monthly_usd=replicas * accelerator.usd_per_hour * HOURS_PER_MONTH,
    )


def _memory(model: ModelSpec, accelerator: Accelerator, reserve: float, block_size: int) -> Memory:
    total = accelerator.memory_bytes
    kv_budget = total - model.weights_bytes - reserve
    if kv_budget <= 0:
        raise ValueError(
            f"{model.name}'s weights ({model.weights_bytes / GB:.1f} GB) and the {reserve / GB:g} GB reserve "
            f"leave no room for KV on {accelerator.name}'s {accelerator.memory_gb:g} GB"
        )
    kv_per_token = model.kv_bytes_per_token
    num_blocks = math.floor(kv_budget / (kv_per_token * block_size))
    return Memory(total, model.weights_bytes, reserve, kv_budget, kv_per_token, block_size, num_blocks)


def _concurrency(
    model: ModelSpec, workload: Workload, objectives: Objectives, memory: Memory, step_time: StepTimeModel
) -> Concurrency:
    blocks_per_seq = math.ceil(workload.mean_resident_context / memory.block_size)
    paged = memory.num_blocks // blocks_per_seq
    longest_blocks = math.ceil(workload.longest / memory.block_size)
    if memory.num_blocks < longest_blocks:
        raise ValueError(
            f"the KV cache ({memory.num_blocks} blocks of {memory.block_size} tokens) cannot hold one "
            f"{workload.longest}-token request"
        )
    contiguous = math.floor(memory.kv_budget / (memory.kv_per_token * model.max_context))
    contiguous_own = math.floor(memory.kv_budget / (memory.kv_per_token * workload.longest))
    tpot_s = objectives.tpot_ms / 1000
    cap = step_time.max_batch(
        tpot_s, workload.mean_resident_context, workload.mean_prompt / workload.mean_output
    )
    if cap < 1:
        raise ValueError(
            f"no batch holds a {objectives.tpot_ms:g} ms TPOT: reading the weights alone takes "
            f"{1000 * step_time.weights_s:.1f} ms a step on this accelerator"
        )
    batch = min(paged, cap)
    limited_by = (
        f"KV memory ({paged} paged sequences; TPOT allows {cap})"
        if paged < cap
        else f"the TPOT objective ({cap}; KV memory holds {paged})"
    )
    return Concurrency(blocks_per_seq, paged, contiguous, contiguous_own, cap, batch, limited_by)
