"""The autoscaler: its policy (pure, with property tests) and its tick, which writes each serving
version's target from the replicas' heartbeats."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.fleet.autoscaler import ReplicaSignals, ScalingPolicy, next_target, recommend

POLICY = ScalingPolicy(
    min_replicas=1,
    max_replicas=6,
    target_queue_per_replica=2,
    target_saturation=0.9,
    target_kv_usage=0.8,
    scale_down_window_s=60,
)


def idle(capacity: int = 64) -> ReplicaSignals:
    return ReplicaSignals(num_waiting=0, num_running=0, capacity=capacity, kv_cache_usage=0.0)


# --- recommend -----------------------------------------------------------------------------------------


def test_each_signal_asks_for_replicas_by_its_own_target() -> None:
    assert recommend([], POLICY).replicas == 1  # a version that must serve gets one before it has load
    idle_advice = recommend([idle(), idle(), idle()], POLICY)
    assert idle_advice.replicas == 1 and idle_advice.reason.startswith("the minimum, 1 (the load needs 0")
    queued = recommend([ReplicaSignals(7, 64, 64, 0.5)], POLICY)
    assert queued.replicas == 4 and queued.reason.startswith("queue depth 7")  # ceil(7 / 2)
    full_cache = recommend([ReplicaSignals(0, 10, 64, 0.95), ReplicaSignals(0, 10, 64, 0.85)], POLICY)
    assert full_cache.replicas == 3 and full_cache.reason.startswith("KV-cache use 90%")  # ceil(2 x .9 / .8)
    busy = recommend([ReplicaSignals(0, 64, 64, 0.2)], POLICY)
    assert busy.replicas == 2 and busy.reason.startswith("batch saturation 100%")
    assert busy.figures == {"ready": 1, "waiting": 0, "running": 64, "capacity": 64, "kv_cache_usage": 0.2}
    # exactly at the target is enough: no replica more for float error (3 x 0.8 / 0.8)
    assert recommend([ReplicaSignals(0, 0, 64, 0.8)] * 3, POLICY).replicas == 3


def test_an_encoder_queue_counts_in_batches_and_an_older_replica_does_not_skew_saturation() -> None:
    # An embedding request of 8 inputs waiting for a batch of up to 32 is a quarter of a batch, not 8
    # requests: one replica still does.
    encoder = ReplicaSignals(
        num_waiting=8, num_running=0, capacity=32, kv_cache_usage=0.0, is_generative=False
    )
    assert recommend([encoder], POLICY).replicas == 1
    assert (
        recommend([ReplicaSignals(200, 0, 32, 0.0, is_generative=False)], POLICY).replicas == 4
    )  # 6.25 batches
    # A replica that does not say its capacity (an older one) adds neither running nor capacity.
    older, newer = ReplicaSignals(0, 64, 0, 0.1), ReplicaSignals(0, 16, 64, 0.1)
    advice = recommend([older, newer], POLICY)
    assert advice.replicas == 1 and "saturation 25%" in advice.reason


def test_the_warm_buffer_and_the_bounds() -> None:
    buffered = ScalingPolicy(min_replicas=1, max_replicas=6, warm_buffer=1)
    assert recommend([idle()], buffered).replicas == 2
    assert recommend([ReplicaSignals(100, 64, 64, 1.0)], POLICY).replicas == POLICY.max_replicas
    with pytest.raises(ValueError, match="min_replicas"):
        ScalingPolicy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="max_replicas >= 1"):
        ScalingPolicy(min_replicas=0, max_replicas=0)
    with pytest.raises(ValueError, match="positive"):
        ScalingPolicy(target_kv_usage=0)


TO_ZERO = ScalingPolicy(min_replicas=0, max_replicas=6, idle_before_zero_s=300, scale_down_window_s=60)


def test_a_version_that_scales_to_zero_keeps_one_replica_until_idle_and_then_none() -> None:
    warm = recommend([idle()], TO_ZERO, idle_s=42)
    assert warm.replicas == 1
    assert warm.reason.startswith("kept warm: the last request 42 s ago, to zero after 300 s")
    cold = recommend([idle()], TO_ZERO, idle_s=300)
    assert cold.replicas == 0 and cold.reason.startswith("scaled to zero, no request for 300 s")
    # no replica: a request waiting at a gateway (idle 0) gets one; a version never asked for, none
    assert recommend([], TO_ZERO, idle_s=0).replicas == 1
    assert recommend([], TO_ZERO, idle_s=math.inf).replicas == 0
    kept = recommend([idle()], TO_ZERO, idle_s=math.inf, kept_warm_by="a deployment in flight")
    assert kept.replicas == 1 and kept.reason.startswith("kept warm: a deployment in flight")
    # load still counts as load, and the warm buffer is for replicas that serve, not for none
    assert recommend([ReplicaSignals(7, 64, 64, 0.5)], TO_ZERO, idle_s=0).replicas == 4
    buffered = ScalingPolicy(min_replicas=0, max_replicas=6, warm_buffer=1, idle_before_zero_s=300)
    assert recommend([idle()], buffered, idle_s=10).replicas == 2
    assert recommend([idle()], buffered, idle_s=301).replicas == 0
    # a policy that does not scale to zero does not care how long it has been idle
    assert recommend([idle()], POLICY, idle_s=math.inf).replicas == 1
    with pytest.raises(ValueError, match="idle_before_zero_s must be positive"):
        ScalingPolicy(min_replicas=0, idle_before_zero_s=0)


STEP_TIMED = dataclasses.replace(POLICY, target_tpot_ms=50)


def timed(step_ms: float, base_ms: float = 10.0, *, busy: float = 1.0) -> ReplicaSignals:
    """A replica with 8 of 64 sequences running, stepping `busy` of the time."""
    step_s = step_ms / 1000
    return ReplicaSignals(0, 8, 64, 0.1, step_s=step_s, step_rate=busy / step_s, base_step_s=base_ms / 1000)


def test_step_time_asks_for_the_replicas_that_bring_it_to_its_target() -> None:
    # A 10 ms base and a 50 ms target: a replica is at its target with 80% of each step per-token work.
    # 40 ms steps are 75% (0.94 of a replica's worth at the target), 100 ms steps 90% (1.13).
    assert recommend([timed(40)], STEP_TIMED).replicas == 1
    slow = recommend([timed(100)], STEP_TIMED)
    assert slow.replicas == 2
    assert slow.reason.startswith("step time 100.0 ms over a 10.0 ms base, 0.90 replicas of per-token work")
    assert (slow.figures["step_ms"], slow.figures["base_step_ms"], slow.figures["step_work"]) == (
        100,
        10,
        0.9,
    )
    # The same steps a tenth of the time (one long prompt now and then) are a tenth of the work.
    assert recommend([timed(100, busy=0.1)], STEP_TIMED).replicas == 1
    assert recommend([timed(100, busy=0.1)] * 4, STEP_TIMED).replicas == 1
    # Batches far from full (8 of 64, 10% of the cache, no queue): only step time sees the load.
    assert recommend([timed(100)], POLICY).replicas == 1
    # Steps at the base are no load at all, however many replicas take them.
    assert recommend([timed(10)] * 4, STEP_TIMED).replicas == 1


@settings(max_examples=300, deadline=None)
@given(
    work=st.floats(0.05, 5.5),
    base_ms=st.floats(1, 22),
    target_ms=st.floats(45, 200),
    extra=st.integers(1, 4),
)
def test_step_time_settles_on_one_fleet_size_whatever_the_size_it_reads(
    work: float, base_ms: float, target_ms: float, extra: int
) -> None:
    """Replicas whose steps behave as the model says (base / (1 - W/n) for W replicas' worth of
    per-token work on n of them) get one recommendation from any fleet that is not overloaded, and that
    many replicas hold the steps at or under the target."""
    policy = ScalingPolicy(min_replicas=1, max_replicas=64, target_tpot_ms=target_ms)

    def fleet(n: int) -> list[ReplicaSignals]:
        step_ms = base_ms / (1 - work / n)
        return [timed(step_ms, base_ms)] * n

    sizes = [math.floor(work) + 1 + k for k in range(extra)]
    advice = {recommend(fleet(n), policy).replicas for n in sizes}
    assert len(advice) == 1
    (needed,) = advice
    assert base_ms / (1 - work / needed) <= target_ms * (1 + 1e-9)
    if needed - 1 > work:  # and one fewer would not (fewer than the work itself is overloaded)
        assert base_ms / (1 - work / (needed - 1)) > target_ms * (1 - 1e-9)


def test_step_time_leaves_out_what_cannot_tell() -> None:
    # A base over the target (no fleet size helps), a replica that does not say its base (an older
    # one), an encoder, and a replica whose steps did not run lately.
    # A base over half the target: the count would turn on noise near it, and nothing helps past it.
    for base_ms in (26, 60):
        unreachable = recommend([timed(400, base_ms=base_ms)], STEP_TIMED)
        assert unreachable.replicas == 1 and "step" not in unreachable.reason
    assert recommend([timed(400, base_ms=25)], STEP_TIMED).replicas == 2
    older = ReplicaSignals(0, 8, 64, 0.1, step_s=0.4, step_rate=2.5)
    encoder = ReplicaSignals(0, 0, 32, 0.0, is_generative=False, step_s=0.4, step_rate=2.5, base_step_s=0.01)
    quiet = ReplicaSignals(0, 0, 64, 0.0, base_step_s=0.01)
    assert recommend([older, encoder, quiet], STEP_TIMED).replicas == 1
    with pytest.raises(ValueError, match="target_tpot_ms"):
        ScalingPolicy(target_tpot_ms=0)


def test_zero_holds_at_once_where_any_other_scale_down_waits_out_the_window() -> None:
    history = [(1000.0, 3), (1010.0, 1)]
    assert next_target(history, now=1010.0, current=3, policy=TO_ZERO) == 3
    assert next_target([*history, (1020.0, 0)], now=1020.0, current=3, policy=TO_ZERO) == 0


@st.composite
def signals(draw: st.DrawFn) -> ReplicaSignals:
    capacity = draw(st.sampled_from([0, 8, 64]))
    is_generative = draw(st.booleans())
    base_step_s = draw(st.sampled_from([0.0, 0.005, 0.02, 0.3]))
    step_s = draw(st.one_of(st.just(0.0), st.floats(base_step_s or 0.001, 2)))
    return ReplicaSignals(
        step_s=step_s,
        step_rate=draw(st.floats(0, 1 / step_s)) if step_s else 0.0,
        base_step_s=base_step_s,
        num_waiting=draw(st.integers(0, 200)),
        # never more than it runs at once, when it says; an encoder runs none between its batches
        num_running=draw(st.integers(0, capacity or 64)) if is_generative else 0,
        capacity=capacity,
        kv_cache_usage=draw(st.floats(0, 1)) if is_generative else 0.0,
        is_generative=is_generative,
    )


policies = st.builds(
    ScalingPolicy,
    min_replicas=st.integers(0, 3),
    max_replicas=st.integers(3, 10),
    target_queue_per_replica=st.floats(0.5, 8),
    target_saturation=st.floats(0.1, 1),
    target_kv_usage=st.floats(0.1, 1),
    warm_buffer=st.integers(0, 2),
    target_tpot_ms=st.one_of(st.none(), st.floats(10, 200)),
)


@settings(max_examples=300, deadline=None)
@given(
    replicas=st.lists(signals(), max_size=8),
    policy=policies,
    index=st.integers(0, 7),
    more=st.integers(1, 50),
    idle_s=st.one_of(st.floats(0, 600), st.just(math.inf)),
)
def test_a_recommendation_stays_in_bounds_and_more_load_never_asks_for_fewer(
    replicas: list[ReplicaSignals], policy: ScalingPolicy, index: int, more: int, idle_s: float
) -> None:
    advice = recommend(replicas, policy, idle_s=idle_s)
    assert policy.min_replicas <= advice.replicas <= policy.max_replicas
    if advice.replicas == 0:  # only a policy that allows it, for a version idle long enough
        assert policy.min_replicas == 0 and idle_s >= policy.idle_before_zero_s
    # a request more recent never asks for fewer
    assert recommend(replicas, policy, idle_s=idle_s / 2).replicas >= advice.replicas
    if not replicas:
        return
    i = index % len(replicas)
    r = replicas[i]
    heavier = [
        dataclasses.replace(r, num_waiting=r.num_waiting + more),
        dataclasses.replace(r, num_running=min(r.num_running + more, r.capacity or 64)),
        dataclasses.replace(r, kv_cache_usage=min(1.0, r.kv_cache_usage + more / 50)),
        # longer steps as often, or the same steps more often
        dataclasses.replace(r, step_s=(r.step_s or r.base_step_s or 0.001) * (1 + more / 10)),
        dataclasses.replace(r, step_rate=r.step_rate * (1 + more / 10)),
    ]
    for replacement in heavier:
        loaded = [*replicas[:i], replacement, *replicas[i + 1 :]]
        assert recommend(loaded, policy, idle_s=idle_s).replicas >= advice.replicas


# --- next_target: up at once, down after a whole window --------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.tuples(st.floats(0.5, 40), st.integers(0, 6)), min_size=1, max_size=40),
    start=st.integers(0, 6),
)
def test_the_target_rises_at_once_and_never_falls_below_the_window(
    steps: list[tuple[float, int]], start: int
) -> None:
    """Replays recommendations (seconds since the last one, replicas) as the tick does."""
    now, current, history = 0.0, start, []
    for gap, recommended in steps:
        now += gap
        history = [(t, n) for t, n in history if now - t <= POLICY.scale_down_window_s]
        history.append((now, recommended))
        target = next_target(history, now=now, current=current, policy=POLICY)
        if recommended >= current:
            assert target == recommended  # up (or level) at once
        else:
            assert recommended <= target <= current  # down, but not past the window
            assert target >= max(n for _, n in history)  # nothing the window asked for is taken away
        current = target
    # A whole window of one lower recommendation later, the target is that recommendation.
    low = min(current, steps[-1][1])
    for _ in range(int(POLICY.scale_down_window_s / 10) + 2):
        now += 10
        history = [(t, n) for t, n in history if now - t <= POLICY.scale_down_window_s]
        history.append((now, low))
        current = next_target(history, now=now, current=current, policy=POLICY)
    assert current == low


# --- the tick ----------------------------------------------------------------------------------------


def beat(  # type: ignore[no-untyped-def]
    model: str,
    version: str,
    *,
    waiting: int = 0,
    running: int = 0,
    kv: float = 0.0,
    state: str = "ready",
    sent_at: float | None = None,
    idle_s: float = 0.0,
    step_s: float = 0.0,
    step_rate: float = 0.0,
    base_step_s: float = 0.0,
):
    from serving.transport.replica_directory import Heartbeat

    return Heartbeat(
        replica_id=f"{model}-{version}-{time.monotonic_ns()}",
        model_name=model,
        version=version,
        channel_name="unused",
        state=state,
        num_waiting=waiting,
        num_running=running,
        kv_cache_usage=kv,
        sent_at=time.time() if sent_at is None else sent_at,
        capacity=64,
        idle_s=idle_s,
        step_s=step_s,
        step_rate=step_rate,
        base_step_s=base_step_s,
    )


def _targets() -> dict[tuple[str, str], int]:
    from rollouts.selectors import scale_targets

    return scale_targets()


@pytest.mark.django_db
def test_a_tick_scales_a_loaded_version_up_at_once_and_down_a_window_later(make_model) -> None:
    from rollouts.scaling import autoscale

    make_model("chat")
    assert autoscale(heartbeats=[], policy=POLICY, now=1000.0) == {("chat", "v1"): 1}
    assert _targets() == {("chat", "v1"): 1}  # v2 and v3 carry no traffic: no target

    loaded = [beat("chat", "v1", waiting=7, running=64, kv=0.6, sent_at=1005.0)]
    assert autoscale(heartbeats=loaded, policy=POLICY, now=1005.0) == {("chat", "v1"): 4}
    from rollouts.models import ScaleTarget

    row = ScaleTarget.objects.get(version__version="v1")
    assert row.reason.startswith("queue depth 7") and row.signals["waiting"] == 7
    assert row.signals["recommended"] == 4

    def calm(at: float) -> list:  # type: ignore[type-arg]
        return [beat("chat", "v1", running=4, kv=0.1, sent_at=at) for _ in range(4)]

    assert autoscale(heartbeats=calm(1030.0), policy=POLICY, now=1030.0) == {}  # held: 4 was asked 25 s ago
    assert _targets() == {("chat", "v1"): 4}
    assert ScaleTarget.objects.get(version__version="v1").reason.startswith("held by the scale-down window")
    assert autoscale(heartbeats=calm(1070.0), policy=POLICY, now=1070.0) == {("chat", "v1"): 1}  # a window on


@pytest.mark.django_db
def test_replicas_that_all_restart_are_not_scaled_down_while_they_load(make_model) -> None:
    """Replica processes beat only once ready: a version whose replicas are all starting again (a lost
    node, a provisioner restart) has no signal, which is no evidence that it needs fewer of them."""
    from rollouts.scaling import autoscale

    make_model("chat")
    loaded = [beat("chat", "v1", waiting=7, running=64, kv=0.6, sent_at=1000.0)]
    assert autoscale(heartbeats=loaded, policy=POLICY, now=1000.0) == {("chat", "v1"): 4}
    for at in (1030.0, 1070.0, 1200.0):  # every one of them loading, past the scale-down window
        assert autoscale(heartbeats=[], policy=POLICY, now=at) == {}
    assert _targets() == {("chat", "v1"): 4}
    calm = [beat("chat", "v1", running=4, kv=0.1, sent_at=at) for at in (1210.0,) for _ in range(4)]
    autoscale(heartbeats=calm, policy=POLICY, now=1210.0)
    later = [beat("chat", "v1", running=4, kv=0.1, sent_at=1300.0) for _ in range(4)]
    assert autoscale(heartbeats=later, policy=POLICY, now=1300.0) == {("chat", "v1"): 1}  # ready, then judged


@pytest.mark.django_db
def test_a_tick_reads_the_replicas_step_times_from_their_heartbeats(make_model) -> None:
    from rollouts.models import ScaleTarget
    from rollouts.scaling import autoscale

    make_model("chat")
    # Two replicas, batches an eighth full, no queue, little cache: each step 90 ms over a 10-ms base.
    slow = [beat("chat", "v1", running=8, kv=0.1, step_s=0.09, step_rate=11, base_step_s=0.01) for _ in "ab"]
    assert autoscale(heartbeats=slow, policy=STEP_TIMED, now=1000.0) == {("chat", "v1"): 3}
    row = ScaleTarget.objects.get(version__version="v1")
    assert row.reason.startswith("step time 90.0 ms over a 10.0 ms base, 1.76 replicas of per-token work")
    assert row.reason.endswith("(target 50 ms) on 2 replicas")
    assert (row.signals["step_ms"], row.signals["base_step_ms"], row.signals["step_work"]) == (90, 10, 1.76)


@pytest.mark.django_db
def test_a_version_that_stops_serving_goes_to_zero_and_a_canary_gets_one(make_model) -> None:
    from registry.services import routing_table_set
    from rollouts.scaling import autoscale

    model = make_model("chat")
    autoscale(heartbeats=[beat("chat", "v1")], policy=POLICY, now=1000.0)
    routing_table_set(model=model, weights={"v2": 100})
    # v1 keeps its stable alias, so it still serves; v2 now does too
    assert autoscale(heartbeats=[beat("chat", "v1")], policy=POLICY, now=1001.0) == {("chat", "v2"): 1}
    from registry.models import ModelVersion
    from registry.services import alias_set

    alias_set(
        model=model, name="stable", version=ModelVersion.objects.get(version="v2"), actor="t", reason="r"
    )
    assert autoscale(heartbeats=[], policy=POLICY, now=1002.0) == {("chat", "v1"): 0}
    assert _targets() == {("chat", "v1"): 0, ("chat", "v2"): 1}


@pytest.mark.django_db
def test_a_model_that_scales_to_zero_goes_to_none_when_idle_and_back_to_one_on_demand(make_model) -> None:
    from rollouts.models import ScaleTarget, ScalingBounds
    from rollouts.scaling import autoscale
    from rollouts.services import deployment_create

    model = make_model("chat")
    ScalingBounds.objects.create(model=model, min_replicas=0, max_replicas=2)

    def tick(now: float, beats: list, demand: dict | None = None) -> dict:  # type: ignore[type-arg]
        return autoscale(heartbeats=beats, demand=demand or {}, policy=TO_ZERO, now=now)

    def reason() -> str:
        return ScaleTarget.objects.get(version__version="v1").reason

    # never asked for: none
    assert tick(900.0, []) == {("chat", "v1"): 0}
    # a request waits at a gateway (0.4 s ago, on Redis' clock): one
    assert tick(1000.0, [], {("chat", "v1"): 0.4}) == {("chat", "v1"): 1}
    assert reason().startswith("kept warm: the last request 0 s ago")
    # its replica still loads (it sends no heartbeat until ready), and the request left: kept
    assert tick(1400.0, [], {("chat", "v1"): 400.0}) == {}
    assert reason().startswith("kept warm: no replica has said how long it has been idle")
    # ready, and serving: the least idle time of its replicas counts
    beats = [
        beat("chat", "v1", sent_at=1500.0, idle_s=500.0),
        beat("chat", "v1", sent_at=1500.0, idle_s=10.0),
    ]
    assert tick(1500.0, beats) == {}
    # idle for the whole idle time: none at once, though the scale-down window (60 s) has not passed
    assert tick(1510.0, [beat("chat", "v1", sent_at=1510.0, idle_s=299.0)]) == {}
    assert tick(1511.0, [beat("chat", "v1", sent_at=1511.0, idle_s=300.0)]) == {("chat", "v1"): 0}
    assert reason().startswith("scaled to zero")
    # an older replica that does not say how long it has been idle (0) is never taken for idle
    assert tick(1600.0, [beat("chat", "v1", sent_at=1600.0)]) == {("chat", "v1"): 1}
    # heartbeats missed (or this host's clock ahead of the replicas'): held, not taken for idle
    assert tick(1700.0, [beat("chat", "v1", sent_at=1600.0, idle_s=9999.0)]) == {}
    # a deployment in flight keeps both its versions warm, however idle
    assert tick(1800.0, [beat("chat", "v1", sent_at=1800.0, idle_s=9999.0)]) == {("chat", "v1"): 0}
    deployment_create(model=model, version="v2", created_by="t")
    assert tick(1801.0, [beat("chat", "v1", sent_at=1801.0, idle_s=9999.0)]) == {
        ("chat", "v1"): 1,
        ("chat", "v2"): 1,
    }
    assert reason().startswith("kept warm: a deployment in flight")


@pytest.mark.django_db
def test_a_version_that_lost_its_traffic_keeps_one_replica_while_pinned_requests_keep_coming(
    make_model,
) -> None:
    """Version pinning outlives a promotion: v2 carries no traffic, yet while its replicas still serve
    requests pinned to it, it keeps one; once idle, none. (A pin to a version with no replica at all:
    tests/rollouts/fleet/test_pinned_demand.py.)"""
    from rollouts.scaling import autoscale

    make_model("chat")

    def tick(now: float, beats: list, demand: dict | None = None) -> dict:  # type: ignore[type-arg]
        return autoscale(heartbeats=beats, demand=demand or {}, policy=POLICY, now=now)

    v1 = beat("chat", "v1", sent_at=1000.0)
    assert tick(1000.0, [v1]) == {("chat", "v1"): 1}  # nothing for v2
    # v2's two replicas (it was at 100% until a moment ago) served a pinned request 20 s ago: one stays
    pinned = [beat("chat", "v2", sent_at=1100.0, idle_s=20.0) for _ in range(2)]
    assert tick(1100.0, [v1, *pinned]) == {("chat", "v2"): 1}
    assert _reason_of("v2").startswith("kept warm: the last request 20 s ago")
    assert tick(1200.0, [v1, beat("chat", "v2", sent_at=1200.0, idle_s=299.0)]) == {}
    assert tick(1300.0, [v1, beat("chat", "v2", sent_at=1300.0, idle_s=300.0)]) == {("chat", "v2"): 0}


@pytest.mark.django_db
def test_a_candidate_just_rolled_back_gives_its_replica_up_at_once(make_model) -> None:
    """It was busy until the rollback, but nobody is to go back to it: its device is the incumbent's."""
    from rollouts.scaling import autoscale
    from rollouts.services import deployment_create, deployment_rollback

    model = make_model("chat")
    deployment = deployment_create(model=model, version="v2", created_by="t")

    def tick(now: float, v2_idle_s: float) -> dict:  # type: ignore[type-arg]
        beats = [beat("chat", "v1", sent_at=now), beat("chat", "v2", sent_at=now, idle_s=v2_idle_s)]
        return autoscale(heartbeats=beats, demand={}, policy=POLICY, now=now)

    assert tick(1000.0, 0.0) == {("chat", "v1"): 1, ("chat", "v2"): 1}  # in flight: both kept
    deployment_rollback(deployment=deployment, actor="t")
    assert tick(1010.0, 5.0) == {("chat", "v2"): 0}


def _reason_of(version: str) -> str:
    from rollouts.models import ScaleTarget

    return ScaleTarget.objects.get(version__version=version).reason


@pytest.mark.django_db
def test_replicas_still_loading_or_draining_are_neither_load_nor_capacity(make_model) -> None:
    from rollouts.scaling import autoscale

    make_model("chat")
    make_model("other", versions=("v1",))
    now = 1000.0
    # a ready beat 5 s late still counts (a busy replica's); one 15 s old does not
    late = [beat("chat", "v1", waiting=9, sent_at=now - 5), beat("chat", "v1", waiting=50, sent_at=now - 15)]
    loading = [
        beat("other", "v1", waiting=50, state="loading", sent_at=now),
        beat("other", "v1", waiting=50, state="draining", sent_at=now),
    ]
    assert autoscale(heartbeats=late + loading, policy=POLICY, now=now) == {
        ("chat", "v1"): 5,
        ("other", "v1"): 1,
    }


@pytest.mark.django_db
def test_the_tick_reads_an_embedded_replica_and_heartbeats_in_redis(make_model, settings, redis_url) -> None:
    """The real sources: this process's replicas (here a stand-in runtime) and the hashes replica
    processes write to Redis."""
    import asyncio
    import json
    from dataclasses import asdict

    import redis

    from rollouts.tasks import autoscaler_tick
    from serving import runtime as data_plane
    from serving.transport.replica_directory import version_key

    make_model("chat")
    make_model("other", versions=("v1",))
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    remote = beat("chat", "v1", waiting=9, running=64, kv=0.5)
    # a newer replica's beat, with a field this code does not know, and one that does not parse
    client.hset(version_key("chat", "v1"), remote.replica_id, json.dumps({**asdict(remote), "new_field": 1}))
    client.hset(version_key("chat", "v1"), "broken", b"{not json")
    # a model scaled to zero, with no replica, for which a request waits at a gateway
    from rollouts.models import ScalingBounds
    from serving.transport.replica_directory import DEMAND_KEY, PIN_DECLINES_KEY, RECORD_DEMAND_SCRIPT

    cold = make_model("cold", versions=("v1",))
    ScalingBounds.objects.create(model=cold, min_replicas=0, max_replicas=1)
    client.eval(RECORD_DEMAND_SCRIPT, 2, DEMAND_KEY, PIN_DECLINES_KEY, "cold:v1")  # as record_demand does

    class LocalReplica:
        replica_id = "local-1"

        def heartbeat(self):  # type: ignore[no-untyped-def]
            return beat("other", "v1", running=64)

    class StandInRuntime:
        replicas = {("other", "v1"): LocalReplica()}

    loop = asyncio.new_event_loop()
    data_plane._runtimes[loop] = StandInRuntime()  # type: ignore[assignment]
    settings.REDIS_URL = redis_url
    settings.AUTOSCALER = {**settings.AUTOSCALER, "max_replicas": 4}
    try:
        assert autoscaler_tick() == 3
    finally:
        del data_plane._runtimes[loop]
        loop.close()
        client.flushdb()
    # ceil(9 / 2) = 5, capped; 64/64 > 0.9; and one replica for the request waiting
    assert _targets() == {("chat", "v1"): 4, ("other", "v1"): 2, ("cold", "v1"): 1}


@pytest.mark.django_db
def test_heartbeats_that_cannot_be_read_change_nothing(make_model, settings) -> None:
    from rollouts.tasks import autoscaler_tick

    make_model("chat")
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    assert autoscaler_tick() == 0
    assert _targets() == {}


def test_the_autoscaler_is_on_beat_and_the_embedded_schedule() -> None:
    from django.conf import settings as django_settings

    from config.periodic import parse_schedule, resolve_task
    from rollouts.tasks import autoscaler_tick

    (entry,) = [e for e in parse_schedule(django_settings.CELERY_BEAT_SCHEDULE) if e.name == "autoscaler"]
    assert resolve_task(entry.task_name).name == autoscaler_tick.name and entry.interval_s == 5.0


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SWITCHYARD_AUTOSCALER_MIN_REPLICAS", "0", "scaling to zero is per model"),
        ("SWITCHYARD_MAX_KV_SHARE_PER_TENANT", "1.5", "must be a share in (0, 1]"),
    ],
)
def test_a_setting_out_of_range_stops_the_server_at_start(variable: str, value: str, message: str) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    env = {"PATH": "/usr/bin:/bin", variable: value}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode != 0 and message in result.stderr


@pytest.mark.redis
@pytest.mark.django_db
def test_the_control_planes_heartbeat_readers_age_beats_on_redis_clock(
    settings, redis_url, monkeypatch
) -> None:
    """The judge's readiness check and the autoscaler read the hashes themselves: a control-plane host
    whose clock is 10 s off Redis's must still see a replica that beats as fresh."""
    import asyncio
    import time
    import types
    import uuid

    import redis

    from rollouts import services
    from serving import selectors
    from serving.transport.replica_directory import Heartbeat, HeartbeatPublisher, version_key

    model = f"skew-{uuid.uuid4().hex[:8]}"
    ready = Heartbeat("r1", model, "v2", "switchyard.replica.x", "ready", 0, 0, 0.0, time.time())

    async def publish() -> None:
        publisher = HeartbeatPublisher(redis_url)
        try:
            await publisher.publish(ready)
        finally:
            await publisher.close()

    asyncio.run(publish())
    settings.REDIS_URL = redis_url
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 10)
    try:
        (seen,) = [b for b in selectors.fleet_heartbeats() if b.replica_id == "r1" and b.model_name == model]
        assert seen.is_ready
        named = types.SimpleNamespace
        candidate = named(version="v2", adapter_of=None)  # a full model's version, not an adapter
        deployment = named(model=named(name=model), candidate=candidate, incumbent=named(version="v1"))
        assert services._fleet_replica_ready(deployment) is True  # type: ignore[arg-type]
    finally:
        monkeypatch.setattr(time, "time", real_time)
        redis.Redis.from_url(redis_url).delete(version_key(model, "v2"))
