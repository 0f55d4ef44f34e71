"""The simulated executor: latency arithmetic, determinism under a seed, and workloads that finish."""

from __future__ import annotations

import dataclasses

import pytest

from serving.engine.scheduler import ScheduledSequence, SchedulerConfig, SchedulerOutput
from serving.engine.sequence import FinishReason, SamplingParams, Sequence
from serving.engine.simulated import (
    LatencyModel,
    SimulatedExecutor,
    SimulatedRequest,
    SimulationReport,
    make_workload,
    measure_scheduler_overhead,
    simulate,
)

CONFIG = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024, block_size=16)


def virtual_fields(report: SimulationReport) -> dict[str, object]:
    """Everything but the wall-clock scheduler timings, which differ run to run."""
    fields = dataclasses.asdict(report)
    del fields["median_scheduler_ms_per_step"], fields["p99_scheduler_ms_per_step"]
    return fields


def test_step_time_adds_fixed_prefill_decode_and_context_terms() -> None:
    decoding = Sequence("d", [1, 2, 3, 4])
    decoding.append_token(5)
    decoding.num_computed_tokens = 4
    prefilling = Sequence("p", list(range(10)))
    prefilling.num_computed_tokens = 2
    output = SchedulerOutput([ScheduledSequence(decoding, 1), ScheduledSequence(prefilling, 6)], [], 7)
    model = LatencyModel(
        fixed_ms=1.0, per_prefill_token_ms=0.5, per_decode_seq_ms=2.0, per_context_token_ms=0.01
    )
    # 1 fixed + 6 prefill tokens * 0.5 + 1 decode * 2 + (5 + 8) context tokens * 0.01
    assert model.step_ms(output) == pytest.approx(1.0 + 3.0 + 2.0 + 0.13)


def test_a_single_request_has_hand_computed_ttft_and_tpot() -> None:
    model = LatencyModel(
        fixed_ms=10.0, per_prefill_token_ms=1.0, per_decode_seq_ms=2.0, per_context_token_ms=0.0
    )
    request = SimulatedRequest("r", arrival_s=0.5, prompt_token_ids=(1, 2, 3, 4), max_tokens=3)
    report = simulate([request], scheduler_config=CONFIG, num_blocks=8, latency_model=model)
    (metrics,) = report.requests
    # Prefill of 4 tokens: 10 + 4 = 14 ms, then two decode steps of 10 + 2 = 12 ms each.
    assert metrics.ttft_s == pytest.approx(0.014)
    assert metrics.tpot_s == pytest.approx(0.012)
    assert metrics.num_output_tokens == 3
    assert metrics.finish_reason is FinishReason.LENGTH
    assert report.num_steps == 3
    assert report.makespan_s == pytest.approx(0.038)
    assert report.output_tokens_per_s == pytest.approx(3 / 0.038)


def test_same_seed_same_report_and_every_request_completes() -> None:
    requests = make_workload(
        num_requests=40,
        seed=7,
        min_prompt_tokens=8,
        max_prompt_tokens=96,
        min_output_tokens=4,
        max_output_tokens=48,
        arrival_rate_per_s=50.0,
        tenant_ids=("a", "b"),
    )
    # A small pool, so the run preempts and recomputes along the way.
    first = simulate(requests, scheduler_config=CONFIG, num_blocks=24, seed=3)
    second = simulate(requests, scheduler_config=CONFIG, num_blocks=24, seed=3)
    assert virtual_fields(first) == virtual_fields(second)
    assert first.num_preemptions > 0
    assert len(first.requests) == 40
    by_id = {m.request_id: m for m in first.requests}
    assert all(by_id[r.request_id].num_output_tokens == r.max_tokens for r in requests)
    assert first.num_output_tokens == sum(r.max_tokens for r in requests)
    assert 0 < first.p50_ttft_s <= first.p99_ttft_s
    assert 0 < first.p50_tpot_s <= first.p99_tpot_s


def test_all_at_once_beats_one_at_a_time_throughput() -> None:
    requests = make_workload(num_requests=32, seed=1, max_prompt_tokens=64, max_output_tokens=64)
    batched = simulate(requests, scheduler_config=CONFIG, num_blocks=512)
    serial = simulate(requests, scheduler_config=dataclasses.replace(CONFIG, max_num_seqs=1), num_blocks=512)
    assert batched.output_tokens_per_s > 4 * serial.output_tokens_per_s
    assert batched.mean_num_scheduled_seqs > 8


def test_workloads_are_seeded_and_poisson_arrivals_increase() -> None:
    assert make_workload(num_requests=10, seed=5) == make_workload(num_requests=10, seed=5)
    assert make_workload(num_requests=10, seed=5) != make_workload(num_requests=10, seed=6)
    at_once = make_workload(num_requests=10, seed=5)
    assert {r.arrival_s for r in at_once} == {0.0}
    poisson = make_workload(num_requests=200, seed=5, arrival_rate_per_s=20.0)
    arrivals = [r.arrival_s for r in poisson]
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] / 199 == pytest.approx(1 / 20, rel=0.25)  # mean gap is 1 / rate
    with pytest.raises(ValueError, match="arrival_rate_per_s"):
        make_workload(num_requests=1, arrival_rate_per_s=0.0)


def test_executor_never_samples_eos_unless_asked() -> None:
    seq = Sequence("r", [1], SamplingParams())
    output = SchedulerOutput([ScheduledSequence(seq, 1)], [], 1)
    quiet = SimulatedExecutor(LatencyModel(), vocab_size=3, eos_token_id=1, seed=0)
    assert all(quiet.execute(output)[0]["r"] in (0, 2) for _ in range(200))
    chatty = SimulatedExecutor(LatencyModel(), vocab_size=3, eos_token_id=1, eos_probability=1.0, seed=0)
    assert chatty.execute(output)[0] == {"r": 1}


def test_measure_scheduler_overhead_returns_milliseconds_per_step() -> None:
    overhead_ms = measure_scheduler_overhead(num_seqs=256, num_steps=30)
    # The target is < 1 ms; the test allows slow CI machines a wide margin.
    assert 0 < overhead_ms < 5
