"""SLO-aware admission at overload, simulated: a static fleet offered `overload` times its capacity, the
same arrivals (the same seed) routed with and without the gateway's admission. What it shows: the share of
admitted requests whose first token came within the objective, the goodput within it, and how well each
refusal's Retry-After foretold the wait it avoided (docs/benchmarks.md, "SLO-aware admission in the
simulator", defines each).

Capacity is measured, not taken from a formula: the highest Poisson rate at which the same static fleet,
without admission, keeps p99 TTFT within the objective over the same duration, found by doubling and then
halving the interval (to within `CAPACITY_PRECISION`); or given outright."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from rollouts.fleet.simulator import FleetConfig, FleetReport, simulate_fleet, steady_arrivals
from rollouts.fleet.slo_gateway import Refusal, SloAdmission

CAPACITY_PRECISION = 0.02  # the bisection stops when its interval is within 2% of its low end
WITHIN = 0.5  # a Retry-After is accurate within ±50% of the wait it avoided


@dataclass(frozen=True, slots=True)
class SloSettings:
    replicas: int = 4
    objective_s: float = 1.0
    overload: float = 1.5
    duration_s: float = 120.0  # seconds of arrivals, for each run and each capacity probe
    capacity_rps: float | None = None  # None: measured
    prompt_tokens: tuple[int, int] = (64, 512)
    output_tokens: tuple[int, int] = (64, 256)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"need at least 1 replica, got {self.replicas}")
        for name in ("objective_s", "overload", "duration_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if self.capacity_rps is not None and not (math.isfinite(self.capacity_rps) and self.capacity_rps > 0):
            raise ValueError(f"a given capacity must be > 0 req/s, got {self.capacity_rps!r}")


@dataclass(frozen=True, slots=True)
class Capacity:
    rps: float
    measured: bool
    p99_ttft_s: float  # at that rate, without admission (NaN: given)
    probes: int  # simulations run to find it


@dataclass(frozen=True, slots=True)
class Outcome:
    arrived: int
    admitted: int
    met: int  # admitted requests whose TTFT was within the objective
    p50_ttft_s: float  # over admitted requests
    p99_ttft_s: float
    goodput_rps: float  # met / the seconds of arrivals

    @property
    def met_share(self) -> float:
        return self.met / self.admitted if self.admitted else 1.0


@dataclass(frozen=True, slots=True)
class RetryAfterAccuracy:
    refusals: int
    observed: int  # refusals whose avoided wait was observed before the run ended
    median_avoided_s: float
    median_retry_after_s: float  # the forecast wait, unrounded
    within: float  # share of the observed whose forecast wait is within ±WITHIN of the avoided wait
    median_ratio: float  # forecast wait / avoided wait
    header_within: float  # the same for the Retry-After header (whole seconds, at least 1)
    header_median_ratio: float
    ms_header_within: float  # the same for the retry-after-ms header (milliseconds, at least 1)
    ms_header_median_ratio: float


@dataclass(frozen=True, slots=True)
class SloComparison:
    settings: SloSettings
    capacity: Capacity
    rate_rps: float  # offered: overload x capacity
    without: Outcome
    with_admission: Outcome
    retry_after: RetryAfterAccuracy
    wall_s: float  # real seconds, the capacity's probes included


def static_fleet(fleet: FleetConfig, replicas: int) -> FleetConfig:
    """`fleet` held at `replicas` ready from the start: the autoscaler's bounds pinned to it."""
    policy = dataclasses.replace(fleet.policy, min_replicas=replicas, max_replicas=replicas, warm_buffer=0)
    return dataclasses.replace(fleet, policy=policy, initial_replicas=replicas)


def compare(fleet: FleetConfig, settings: SloSettings) -> SloComparison:
    """`fleet`: the replicas' scheduler, KV cache and latency model (its autoscaler is pinned)."""
    started = time.perf_counter()
    static = static_fleet(fleet, settings.replicas)
    capacity = (
        Capacity(settings.capacity_rps, measured=False, p99_ttft_s=math.nan, probes=0)
        if settings.capacity_rps is not None
        else measure_capacity(static, settings)
    )
    rate = settings.overload * capacity.rps
    requests = _arrivals(rate, settings)
    without = simulate_fleet(requests, static, seed=settings.seed)
    admission = SloAdmission(objective_s=settings.objective_s)
    admitted = simulate_fleet(requests, static, seed=settings.seed, admission=admission)
    return SloComparison(
        settings=settings,
        capacity=capacity,
        rate_rps=rate,
        without=_outcome(without, settings),
        with_admission=_outcome(admitted, settings),
        retry_after=_accuracy(admission.refusals),
        wall_s=time.perf_counter() - started,
    )


def measure_capacity(static: FleetConfig, settings: SloSettings) -> Capacity:
    """The highest rate whose p99 TTFT, without admission, is within the objective (see the docstring)."""
    probes = 0

    def p99_at(rate: float) -> float:
        nonlocal probes
        probes += 1
        return _p99(simulate_fleet(_arrivals(rate, settings), static, seed=settings.seed).ttft_s)

    low, low_p99, high = 0.0, math.nan, float(settings.replicas)  # from 1 req/s a replica, doubling
    while (p99 := p99_at(high)) <= settings.objective_s:
        low, low_p99, high = high, p99, 2 * high
    while low == 0 or high - low > CAPACITY_PRECISION * low:
        middle = (low + high) / 2
        if (p99 := p99_at(middle)) <= settings.objective_s:
            low, low_p99 = middle, p99
        else:
            high = middle
        if high < 1e-3:  # not even a thousandth of a request a second meets it
            raise ValueError(f"no rate keeps p99 TTFT within {settings.objective_s * 1000:g} ms")
    return Capacity(low, measured=True, p99_ttft_s=low_p99, probes=probes)


def _arrivals(rate: float, settings: SloSettings) -> list[Any]:
    return steady_arrivals(
        rate,
        settings.duration_s,
        prompt_tokens=settings.prompt_tokens,
        output_tokens=settings.output_tokens,
        seed=settings.seed,
    )


def _outcome(report: FleetReport, settings: SloSettings) -> Outcome:
    met = sum(t <= settings.objective_s for t in report.ttft_s)
    return Outcome(
        arrived=report.num_requests,
        admitted=len(report.ttft_s),
        met=met,
        p50_ttft_s=statistics.median(report.ttft_s) if report.ttft_s else math.nan,
        p99_ttft_s=_p99(report.ttft_s),
        goodput_rps=met / settings.duration_s,
    )


def _accuracy(refusals: list[Refusal]) -> RetryAfterAccuracy:
    observed = [r for r in refusals if r.avoided_wait_s is not None and r.avoided_wait_s > 0]
    ratios = [r.retry_after_s / r.avoided_wait_s for r in observed if r.avoided_wait_s]
    header = [r.retry_after_header_s / r.avoided_wait_s for r in observed if r.avoided_wait_s]
    ms_header = [r.retry_after_ms_header / 1000 / r.avoided_wait_s for r in observed if r.avoided_wait_s]

    def share_within(values: list[float]) -> float:
        return sum(abs(v - 1) <= WITHIN for v in values) / len(values) if values else math.nan

    def median(values: list[float]) -> float:
        return statistics.median(values) if values else math.nan

    return RetryAfterAccuracy(
        refusals=len(refusals),
        observed=len(observed),
        median_avoided_s=median([r.avoided_wait_s for r in observed if r.avoided_wait_s]),
        median_retry_after_s=median([r.retry_after_s for r in refusals]),
        within=share_within(ratios),
        median_ratio=median(ratios),
        header_within=share_within(header),
        header_median_ratio=median(header),
        ms_header_within=share_within(ms_header),
        ms_header_median_ratio=median(ms_header),
    )


def _p99(values: list[float]) -> float:
    """numpy's default (linear between closest ranks), as the benches compute it; NaN for none."""
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=100, method="inclusive")[98]
