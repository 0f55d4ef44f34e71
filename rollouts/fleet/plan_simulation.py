"""A capacity plan run through the fleet simulator: the real scheduler, KV cache, router choice and
autoscaler, with the plan's roofline as each replica's step time and its KV blocks and batch as each
replica's limits.

A fleet of hundreds of replicas at 1,000 requests a second is simulated as a slice of it: `sample`
replicas with their share of the load (rate x sample / replicas), the autoscaler's bounds scaled with
it. Each replica sees what it would in the whole fleet (a Poisson stream split among replicas by the
router's choice of two is still Poisson at the replica's share), and the autoscaler's signals are
means over replicas, so the slice's replica count times replicas / sample is the fleet's. What the slice
cannot show is how two choices among a few replicas balance compared with among hundreds (a little
worse: the slice errs pessimistic), and replica counts only in steps of replicas / sample."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from rollouts.fleet.autoscaler import ScalingPolicy
from rollouts.fleet.capacity_plan import CapacityPlan
from rollouts.fleet.simulator import FleetReport, simulate_fleet, sized_fleet, steady_arrivals
from rollouts.fleet.step_time_model import RooflineLatency

TOLERANCE = 0.15  # within this, the simulation agrees with the closed form


@dataclass(frozen=True, slots=True)
class SimulationSettings:
    duration_s: float = 600.0
    sample_replicas: int = 8
    load_time_s: float = 30.0
    tick_s: float = 5.0
    warmup_s: float = 60.0  # ticks before this are left out of the means (the fleet starts empty)
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"the simulated duration must be > 0 s, got {self.duration_s!r}")
        if self.sample_replicas < 1:
            raise ValueError(f"the sample needs at least 1 replica, got {self.sample_replicas}")
        if self.load_time_s < 0 or self.tick_s <= 0 or self.warmup_s < 0:
            raise ValueError("load time and warm-up must be >= 0 s and the tick > 0 s")


@dataclass(frozen=True, slots=True)
class SimulatedPlan:
    sample_replicas: int  # replicas at the start of the slice
    scale: float  # fleet replicas per simulated replica
    slice_rate_per_s: float
    num_requests: int
    num_finished: int
    p99_ttft_ms: float
    p99_tpot_ms: float
    mean_step_ms: float  # over ready replicas and ticks after the warm-up
    mean_kv_usage: float
    mean_replicas: float  # held (ready, starting or draining), scaled to the whole fleet
    peak_replicas: float  # the autoscaler's highest target, scaled likewise
    low_replicas: float  # and its lowest
    wall_s: float  # real seconds the simulation took
    explanation: str  # how it compares with the closed form, and why


def simulate_plan(plan: CapacityPlan, settings: SimulationSettings | None = None) -> SimulatedPlan:
    settings = settings or SimulationSettings()
    sample = min(settings.sample_replicas, plan.replicas)
    scale = plan.replicas / sample
    rate = plan.workload.rate_per_s / scale
    target = plan.objectives.utilisation
    policy = ScalingPolicy(
        min_replicas=1,
        max_replicas=max(2 * sample, sample + 4),
        target_saturation=target,
        target_kv_usage=target,
        scale_down_window_s=120.0,
        target_tpot_ms=plan.objectives.tpot_ms,
    )
    config = sized_fleet(
        policy,
        max_num_seqs=plan.concurrency.batch,
        max_num_batched_tokens=max(plan.token_budget, plan.concurrency.batch),
        max_model_len=plan.model.max_context,
        num_blocks=plan.memory.num_blocks,
        block_size=plan.memory.block_size,
        latency=RooflineLatency(plan.step_time),
        load_time_s=settings.load_time_s,
        tick_s=settings.tick_s,
        initial_replicas=sample,
        ttft_sla_s=plan.objectives.p99_ttft_ms / 1000,
    )
    requests = steady_arrivals(
        rate,
        settings.duration_s,
        prompt_tokens=plan.workload.prompt_tokens,
        output_tokens=plan.workload.output_tokens,
        seed=settings.seed,
    )
    started = time.perf_counter()
    report = simulate_fleet(requests, config, seed=settings.seed)
    wall_s = time.perf_counter() - started
    return _summarise(plan, settings, report, sample, scale, rate, wall_s)


def _summarise(
    plan: CapacityPlan,
    settings: SimulationSettings,
    report: FleetReport,
    sample: int,
    scale: float,
    rate: float,
    wall_s: float,
) -> SimulatedPlan:
    rows = [r for r in report.rows if r.at_s >= settings.warmup_s and r.at_s <= settings.duration_s]
    rows = rows or report.rows
    steps = [r.step_ms for r in rows if r.step_ms > 0]
    mean_replicas = scale * sum(r.ready + r.starting + r.draining for r in rows) / len(rows) if rows else 0.0
    mean_kv = sum(r.kv_cache_usage for r in rows) / len(rows) if rows else 0.0
    partial = SimulatedPlan(
        sample_replicas=sample,
        scale=scale,
        slice_rate_per_s=rate,
        num_requests=report.num_requests,
        num_finished=len(report.ttft_s),
        p99_ttft_ms=1000 * _p99(report.ttft_s),
        p99_tpot_ms=1000 * _p99(report.tpot_s),
        mean_step_ms=sum(steps) / len(steps) if steps else 0.0,
        mean_kv_usage=mean_kv,
        mean_replicas=mean_replicas,
        peak_replicas=scale * max((r.target for r in rows), default=sample),
        low_replicas=scale * min((r.target for r in rows), default=sample),
        wall_s=wall_s,
        explanation="",
    )
    return _with_explanation(plan, partial)


def _with_explanation(plan: CapacityPlan, sim: SimulatedPlan) -> SimulatedPlan:
    """One sentence from the figures: how the simulation parts from the closed form, and why."""
    planned_step_ms = 1000 * plan.step_s
    replicas_off = sim.mean_replicas / plan.replicas - 1
    step_off = sim.mean_step_ms / planned_step_ms - 1 if sim.mean_step_ms else 0.0
    batch = plan.concurrency.batch
    # What the replicas ran, from their KV use: blocks in use over a sequence's mean blocks.
    running = sim.mean_kv_usage * plan.memory.num_blocks / plan.concurrency.blocks_per_seq
    util = plan.objectives.utilisation
    held = f"the autoscaler held {sim.mean_replicas:.0f} replicas against the closed form's {plan.replicas} "
    if replicas_off >= 0:
        held += (
            f"({replicas_off:+.0%}) because it keeps the highest recommendation of its window, which peaked "
            f"at {sim.peak_replicas:.0f} ({sim.peak_replicas / sim.scale:.0f} simulated replicas, each "
            f"standing for {sim.scale:.1f}), where the closed form sizes for the mean load at {util:.0%}"
        )
    else:
        held += (
            f"({replicas_off:+.0%}) because it sizes on KV use and batch saturation rather than throughput: "
            f"its target ranged {sim.low_replicas:.0f}-{sim.peak_replicas:.0f} (in steps of {sim.scale:.1f}) "
            f"with KV use at {sim.mean_kv_usage:.0%} against its {util:.0%} target"
        )
    clauses = [
        held,
        f"steps took {sim.mean_step_ms:.1f} ms against {planned_step_ms:.1f} ms ({step_off:+.0%}) because a "
        f"replica ran about {running:.0f} sequences (KV use {sim.mean_kv_usage:.0%}), not the full batch of "
        f"{batch} the closed form times",
    ]
    tpot_ms, ttft_ms = plan.objectives.tpot_ms, plan.objectives.p99_ttft_ms
    if sim.p99_tpot_ms > tpot_ms:
        clauses.append(
            f"p99 TPOT is {sim.p99_tpot_ms:.1f} ms, over the {tpot_ms:g} ms objective the closed form holds "
            f"for the mean step, because steps that carry prompt chunks (up to "
            f"{1000 * plan.step_time.step_s(plan.token_budget, 0):.1f} ms) fall on some sequences more"
        )
    if sim.p99_ttft_ms > ttft_ms:
        clauses.append(
            f"p99 TTFT is {sim.p99_ttft_ms:.0f} ms, over the {ttft_ms:g} ms objective, because requests "
            f"queue for a batch slot or KV blocks, which the closed form does not count"
        )
    agrees = abs(replicas_off) <= TOLERANCE and abs(step_off) <= TOLERANCE and len(clauses) == 2
    head = f"Within {TOLERANCE:.0%} of the closed form" if agrees else "Not within the closed form"
    return replace(sim, explanation=f"{head}: " + "; ".join(clauses) + ".")


def _p99(values: list[float]) -> float:
    """numpy's default (linear between closest ranks), as the benches compute it; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * 0.99
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
