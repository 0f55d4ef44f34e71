"""A fleet on a virtual clock: what a scaling policy does to latency and cost when the load changes.

Every replica runs the real Scheduler and KVCacheManager, with serving.engine.simulated's latency model
standing in for the forward pass; requests go to the least loaded of two ready replicas (the router's
choice_replica), wait at the gateway while none is ready (a cold start), and the autoscaler's own policy
(rollouts.fleet.autoscaler: recommend, next_target) runs on its tick from the replicas' signals. A replica it
adds serves only after `load_time_s`; one it removes drains first. Deterministic under a seed, and
minutes of traffic take seconds. With an SloAdmission (rollouts/fleet/slo_gateway.py), the gateway
admits each arrival only where its TTFT is forecast to meet the objective, and refuses it otherwise.

    python manage.py simulate fleet --rate 0:2,120:16,300:2 --duration 420 --compare-static 4
    python manage.py simulate slo --replicas 4 --ttft-objective-ms 1000 --overload 1.5
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import deque
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from rollouts.fleet.autoscaler import ReplicaSignals, ScalingPolicy, next_target, recommend
from rollouts.fleet.slo_gateway import SloAdmission
from serving.engine.kv_cache import KVCacheManager
from serving.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, latest_ends_in_steps
from serving.engine.sequence import SamplingParams, Sequence
from serving.engine.simulated import LatencyModel, SimulatedExecutor, SimulatedRequest
from serving.gateway.router import choose_replica
from serving.transport.replica_directory import SEAT_ENDS_REPORTED, STEP_WINDOW_S, RecentSteps
from serving.transport.step_rate import StepRate, prefilled_tokens


class StepLatency(Protocol):
    """A replica's forward pass on the virtual clock: serving.engine.simulated.LatencyModel, or a
    capacity plan's roofline (rollouts.fleet.step_time_model.RooflineLatency)."""

    def step_ms(self, output: SchedulerOutput) -> float: ...

    def base_step_ms(self, context_tokens: int = 0) -> float: ...


RateProfile = SequenceOf[tuple[float, float]]  # (from second, requests per second), in time order
STALL_S = 3600.0  # virtual seconds after the last arrival with requests still unfinished: a bug, not a load


def parse_rate_profile(text: str) -> list[tuple[float, float]]:
    """'0:2,120:16,300:2' -> [(0, 2), (120, 16), (300, 2)]. Raises ValueError."""
    profile = []
    for part in text.split(","):
        start, _, rate = part.partition(":")
        profile.append((float(start), float(rate)))
    if not profile or profile[0][0] != 0:
        raise ValueError("the rate profile must start at 0, e.g. 0:2,120:16")
    if any(b[0] <= a[0] for a, b in itertools.pairwise(profile)) or any(r < 0 for _, r in profile):
        raise ValueError("the rate profile's times must increase and its rates must not be negative")
    return profile


def poisson_arrivals(
    profile: RateProfile,
    duration_s: float,
    *,
    prompt_tokens: tuple[int, int] = (64, 512),
    output_tokens: tuple[int, int] = (64, 256),
    vocab_size: int = 32_000,
    seed: int = 0,
) -> list[SimulatedRequest]:
    """Poisson arrivals at a rate that changes at the profile's times (memoryless: each stretch starts
    afresh), with uniform prompt and output lengths."""
    rng = random.Random(seed)
    requests: list[SimulatedRequest] = []
    ends = [start for start, _ in profile[1:]] + [duration_s]
    for (start, rate), end in zip(profile, ends, strict=True):
        at = start
        while rate > 0:
            at += rng.expovariate(rate)
            if at >= min(end, duration_s):
                break
            prompt = tuple(rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_tokens)))
            requests.append(SimulatedRequest(f"req-{len(requests)}", at, prompt, rng.randint(*output_tokens)))
    return requests


def steady_arrivals(
    rate: float,
    duration_s: float,
    *,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    vocab_size: int = 32_000,
    seed: int = 0,
) -> list[SimulatedRequest]:
    """Poisson arrivals at one rate with uniform lengths, for loads of hundreds of thousands of
    requests: each prompt's first two tokens number the request (no two share a prefix, so nothing is
    served from the prefix cache) and the rest is one filler, so no token is drawn at random."""
    if not (math.isfinite(rate) and rate > 0 and math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"need a rate and a duration > 0, got {rate!r} req/s over {duration_s!r} s")
    rng = random.Random(seed)
    filler = tuple(i % vocab_size for i in range(2, prompt_tokens[1] + 2))
    requests: list[SimulatedRequest] = []
    at = rng.expovariate(rate)
    while at < duration_s:
        n = len(requests)
        head = (n // vocab_size % vocab_size, n % vocab_size)
        length = rng.randint(*prompt_tokens)
        prompt = head[-length:] + filler[: max(0, length - 2)]
        requests.append(SimulatedRequest(f"req-{n}", at, prompt, rng.randint(*output_tokens)))
        at += rng.expovariate(rate)
    return requests


@dataclass(frozen=True, slots=True)
class FleetConfig:
    policy: ScalingPolicy
    scheduler: SchedulerConfig
    num_blocks: int  # KV blocks per replica
    latency: StepLatency = field(default_factory=LatencyModel)
    load_time_s: float = 30.0  # from the autoscaler's decision to a ready replica (start, load, warm up)
    tick_s: float = 5.0
    initial_replicas: int = 1
    ttft_sla_s: float = 1.0


def sized_fleet(
    policy: ScalingPolicy,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    num_blocks: int,
    latency: StepLatency,
    block_size: int = 16,
    **fleet: float,
) -> FleetConfig:
    """A FleetConfig from plain numbers (a capacity plan's), the scheduler's other settings at their
    defaults; `fleet`: FleetConfig's load_time_s, tick_s, initial_replicas, ttft_sla_s."""
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
    )
    scheduler.validate()
    initial = int(fleet.pop("initial_replicas", 1))
    return FleetConfig(policy, scheduler, num_blocks, latency, initial_replicas=initial, **fleet)


@dataclass(slots=True)
class TickRow:
    at_s: float
    arrival_rate: float  # requests per second over the tick before
    target: int
    ready: int
    starting: int
    draining: int
    queued: int  # waiting at the gateway for any replica, or in a replica for a batch slot
    kv_cache_usage: float  # mean over ready replicas
    step_ms: float  # mean over ready replicas that stepped lately (what their heartbeats say)


@dataclass(slots=True)
class FleetReport:
    rows: list[TickRow]
    ttft_s: list[float]  # per request, arrival (at the gateway) to first token
    tpot_s: list[float]
    num_requests: int
    replica_seconds: float  # replicas held, starting or serving: the fleet's cost
    ttft_sla_s: float

    @property
    def sla_attainment(self) -> float:
        return sum(t <= self.ttft_sla_s for t in self.ttft_s) / len(self.ttft_s) if self.ttft_s else 1.0


class _Replica:
    def __init__(self, config: FleetConfig, clock: list[float], seed: int) -> None:
        self.started_at = clock[0]
        self.ready_at = clock[0] + config.load_time_s
        self.is_draining = False
        self.kv = KVCacheManager(config.num_blocks, config.scheduler.block_size, salt_secret=b"fleet")
        self.scheduler = Scheduler(config.scheduler, self.kv, clock=lambda: clock[0])
        # The executor only asks its latency model for step_ms(output): any StepLatency does.
        self.executor = SimulatedExecutor(cast(LatencyModel, config.latency), seed=seed)
        # output, its tokens, when it started and when it ends
        self.step: tuple[SchedulerOutput, dict[str, int], float, float] | None = None
        self.recent_steps = RecentSteps(since=self.ready_at)
        self._clock = clock
        # What its heartbeat would carry for the gateway's TTFT forecast (docs/architecture.md,
        # "SLO-aware admission"): the sequences routed here and not finished, and the prefill rate.
        self.sequences: dict[str, Sequence] = {}
        self.prefill_rate = StepRate(STEP_WINDOW_S)  # prompt tokens, over the steps that prefilled
        self.seat_rate = StepRate(STEP_WINDOW_S)  # sequences ended, over every step
        self.capacity = config.scheduler.max_num_seqs
        self.last_step_ended_at: float | None = None  # virtual time; None: no step has
        # What a replica's warm-up times: one sequence decoding over two blocks and a token (ModelRunner).
        self.base_step_s = config.latency.base_step_ms(2 * config.scheduler.block_size + 1) / 1000

    @property
    def is_ready(self) -> bool:  # what the router asks
        return not self.is_draining and self._clock[0] >= self.ready_at

    @property
    def load(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    @property
    def is_idle(self) -> bool:
        return self.step is None and not self.scheduler.has_unfinished()

    @property
    def queued_prompt_tokens(self) -> int:  # as Engine.queued_prompt_tokens counts them
        return sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in self.sequences.values())

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_rate.per_s

    @property
    def queue_depth(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def seats_freed_per_s(self) -> float:
        return self.seat_rate.per_s

    @property
    def step_s(self) -> float:
        return self.recent_steps.read(self._clock[0]).mean_s

    @property
    def latest_ends_in_steps(self) -> tuple[int, ...]:
        return latest_ends_in_steps(self.scheduler.running_seqs(), SEAT_ENDS_REPORTED)

    @property
    def since_step_s(self) -> float:
        return 0.0 if self.last_step_ended_at is None else self._clock[0] - self.last_step_ended_at


def simulate_fleet(
    requests: SequenceOf[SimulatedRequest],
    config: FleetConfig,
    *,
    seed: int = 0,
    admission: SloAdmission[Any] | None = None,
) -> FleetReport:
    """`admission`: the gateway's SLO-aware admission, which refuses what it forecasts to miss the
    objective (its refusals are its own); None routes every request as the router alone would."""
    clock = [0.0]  # shared by every replica's scheduler
    rng = random.Random(seed)
    replicas = [_Replica(config, clock, seed) for _ in range(config.initial_replicas)]
    for replica in replicas:  # the fleet starts warm
        replica.ready_at = replica.recent_steps.since = 0.0
    arrivals = deque(sorted(requests, key=lambda r: r.arrival_s))
    held: deque[SimulatedRequest] = deque()  # at the gateway: no ready replica
    ttft_s: list[float] = []
    tpot_s: list[float] = []
    rows: list[TickRow] = []
    history: list[tuple[float, int]] = []
    target, next_tick, last_request_at = config.initial_replicas, config.tick_s, -math.inf
    arrived_since_tick = 0
    replica_seconds = 0.0

    def route(request: SimulatedRequest) -> bool:
        """False: no replica is ready, the request waits at the gateway. A refusal is an answer (a 429)."""
        candidates = replicas
        if admission is not None and (ready := [r for r in replicas if r.is_ready]):
            prompt_tokens = len(request.prompt_token_ids)  # known exactly here, estimated live
            admissible = admission.admit(request.request_id, prompt_tokens, ready, clock[0])
            if admissible is None:
                return True
            candidates = admissible
        replica = choose_replica(candidates, rng=rng)
        if replica is None:
            return False
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        prompt = list(request.prompt_token_ids)
        # arrival_time is the arrival at the gateway: TTFT counts a cold start's wait
        seq = Sequence(request.request_id, prompt, params, arrival_time=request.arrival_s)
        replica.scheduler.add(seq)
        replica.sequences[seq.request_id] = seq
        return True

    while arrivals or held or any(not r.is_idle for r in replicas):
        times = [r.step[3] for r in replicas if r.step is not None]
        times += [r.ready_at for r in replicas if r.ready_at > clock[0]]
        times += [arrivals[0].arrival_s] if arrivals else []
        times.append(next_tick)
        now = max(clock[0], min(times))
        if now - last_request_at > STALL_S and not arrivals:
            raise RuntimeError(f"the fleet made no progress for {STALL_S:g} s of virtual time")
        replica_seconds += (now - clock[0]) * len(replicas)
        clock[0] = now
        stepped = False
        for replica in replicas:
            if replica.step is not None and replica.step[3] <= now:
                output, sampled, started, _ = replica.step
                replica.step, stepped = None, True
                replica.last_step_ended_at = now
                replica.recent_steps.add(now, now - started)  # steps are instants here: no begin()
                if prefilled := prefilled_tokens(output.num_batched_tokens, len(output.scheduled)):
                    replica.prefill_rate.add(now, prefilled, now - started)
                finished = replica.scheduler.update(output, sampled)
                replica.seat_rate.add(now, len(finished), now - started)
                for seq in finished:
                    del replica.sequences[seq.request_id]
                    assert seq.first_token_time is not None
                    assert seq.finished_time is not None
                    ttft_s.append(seq.first_token_time - seq.arrival_time)
                    if seq.num_output_tokens > 1:
                        tpot_s.append(
                            (seq.finished_time - seq.first_token_time) / (seq.num_output_tokens - 1)
                        )
        if admission is not None and stepped:
            admission.observe([r for r in replicas if r.is_ready], now)
        while held and route(held[0]):
            held.popleft()
        while arrivals and arrivals[0].arrival_s <= now:
            request = arrivals.popleft()
            arrived_since_tick += 1
            last_request_at = now
            if held or not route(request):
                held.append(request)
        if now >= next_tick:
            target = _tick(replicas, held, history, target, config, now, last_request_at)
            _scale(replicas, target, config, clock, seed)
            rows.append(_row(replicas, held, target, arrived_since_tick / config.tick_s, now))
            arrived_since_tick = 0
            next_tick += config.tick_s
        replicas[:] = [r for r in replicas if not (r.is_draining and r.is_idle)]
        for replica in replicas:
            if replica.step is None and now >= replica.ready_at and replica.scheduler.has_unfinished():
                output = replica.scheduler.schedule()
                if output.scheduled:
                    sampled, step_ms = replica.executor.execute(output)
                    replica.step = (output, sampled, now, now + step_ms / 1000)
    return FleetReport(rows, ttft_s, tpot_s, len(requests), replica_seconds, config.ttft_sla_s)


def _tick(
    replicas: list[_Replica],
    held: deque[SimulatedRequest],
    history: list[tuple[float, int]],
    target: int,
    config: FleetConfig,
    now: float,
    last_request_at: float,
) -> int:
    """One autoscaler tick, as rollouts.scaling.autoscale does it for one version."""
    ready = [r for r in replicas if r.is_ready]
    # What a replica's warm-up times: one sequence decoding over two blocks and a token (ModelRunner).
    base_step_s = config.latency.base_step_ms(2 * config.scheduler.block_size + 1) / 1000
    signals = [
        ReplicaSignals(
            r.scheduler.num_waiting,
            r.scheduler.num_running,
            config.scheduler.max_num_seqs,
            r.kv.usage,
            step_s=steps.mean_s,
            step_rate=steps.per_s,
            base_step_s=base_step_s,
        )
        for r, steps in ((r, r.recent_steps.read(now)) for r in ready)
    ]
    if signals and held:  # requests waiting at the gateway are queue depth too
        signals[0] = dataclasses.replace(signals[0], num_waiting=signals[0].num_waiting + len(held))
    idle_s = 0.0 if held else now - last_request_at
    advice = recommend(signals, config.policy, idle_s=idle_s)
    history[:] = [(t, n) for t, n in history if now - t <= config.policy.scale_down_window_s]
    history.append((now, advice.replicas))
    return next_target(history, now=now, current=target, policy=config.policy)


def _scale(
    replicas: list[_Replica],
    target: int,
    config: FleetConfig,
    clock: list[float],
    seed: int,
) -> None:
    """The provisioner's pass: start what is missing; drain what is over, the newest first (one still
    starting is simply not started)."""
    live = [r for r in replicas if not r.is_draining]
    for _ in range(target - len(live)):
        replicas.append(_Replica(config, clock, seed + len(replicas)))
    for replica in sorted(live, key=lambda r: r.started_at, reverse=True)[: max(0, len(live) - target)]:
        if clock[0] < replica.ready_at:
            replicas.remove(replica)
        else:
            replica.is_draining = True


def _row(
    replicas: list[_Replica], held: deque[SimulatedRequest], target: int, rate: float, now: float
) -> TickRow:
    ready = [r for r in replicas if r.is_ready]
    steps = [s for s in (r.recent_steps.read(now).mean_s for r in ready) if s]
    return TickRow(
        at_s=now,
        arrival_rate=rate,
        target=target,
        ready=len(ready),
        starting=sum(1 for r in replicas if now < r.ready_at),
        draining=sum(1 for r in replicas if r.is_draining),
        queued=len(held) + sum(r.scheduler.num_waiting for r in replicas),
        kv_cache_usage=sum(r.kv.usage for r in ready) / len(ready) if ready else 0.0,
        step_ms=1000 * sum(steps) / len(steps) if steps else 0.0,
    )
