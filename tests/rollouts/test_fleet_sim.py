"""The fleet simulator: the real scheduler, router choice and autoscaler policy on a virtual clock."""

from __future__ import annotations

import dataclasses

import pytest
from django.core.management import call_command

from rollouts.autoscaler import ScalingPolicy
from rollouts.fleet_sim import FleetConfig, parse_rate_profile, poisson_arrivals, simulate_fleet
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
