"""The fleet simulator: the real scheduler, router choice and autoscaler policy on a virtual clock."""

from __future__ import annotations

import dataclasses

import pytest
from django.core.management import call_command

from rollouts.fleet.autoscaler import ScalingPolicy
from rollouts.fleet.simulator import (
    FleetConfig,
    FleetReport,
    TickRow,
    parse_rate_profile,
    poisson_arrivals,
    simulate_fleet,
)
from serving.benchmarks.workload import percentile
from serving.engine.scheduler import SchedulerConfig
from serving.engine.simulated import LatencyModel

# A load that a single replica cannot carry for a minute, then a quiet tail.
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


def static(n: int) -> FleetConfig:
    policy = dataclasses.replace(CONFIG.policy, min_replicas=n, max_replicas=n)
    return dataclasses.replace(CONFIG, policy=policy, initial_replicas=n)


def test_the_fleet_grows_under_load_serves_only_once_loaded_and_shrinks_a_window_after_it() -> None:
    report = simulate_fleet(REQUESTS, CONFIG, seed=3)
    assert len(report.ttft_s) == report.num_requests == len(REQUESTS)  # every request finished
    up = next(i for i, row in enumerate(report.rows) if row.target > 1)
    assert (report.rows[up].target, report.rows[up].ready, report.rows[up].starting) == (4, 1, 3)
    # ready 10 s after the decision (two 5-s ticks later), not before
    assert (report.rows[up + 1].ready, report.rows[up + 2].ready) == (1, 4)
    assert 30 <= report.rows[up].at_s <= 45  # a tick or two after the load rose at 30 s
    down = next(row for row in report.rows[up:] if row.target == 1)
    assert down.at_s >= 90 + CONFIG.policy.scale_down_window_s - CONFIG.tick_s  # held for the window
    again = simulate_fleet(REQUESTS, CONFIG, seed=3)
    assert (again.ttft_s, again.replica_seconds) == (report.ttft_s, report.replica_seconds)  # deterministic


def test_scaling_costs_less_than_the_largest_fleet_and_waits_less_than_the_smallest() -> None:
    scaled = simulate_fleet(REQUESTS, CONFIG, seed=3)
    smallest, largest = (
        simulate_fleet(REQUESTS, static(1), seed=3),
        simulate_fleet(REQUESTS, static(4), seed=3),
    )
    assert scaled.replica_seconds < 0.9 * largest.replica_seconds
    assert percentile(scaled.ttft_s, 99) < 0.5 * percentile(smallest.ttft_s, 99)
    assert smallest.sla_attainment < scaled.sla_attainment <= largest.sla_attainment == 1.0


def test_step_time_holds_the_fleet_a_steady_load_needs_where_queue_depth_lets_it_fall() -> None:
    # Three minutes at 12 req/s with long prompts: two replicas carry it with steps well under 50 ms,
    # one cannot, and neither ever holds a full batch. With a 30-s scale-down window, queue depth and
    # batch saturation see nothing once the first burst's queue drains, and let the fleet fall to one
    # replica under the load; its steps then grow, a queue forms, and it scales up again.
    requests = poisson_arrivals(
        parse_rate_profile("0:1,20:12,200:1"), 230, prompt_tokens=(64, 512), output_tokens=(64, 256), seed=5
    )
    policy = ScalingPolicy(min_replicas=1, max_replicas=4, scale_down_window_s=30)
    config = dataclasses.replace(
        CONFIG, policy=policy, scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512)
    )
    timed = dataclasses.replace(config, policy=dataclasses.replace(policy, target_tpot_ms=50))
    queue_only, step_timed = simulate_fleet(requests, config, seed=5), simulate_fleet(requests, timed, seed=5)

    def settled(report: FleetReport) -> list[TickRow]:  # once the first burst's queue has drained
        return [row for row in report.rows if 60 <= row.at_s < 200]

    assert min(row.target for row in settled(queue_only)) == 1
    assert max(row.queued for row in settled(queue_only)) > 20
    assert min(row.target for row in settled(step_timed)) == 2
    assert max(row.queued for row in settled(step_timed)) <= 5
    assert max(row.step_ms for row in settled(step_timed)) < 50
    assert step_timed.sla_attainment > queue_only.sla_attainment + 0.05
    assert step_timed.replica_seconds < queue_only.replica_seconds  # and the oscillation cost more


def test_long_steps_now_and_then_are_not_load() -> None:
    # A long prompt for a one-token answer every few seconds (a classifier, a reranker): each step is a
    # ~250-ms prefill, five times the target, and the replica is idle ~95% of the time.
    requests = poisson_arrivals(
        parse_rate_profile("0:0.2"), 300, prompt_tokens=(1024, 1900), output_tokens=(1, 2), seed=7
    )
    policy = ScalingPolicy(min_replicas=1, max_replicas=4, scale_down_window_s=30, target_tpot_ms=50)
    config = dataclasses.replace(
        CONFIG, policy=policy, scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048)
    )
    report = simulate_fleet(requests, config, seed=7)
    assert max(row.step_ms for row in report.rows) > 200
    assert {row.target for row in report.rows} == {1}


def test_a_rate_profile_is_checked() -> None:
    assert parse_rate_profile("0:2,120:16") == [(0.0, 2.0), (120.0, 16.0)]
    for bad in ("10:2", "0:2,0:3", "0:-1", "0:x"):
        with pytest.raises(ValueError, match=r"rate profile|could not convert"):
            parse_rate_profile(bad)


@pytest.mark.django_db
def test_the_command_prints_the_fleet_over_time_and_the_ratios_against_a_static_fleet(capsys) -> None:
    call_command(
        "simulate",
        "fleet",
        *("--rate", "0:1,30:24,90:1", "--duration", "120", "--prompt-tokens", "32-128"),
        *("--output-tokens", "64-128", "--max-replicas", "4", "--load-time", "10", "--tick", "5"),
        *("--max-num-seqs", "32", "--num-blocks", "2048", "--compare-static", "4", "--seed", "3"),
    )
    out = capsys.readouterr().out
    assert "t  req/s  target  ready  starting  draining  queued  KV use" in out
    assert "static 4: " in out and "of 1" in out
    assert "autoscaled / static 4: replica-seconds 0." in out
