"""SLO-aware admission in the fleet simulator: at 1.5x a static fleet's capacity, the gateway's forecast
keeps admitted requests within their TTFT objective and raises the goodput within it; refusals carry a
Retry-After; without admission the simulator is what it was (docs/benchmarks.md, "SLO-aware admission in
the simulator")."""

from __future__ import annotations

import dataclasses
import hashlib
from io import StringIO

import pytest
from django.core.management import call_command

from rollouts.fleet.autoscaler import ScalingPolicy
from rollouts.fleet.simulator import FleetConfig, parse_rate_profile, poisson_arrivals, simulate_fleet
from rollouts.fleet.slo_experiment import SloSettings, compare, static_fleet
from rollouts.fleet.slo_gateway import SloAdmission
from serving.engine.scheduler import SchedulerConfig
from serving.engine.simulated import LatencyModel

# Prefill-bound replicas: seats and KV enough that requests wait only for the prompts ahead of them.
PREFILL_BOUND = FleetConfig(
    policy=ScalingPolicy(),
    scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=512),
    num_blocks=16384,
    latency=LatencyModel(
        fixed_ms=12, per_prefill_token_ms=0.15, per_decode_seq_ms=0.25, per_context_token_ms=0.0005
    ),
)
# Seat-bound replicas (the defaults): a full batch, where requests wait for a seat to free.
SEAT_BOUND = dataclasses.replace(
    PREFILL_BOUND, scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512), num_blocks=4096
)
SETTINGS = SloSettings(replicas=2, objective_s=1.0, overload=1.5, duration_s=30.0, seed=1)


@pytest.fixture(scope="module")
def result():
    return compare(PREFILL_BOUND, SETTINGS)


def test_admission_at_overload_keeps_admitted_requests_within_the_objective(result) -> None:
    assert result.capacity.measured and result.capacity.p99_ttft_s <= SETTINGS.objective_s
    assert result.rate_rps == pytest.approx(1.5 * result.capacity.rps)
    assert result.without.admitted == result.without.arrived == result.with_admission.arrived
    assert result.without.met_share < 0.6  # overloaded: most wait past the objective
    assert result.with_admission.admitted < result.with_admission.arrived  # some were refused
    assert result.with_admission.met_share >= 0.95


def test_admission_at_overload_raises_the_goodput_within_the_objective(result) -> None:
    assert result.with_admission.goodput_rps > 1.5 * result.without.goodput_rps


def test_where_the_batch_is_full_the_forecast_counts_the_wait_for_a_seat() -> None:
    # Counting only the prompts queued ahead, 18.5% of admitted requests met the objective here.
    seats = compare(SEAT_BOUND, SETTINGS)
    assert seats.without.met_share < 0.6
    assert seats.with_admission.met_share >= 0.95
    assert seats.with_admission.goodput_rps > 2 * seats.without.goodput_rps


def test_every_refusal_carries_a_retry_after_and_the_wait_it_avoided(result) -> None:
    static = static_fleet(PREFILL_BOUND, SETTINGS.replicas)
    admission = SloAdmission(objective_s=SETTINGS.objective_s)
    requests = poisson_arrivals(parse_rate_profile(f"0:{result.rate_rps}"), 20, seed=2)
    report = simulate_fleet(requests, static, seed=2, admission=admission)
    assert admission.refusals and len(report.ttft_s) + len(admission.refusals) == len(requests)
    for refusal in admission.refusals:
        assert refusal.retry_after_s > 0 and refusal.retry_after_header_s >= 1
        assert refusal.avoided_wait_s is not None and refusal.avoided_wait_s > 0
    assert result.retry_after.refusals == result.with_admission.arrived - result.with_admission.admitted
    assert 0 < result.retry_after.median_ratio < 10


# The simulator without admission, on test_fleet_sim.py's load and fleet: this digest of every TTFT, TPOT,
# the replica-seconds and every tick's row was recorded from the simulator before admission was added.
# Re-record it only for a change meant to alter what the simulator does.
TODAY = "72109863f0c7169739379dd9efca49189e6a504155227b8277be76bb58717a23"
REQUESTS = poisson_arrivals(
    parse_rate_profile("0:1,30:24,90:1"), 200, prompt_tokens=(32, 128), output_tokens=(64, 128), seed=3
)
CONFIG = FleetConfig(
    policy=ScalingPolicy(min_replicas=1, max_replicas=4, scale_down_window_s=60),
    scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
    num_blocks=2048,
    latency=LatencyModel(fixed_ms=12, per_prefill_token_ms=0.15, per_decode_seq_ms=0.25),
    load_time_s=10.0,
)


def _digest(report) -> str:
    rows = [dataclasses.astuple(row) for row in report.rows]
    return hashlib.sha256(
        repr((report.ttft_s, report.tpot_s, report.replica_seconds, rows)).encode()
    ).hexdigest()


def test_without_admission_the_simulator_does_what_it_did() -> None:
    assert _digest(simulate_fleet(REQUESTS, CONFIG, seed=3)) == TODAY


def test_an_objective_nothing_misses_routes_as_without_admission() -> None:
    admission = SloAdmission(objective_s=1e9)
    assert _digest(simulate_fleet(REQUESTS, CONFIG, seed=3, admission=admission)) == TODAY
    assert admission.refusals == []


def test_the_command_prints_the_comparison() -> None:
    out = StringIO()
    call_command(
        "simulate",
        "slo",
        "--replicas",
        "1",
        "--duration",
        "10",
        "--capacity",
        "8",
        "--max-num-seqs",
        "256",
        "--num-blocks",
        "8192",
        stdout=out,
    )
    text = out.getvalue()
    assert "Capacity:  8.0 req/s, given (--capacity)" in text
    assert "with admission" in text and "Retry-After:" in text
