"""A capacity plan as text, its arithmetic shown: what `manage.py simulate plan` prints."""

from __future__ import annotations

import math

from rollouts.fleet.accelerators import GB
from rollouts.fleet.capacity_plan import HOURS_PER_MONTH, CapacityPlan
from rollouts.fleet.plan_simulation import SimulatedPlan, SimulationSettings
from rollouts.fleet.step_time_model import ModelSpec, StepTimeModel

MB = 10**6


def _tokens(span: tuple[int, int]) -> str:
    low, high = span
    return f"{low}" if low == high else f"{low}-{high}"


def _kv_arithmetic(model: ModelSpec) -> str:
    if model.kv_bytes_override is not None:
        return "given"
    if model.kv_heads is None or model.head_dim is None:
        width = f"{model.hidden} hidden"
    else:
        width = f"{model.kv_heads} KV heads x {model.head_dim} head dim"
    return f"2 (K,V) x {model.layers} layers x {width} x {model.dtype_bytes:g} bytes"


def _crossover(batch: float, context: float, st: StepTimeModel) -> str:
    if batch == math.inf:
        return (
            f"decode never turns compute-bound at {context:g} tokens (a sequence's KV read, "
            f"{context * st.kv_token_s * 1000:.2f} ms, outlasts its compute)"
        )
    return f"decode turns compute-bound past {batch:.0f} sequences at {context:g} tokens"


def plan_lines(plan: CapacityPlan) -> list[str]:
    model, acc, load, slo = plan.model, plan.accelerator, plan.workload, plan.objectives
    mem, conc, st = plan.memory, plan.concurrency, plan.step_time
    kv_mb = mem.kv_per_token / MB
    context = load.mean_resident_context
    ride = plan.prefill_per_decode
    ms, us = 1000, 1e6
    memory_cap = (slo.tpot_ms / ms - st.weights_s) / ((context + ride) * st.kv_token_s)
    compute_cap = slo.tpot_ms / ms / ((1 + ride) * st.token_s)
    crossover = st.crossover_batch(context)
    usable = slo.utilisation * plan.replica_req_s
    from_zero = (load.mean_prompt + load.mean_output) / 2
    from_zero_seqs = math.floor(mem.num_blocks * mem.block_size / from_zero)
    from_zero_replicas = math.ceil(plan.replicas * conc.batch / max(from_zero_seqs, 1))  # steps as long
    return [
        f"Capacity plan: {model.name} ({model.params / 1e9:g}B parameters, "
        f"{model.weights_bytes / GB:.1f} GB of weights) on {acc.name} ({acc.memory_gb:g} GB, "
        f"{acc.bandwidth_gb_s:g} GB/s, {acc.tflops:g} TFLOP/s, ${acc.usd_per_hour:g}/h)",
        f"  load: {load.rate_per_s:g} req/s, {_tokens(load.prompt_tokens)} prompt and "
        f"{_tokens(load.output_tokens)} output tokens; objectives: p99 TTFT <= {slo.p99_ttft_ms:g} ms, "
        f"TPOT <= {slo.tpot_ms:g} ms, {slo.utilisation:.0%} utilisation",
        f"KV per token:   {_kv_arithmetic(model)} = {mem.kv_per_token:,.0f} B ({kv_mb:.2f} MB)",
        f"KV memory:      {mem.total / GB:g} GB - {mem.weights / GB:.1f} GB weights - "
        f"{mem.reserve / GB:g} GB reserve = {mem.kv_budget / GB:.2f} GB = {mem.num_blocks} blocks of "
        f"{mem.block_size} tokens",
        f"Step time:      max({st.weights_s * ms:.2f} ms weights + {st.kv_token_s * us:.3f} us a context "
        f"token, {st.token_s * ms:.4f} ms a token computed); {_crossover(crossover, context, st)}",
        "Sequences a replica holds:",
        f"  paged:        {mem.num_blocks} blocks / {conc.blocks_per_seq} a sequence (mean context "
        f"{context:g} = {load.mean_prompt:g} prompt + {load.mean_output:g}/2 output, whole blocks) = "
        f"{conc.paged_seqs}",
        # The rule of thumb a reader may check this against (docs/capacity.md says why it is not used).
        f"  from zero:    were a sequence's KV to grow from nothing (mean context {from_zero:g} = "
        f"({load.mean_prompt:g} + {load.mean_output:g})/2), {mem.num_blocks * mem.block_size} tokens / "
        f"{from_zero:g} = {from_zero_seqs} sequences (~{from_zero_replicas} replicas); but a prompt's "
        f"{load.mean_prompt:g} tokens are held from its first step",
        f"  contiguous:   {mem.kv_budget / GB:.2f} GB / ({model.max_context} max context x {kv_mb:.4f} MB) = "
        f"{conc.contiguous_seqs} (reserving only the longest request's {load.longest} tokens: "
        f"{conc.contiguous_own_seqs})",
        f"  TPOT cap:     ({slo.tpot_ms:g} - {st.weights_s * ms:.2f}) ms / (({context:g} + {ride:g} prompt "
        f"tokens riding along) x {st.kv_token_s * us:.3f} us) = {memory_cap:.1f}; compute allows "
        f"{compute_cap:.0f}: cap {conc.tpot_batch_cap}",
        f"  batch:        {conc.batch}, held by {conc.limited_by}",
        f"A replica:      a step of {plan.step_s * ms:.2f} ms at {conc.batch} sequences, so {conc.batch} / "
        f"{plan.step_s:.5f} s / {load.mean_output:g} tokens = {plan.replica_req_s:.2f} req/s; "
        f"prefill chunks of {plan.token_budget} tokens hold TPOT",
        f"Replicas:       {load.rate_per_s:g} / ({plan.replica_req_s:.2f} x {slo.utilisation:.0%}) = "
        f"{load.rate_per_s / usable:.1f} -> {plan.replicas}",
        f"Cost:           {plan.replicas} x ${acc.usd_per_hour:g}/h x {HOURS_PER_MONTH} h = "
        f"${plan.monthly_usd:,.0f} a month",
    ]


def simulation_lines(plan: CapacityPlan, sim: SimulatedPlan, settings: SimulationSettings) -> list[str]:
    held = sim.mean_replicas / plan.replicas - 1
    return [
        f"Simulated:      {sim.sample_replicas} of the {plan.replicas} replicas with their share "
        f"({sim.slice_rate_per_s:.1f} req/s) for {settings.duration_s:g} s, the real scheduler and "
        f"autoscaler ({sim.wall_s:.1f} s of real time)",
        f"  {sim.num_finished} of {sim.num_requests} requests finished; p99 TTFT {sim.p99_ttft_ms:.0f} ms, "
        f"p99 TPOT {sim.p99_tpot_ms:.1f} ms; mean step {sim.mean_step_ms:.1f} ms, KV use "
        f"{sim.mean_kv_usage:.0%}; replicas held {sim.mean_replicas:.0f} ({held:+.0%})",
        f"  {sim.explanation}",
    ]
