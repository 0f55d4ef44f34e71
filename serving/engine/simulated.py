"""The real Scheduler and KVCacheManager driven by a stand-in executor: no forward pass, a step time
from a latency model on a virtual clock, and tokens from a seeded RNG. Deterministic under a seed, so
it shows what the policy does (TTFT, TPOT, throughput, preemptions) in milliseconds of real time, and
measures the scheduler's own Python cost per step.

    python -m serving.engine.simulated     # prints the scheduler overhead at 256 running sequences
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from serving.engine.kv_cache import KVCacheManager
from serving.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from serving.engine.sequence import FinishReason, SamplingParams, Sequence


@dataclass(slots=True, frozen=True)
class LatencyModel:
    """Step time = fixed + per prefill token + per decoding sequence + per context token (every
    position a scheduled sequence attends over, i.e. KV read)."""

    fixed_ms: float = 2.0
    per_prefill_token_ms: float = 0.02
    per_decode_seq_ms: float = 0.1
    per_context_token_ms: float = 0.0002

    def base_step_ms(self, context_tokens: int = 0) -> float:
        """A step with one sequence decoding, as a replica measures at warm-up."""
        return self.fixed_ms + self.per_decode_seq_ms + self.per_context_token_ms * context_tokens

    def step_ms(self, output: SchedulerOutput) -> float:
        """Call between schedule() and update(), while num_computed_tokens is still the step's start."""
        num_prefill_tokens = 0
        num_decode_seqs = 0
        num_context_tokens = 0
        for item in output.scheduled:
            seq = item.seq
            end = seq.num_computed_tokens + item.num_new_tokens
            num_context_tokens += end
            # A decode: one new token past the prompt. Recomputing outputs after preemption is prefill.
            if item.num_new_tokens == 1 and end == len(seq.token_ids) and end > seq.num_prompt_tokens:
                num_decode_seqs += 1
            else:
                num_prefill_tokens += item.num_new_tokens
        return (
            self.fixed_ms
            + self.per_prefill_token_ms * num_prefill_tokens
            + self.per_decode_seq_ms * num_decode_seqs
            + self.per_context_token_ms * num_context_tokens
        )


class SimulatedExecutor:
    """Stands in for the runner: samples a seeded token for every sequence that completes its range,
    and says how long the step would have taken. Never samples EOS unless eos_probability > 0."""

    def __init__(
        self,
        latency_model: LatencyModel,
        *,
        vocab_size: int = 32_000,
        seed: int = 0,
        eos_token_id: int | None = None,
        eos_probability: float = 0.0,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if eos_probability > 0 and eos_token_id is None:
            raise ValueError("eos_probability > 0 needs an eos_token_id")
        self.latency_model = latency_model
        self._vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._eos_token_id = eos_token_id
        self._eos_probability = eos_probability

    def execute(self, output: SchedulerOutput) -> tuple[dict[str, int], float]:
        """(sampled token per request id, step time in ms)."""
        sampled: dict[str, int] = {}
        for item in output.scheduled:
            seq = item.seq
            if seq.num_computed_tokens + item.num_new_tokens == len(seq.token_ids):
                sampled[seq.request_id] = self._sample()
        return sampled, self.latency_model.step_ms(output)

    def _sample(self) -> int:
        eos = self._eos_token_id
        if eos is not None and self._eos_probability and self._rng.random() < self._eos_probability:
            return eos
        token_id = self._rng.randrange(self._vocab_size - (eos is not None))
        return token_id + 1 if eos is not None and token_id >= eos else token_id  # skip EOS


@dataclass(slots=True, frozen=True)
class SimulatedRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    tenant_id: str = "default"


def make_workload(
    *,
    num_requests: int,
    seed: int = 0,
    min_prompt_tokens: int = 16,
    max_prompt_tokens: int = 256,
    min_output_tokens: int = 32,
    max_output_tokens: int = 256,
    arrival_rate_per_s: float | None = None,
    vocab_size: int = 32_000,
    tenant_ids: SequenceOf[str] = ("default",),
) -> list[SimulatedRequest]:
    """Seeded requests with uniform prompt and output lengths, arriving all at once (rate None) or as
    a Poisson process at `arrival_rate_per_s`; tenants are drawn uniformly."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not 1 <= min_prompt_tokens <= max_prompt_tokens or not 1 <= min_output_tokens <= max_output_tokens:
        raise ValueError("token length ranges must satisfy 1 <= min <= max")
    if arrival_rate_per_s is not None and arrival_rate_per_s <= 0:
        raise ValueError(f"arrival_rate_per_s must be > 0 or None, got {arrival_rate_per_s}")
    if not tenant_ids:
        raise ValueError("tenant_ids must not be empty")
    rng = random.Random(seed)
    requests = []
    arrival_s = 0.0
    for index in range(num_requests):
        if arrival_rate_per_s is not None and index:
            arrival_s += rng.expovariate(arrival_rate_per_s)
        num_prompt_tokens = rng.randint(min_prompt_tokens, max_prompt_tokens)
        prompt = tuple(rng.randrange(vocab_size) for _ in range(num_prompt_tokens))
        max_tokens = rng.randint(min_output_tokens, max_output_tokens)
        tenant_id = tenant_ids[rng.randrange(len(tenant_ids))]
        requests.append(SimulatedRequest(f"req-{index}", arrival_s, prompt, max_tokens, tenant_id))
    return requests


@dataclass(slots=True, frozen=True)
class RequestMetrics:
    request_id: str
    tenant_id: str
    arrival_s: float
    ttft_s: float  # arrival to first token, virtual time
    tpot_s: float | None  # mean time per output token after the first; None with one output token
    num_output_tokens: int
    finish_reason: FinishReason
    num_preemptions: int


@dataclass(slots=True, frozen=True)
class SimulationReport:
    requests: tuple[RequestMetrics, ...]
    num_steps: int
    makespan_s: float  # virtual: first arrival to last finish
    num_output_tokens: int
    output_tokens_per_s: float  # virtual
    p50_ttft_s: float
    p99_ttft_s: float
    p50_tpot_s: float
    p99_tpot_s: float
    num_preemptions: int
    mean_num_scheduled_seqs: float
    # Real wall-clock time per step in schedule() + update(), the executor excluded. Not deterministic.
    median_scheduler_ms_per_step: float
    p99_scheduler_ms_per_step: float


def simulate(
    requests: SequenceOf[SimulatedRequest],
    *,
    scheduler_config: SchedulerConfig,
    num_blocks: int,
    latency_model: LatencyModel | None = None,
    seed: int = 0,
    is_prefix_caching_enabled: bool = True,
    max_num_steps: int = 1_000_000,
) -> SimulationReport:
    """Run `requests` to completion (every one with ignore_eos, so it yields exactly max_tokens unless
    the context limit cuts it) and report latency and throughput on the virtual clock."""
    clock_s = 0.0
    kv = KVCacheManager(
        num_blocks,
        scheduler_config.block_size,
        is_prefix_caching_enabled=is_prefix_caching_enabled,
        salt_secret=b"simulated",
    )
    scheduler = Scheduler(scheduler_config, kv, clock=lambda: clock_s)
    executor = SimulatedExecutor(latency_model or LatencyModel(), seed=seed)
    pending = sorted(requests, key=lambda r: r.arrival_s)
    num_added = 0
    finished: list[Sequence] = []
    scheduler_s: list[float] = []
    num_scheduled_seqs = 0
    while num_added < len(pending) or scheduler.has_unfinished():
        if scheduler.num_steps >= max_num_steps:
            raise RuntimeError(f"not done after {max_num_steps} steps")
        if not scheduler.has_unfinished():
            clock_s = max(clock_s, pending[num_added].arrival_s)  # idle until the next arrival
        while num_added < len(pending) and pending[num_added].arrival_s <= clock_s:
            request = pending[num_added]
            params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
            seq = Sequence(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.tenant_id,
                request.arrival_s,
            )
            scheduler.add(seq)
            num_added += 1
        started = time.perf_counter()
        output = scheduler.schedule()
        scheduled_s = time.perf_counter() - started
        if not output.scheduled:
            if num_added == len(pending):
                raise RuntimeError("the scheduler made no progress with nothing left to arrive")
            clock_s = max(clock_s, pending[num_added].arrival_s)
            continue
        sampled, step_ms = executor.execute(output)
        clock_s += step_ms / 1000
        started = time.perf_counter()
        finished.extend(scheduler.update(output, sampled))
        scheduler_s.append(scheduled_s + time.perf_counter() - started)
        num_scheduled_seqs += len(output.scheduled)
    return _report(finished, scheduler, scheduler_s, num_scheduled_seqs)


def _report(
    finished: list[Sequence], scheduler: Scheduler, scheduler_s: list[float], num_scheduled_seqs: int
) -> SimulationReport:
    metrics = []
    for seq in sorted(finished, key=lambda s: s.arrival_time):
        assert seq.first_token_time is not None
        assert seq.finished_time is not None
        assert seq.finish_reason is not None
        num_outputs = seq.num_output_tokens
        tpot_s = (seq.finished_time - seq.first_token_time) / (num_outputs - 1) if num_outputs > 1 else None
        metrics.append(
            RequestMetrics(
                seq.request_id,
                seq.tenant_id,
                seq.arrival_time,
                seq.first_token_time - seq.arrival_time,
                tpot_s,
                num_outputs,
                seq.finish_reason,
                seq.num_preemptions,
            )
        )
    num_output_tokens = sum(m.num_output_tokens for m in metrics)
    makespan_s = (
        max((s.finished_time or 0.0) for s in finished) - min(m.arrival_s for m in metrics)
        if metrics
        else 0.0
    )
    ttfts = [m.ttft_s for m in metrics]
    tpots = [m.tpot_s for m in metrics if m.tpot_s is not None]
    steps_ms = [s * 1000 for s in scheduler_s]
    return SimulationReport(
        requests=tuple(metrics),
        num_steps=scheduler.num_steps,
        makespan_s=makespan_s,
        num_output_tokens=num_output_tokens,
        output_tokens_per_s=num_output_tokens / makespan_s if makespan_s > 0 else 0.0,
        p50_ttft_s=_percentile(ttfts, 50),
        p99_ttft_s=_percentile(ttfts, 99),
        p50_tpot_s=_percentile(tpots, 50),
        p99_tpot_s=_percentile(tpots, 99),
        num_preemptions=scheduler.num_preemptions,
        mean_num_scheduled_seqs=num_scheduled_seqs / len(scheduler_s) if scheduler_s else 0.0,
        median_scheduler_ms_per_step=_percentile(steps_ms, 50),
        p99_scheduler_ms_per_step=_percentile(steps_ms, 99),
    )


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def measure_scheduler_overhead(
    num_seqs: int = 256, num_steps: int = 200, seed: int = 0, block_size: int = 16
) -> float:
    """Median real milliseconds per step spent in schedule() + update() with `num_seqs` sequences all
    decoding (the steady state the 1 ms target is about); the simulated forward pass is excluded."""
    if num_seqs < 1 or num_steps < 1:
        raise ValueError("num_seqs and num_steps must be >= 1")
    rng = random.Random(seed)
    max_prompt_tokens = 128
    max_model_len = max_prompt_tokens + num_steps + 2 * num_seqs + 64  # nobody hits it while measured
    config = SchedulerConfig(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(2048, num_seqs),
        max_model_len=max_model_len,
        block_size=block_size,
    )
    num_blocks = num_seqs * -(-max_model_len // block_size) + 1
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, salt_secret=b"overhead"))
    executor = SimulatedExecutor(LatencyModel(), seed=seed)
    params = SamplingParams(max_tokens=max_model_len - max_prompt_tokens, ignore_eos=True)
    for index in range(num_seqs):
        prompt = [rng.randrange(32_000) for _ in range(rng.randint(64, max_prompt_tokens))]
        scheduler.add(Sequence(f"req-{index}", prompt, params))
    # Warm up until every sequence is past its prompt and decoding.
    for _ in range(10 * num_seqs):
        output = scheduler.schedule()
        scheduler.update(output, executor.execute(output)[0])
        if len(output.scheduled) == num_seqs and output.num_batched_tokens == num_seqs:
            break
    else:
        raise RuntimeError("sequences did not reach steady decoding")
    step_ms = []
    for _ in range(num_steps):
        started = time.perf_counter()
        output = scheduler.schedule()
        scheduled_s = time.perf_counter() - started
        sampled = executor.execute(output)[0]
        started = time.perf_counter()
        scheduler.update(output, sampled)
        step_ms.append((scheduled_s + time.perf_counter() - started) * 1000)
        assert len(output.scheduled) == num_seqs, "every sequence decodes in every measured step"
    return statistics.median(step_ms)


if __name__ == "__main__":
    runs = [measure_scheduler_overhead(num_seqs=256, num_steps=500, seed=seed) for seed in range(5)]
    print(f"scheduler overhead at 256 running sequences: median {statistics.median(runs):.3f} ms/step")
    print("  per run: " + ", ".join(f"{ms:.3f}" for ms in runs))
