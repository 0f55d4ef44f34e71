"""How many replicas a model version needs, from leading signals: pure policy, no database, no clock.

A version's replicas send heartbeats (serving/transport/replica_directory.py) with their queue depth, the
sequences they run and their capacity, and their KV-cache use. Each signal says how many replicas would
bring it to its target, as Kubernetes' HPA computes a desired count (current x observed / target):

- queue depth: requests waiting for a slot, at most `target_queue_per_replica` each (an encoder's
  queue, inputs waiting for a batch, counts in full batches: it holds inputs back on purpose);
- batch saturation: running sequences over the replicas' capacity, at most `target_saturation`;
- KV-cache use: at most `target_kv_usage` on average;
- step time, with `target_tpot_ms` set: how long a replica's steps take, the time between tokens of
  every sequence it runs. Each replica says its steps' mean time t over the last few seconds, how many
  it ran a second, and how long a step with one sequence decoding takes (its base a: the fixed cost of
  reading the weights, which batching shares out). Of each second, steps x (t - a) went to per-token
  work (prompt tokens and decoding sequences), W in all. With n replicas sharing W back to back, a step
  takes a / (1 - W/n): it holds what arrived during the one before. So W / (1 - a/target) replicas bring
  the steps to the target, however many there are now. This sees a fleet too small when its batches are
  far from full: long prompts, or a model whose steps slow with each sequence (a CPU, or a GPU past its
  memory-bound range), push TPOT past its target with no queue in sight, where a queue-only policy
  scales such a fleet down under load. A replica whose base is over half the target says nothing: near
  the target the count turns on noise, and past it no count of replicas helps.

The recommendation is the largest of them, plus a warm buffer, within [min_replicas, max_replicas]. These
signals lead latency: a queue forms and the cache fills before p99 TTFT and TPOT move, so acting on them
adds capacity before the latency promise breaks.

Scaling up happens at once. Scaling down is held back (hysteresis): the target never falls below any
recommendation made in the last `scale_down_window_s`, so a load that dips between bursts does not cost
a replica's load and warm-up each time, and the target falls one window after the load did.

Scaling to zero, for a model that allows it (min_replicas 0, as KServe's minReplicas: 0): its versions
keep one replica until they have had no request for `idle_before_zero_s`, and then go to none at once
(the idle time was the hysteresis). A request that finds no replica then waits at the gateway while one
starts (a cold start; serving.runtime.Runtime.wait_for_replica), and its wait counts as a request here:
the caller passes how long the version has been idle, from the replicas' last requests and the gateway's
waits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    min_replicas: int = 1  # per version that must serve (traffic, an alias, shadow copies); 0: none when idle
    max_replicas: int = 4
    target_queue_per_replica: float = 2.0
    target_saturation: float = 0.9
    target_kv_usage: float = 0.8
    warm_buffer: int = 0
    scale_down_window_s: float = 120.0
    idle_before_zero_s: float = 300.0  # with min_replicas 0: no request for this long, and none are kept
    target_tpot_ms: float | None = None  # the mean step time to hold replicas at; None: no step-time signal

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if min(self.target_queue_per_replica, self.target_saturation, self.target_kv_usage) <= 0:
            raise ValueError("every target must be positive")
        if self.warm_buffer < 0 or self.scale_down_window_s < 0:
            raise ValueError("warm_buffer and scale_down_window_s must not be negative")
        if self.idle_before_zero_s <= 0:  # 0 would take a version with a request waiting for idle
            raise ValueError("idle_before_zero_s must be positive")
        if self.target_tpot_ms is not None and not self.target_tpot_ms > 0:
            raise ValueError("target_tpot_ms must be positive (or None: no step-time signal)")


@dataclass(frozen=True, slots=True)
class ReplicaSignals:
    """One ready replica's last heartbeat."""

    num_waiting: int
    num_running: int
    capacity: int  # the most sequences (or batch items) it runs at once; 0 when it does not say
    kv_cache_usage: float
    is_generative: bool = True  # False: an encoder, whose num_waiting is inputs and num_running 0
    step_s: float = 0.0  # its steps' mean time over the last few seconds; 0: no step ran
    step_rate: float = 0.0  # how many steps it ran a second of wall time, over the same seconds
    base_step_s: float = 0.0  # a step with one sequence decoding; 0: not known (an older replica)


@dataclass(frozen=True, slots=True)
class Recommendation:
    replicas: int
    reason: str  # which signal decided it, with its figures
    figures: dict[str, float] = field(default_factory=dict)  # the version's load it was made from


def recommend(
    replicas: Sequence[ReplicaSignals],
    policy: ScalingPolicy,
    *,
    idle_s: float = 0.0,
    kept_warm_by: str | None = None,
) -> Recommendation:
    """The replicas the version's current load needs. `replicas`: its ready replicas' heartbeats (none
    for a version that has none yet: it gets min_replicas). With min_replicas 0 only: `idle_s`, how long
    since the version last had a request or a request waited for it (math.inf: never); `kept_warm_by`,
    a reason to keep one replica however long it has been idle."""
    floor = _Floor(policy.min_replicas, f"the minimum, {policy.min_replicas}")
    if policy.min_replicas == 0 and kept_warm_by is not None:
        floor = _Floor(1, f"kept warm: {kept_warm_by}")
    elif policy.min_replicas == 0 and idle_s < policy.idle_before_zero_s:
        after = f"{policy.idle_before_zero_s:g} s"
        floor = _Floor(1, f"kept warm: the last request {idle_s:.0f} s ago, to zero after {after}")
    if not replicas:
        return _bounded(0, "no ready replica", policy, floor, {"ready": 0})
    n = len(replicas)
    waiting = sum(r.num_waiting for r in replicas)
    queued = sum(r.num_waiting if r.is_generative else r.num_waiting / max(1, r.capacity) for r in replicas)
    running = sum(r.num_running for r in replicas)
    # Only replicas that say their capacity, and that run sequences, tell how full a batch is.
    measured = [r for r in replicas if r.capacity and r.is_generative]
    capacity = sum(r.capacity for r in measured)
    saturation = sum(r.num_running for r in measured) / capacity if capacity else 0.0
    kv_usage = sum(r.kv_cache_usage for r in replicas) / n
    figures = {
        "ready": n,
        "waiting": waiting,
        "running": running,
        "capacity": sum(r.capacity for r in replicas),
        "kv_cache_usage": round(kv_usage, 4),
    }
    needs = {
        f"queue depth {queued:g} (target {policy.target_queue_per_replica:g} a replica)": _ceil_ratio(
            queued, policy.target_queue_per_replica
        ),
        f"batch saturation {saturation:.0%} (target {policy.target_saturation:.0%})": _ceil_ratio(
            n * saturation, policy.target_saturation
        ),
        f"KV-cache use {kv_usage:.0%} (target {policy.target_kv_usage:.0%})": _ceil_ratio(
            n * kv_usage, policy.target_kv_usage
        ),
    }
    if policy.target_tpot_ms is not None:
        needs.update(_step_time_need(replicas, policy.target_tpot_ms / 1000, figures))
    reason, needed = max(needs.items(), key=lambda item: item[1])
    return _bounded(needed, f"{reason} on {n} replica{'s' if n > 1 else ''}", policy, floor, figures)


def _step_time_need(
    replicas: Sequence[ReplicaSignals], target_s: float, figures: dict[str, float]
) -> dict[str, int]:
    """The step-time signal: the replicas' per-token work, in replicas' worth at the target (the
    module's docstring says how)."""
    timed = [r for r in replicas if r.is_generative and r.step_s > 0 and 0 < r.base_step_s <= target_s / 2]
    if not timed:
        return {}
    # Each replica's share of wall time on per-token work, and that share over the one at the target.
    shares = [min(1.0, r.step_rate * max(0.0, r.step_s - r.base_step_s)) for r in timed]
    work = sum(shares)
    needed = sum(share / (1 - r.base_step_s / target_s) for share, r in zip(shares, timed, strict=True))
    step_ms = 1000 * sum(r.step_s for r in timed) / len(timed)
    base_ms = 1000 * sum(r.base_step_s for r in timed) / len(timed)
    figures.update(step_ms=round(step_ms, 2), base_step_ms=round(base_ms, 2), step_work=round(work, 3))
    reason = (
        f"step time {step_ms:.1f} ms over a {base_ms:.1f} ms base, {work:.2f} replicas of per-token work "
        f"(target {1000 * target_s:g} ms)"
    )
    return {reason: _ceil_ratio(needed, 1.0)}


def _ceil_ratio(load: float, target: float) -> int:
    # A hair of float error must not ask for one replica more (3 x 0.8 / 0.8 is not quite 3).
    return math.ceil(load / target - 1e-9)


@dataclass(frozen=True, slots=True)
class _Floor:
    replicas: int
    reason: str


def _bounded(
    needed: int, reason: str, policy: ScalingPolicy, floor: _Floor, figures: dict[str, float]
) -> Recommendation:
    base = max(floor.replicas, needed)
    replicas = min(policy.max_replicas, base + policy.warm_buffer) if base else 0  # no buffer for none
    if replicas == 0:
        reason = f"scaled to zero, no request for {policy.idle_before_zero_s:g} s ({reason})"
    elif needed < floor.replicas:
        reason = f"{floor.reason} (the load needs {needed}: {reason})"
    elif needed > policy.max_replicas:
        reason = f"the maximum, {policy.max_replicas} (the load needs {needed}: {reason})"
    return Recommendation(replicas, reason, figures)


def next_target(
    history: Sequence[tuple[float, int]], *, now: float, current: int, policy: ScalingPolicy
) -> int:
    """The target after the newest recommendation, given every recommendation of the window so far as
    (time, replicas), the newest last: up at once, down only as far as the whole window allows, and
    never over the policy's maximum (lowered by an operator, it holds at once). Zero, which only an idle
    version of a policy that scales to zero is recommended, holds at once: the idle time was the wait."""
    if not history:
        return min(current, policy.max_replicas)
    newest = history[-1][1]
    if newest >= current or (newest == 0 and policy.min_replicas == 0):
        return newest
    in_window = [n for t, n in history if now - t <= policy.scale_down_window_s]
    return min(current, max(in_window, default=newest), policy.max_replicas)
