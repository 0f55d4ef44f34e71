"""The TTFT forecast (serving/gateway/ttft_forecast.py) and the routing decision made on it
(serving/gateway/slo_admission.py), without a data plane."""

import asyncio
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry.selectors import TenantContext
from serving.gateway.data_plane import ReplicaHandle
from serving.gateway.errors import GatewayError
from serving.gateway.quota import Charge, Ticket
from serving.gateway.slo_admission import ObjectiveUnmet, replicas_to_skip, skipped_by_forecast
from serving.gateway.ttft_forecast import HEADROOM, TtftInputs, forecast_ttft, meets, wait_until_met_s
from serving.telemetry import ttft_forecasts
from serving.telemetry.ttft_forecasts import slo_refusal_counts


@pytest.fixture(autouse=True)
def _fresh_forecast_metrics():  # type: ignore[no-untyped-def]
    ttft_forecasts.clear()
    yield
    ttft_forecasts.clear()


tokens = st.integers(min_value=0, max_value=10**7)
rates = st.floats(min_value=1.0, max_value=1e7, allow_nan=False)
step_times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)
seats = st.integers(min_value=0, max_value=1024)


@st.composite
def inputs(draw: st.DrawFn) -> TtftInputs:
    return TtftInputs(
        queued_prompt_tokens=draw(tokens),
        prefill_tokens_per_s=draw(rates),
        step_s=draw(step_times),
        base_step_s=draw(step_times),
        prompt_tokens=draw(tokens),
        num_waiting=draw(seats),
        num_running=draw(seats),
        capacity=draw(seats),
        seats_freed_per_s=draw(st.floats(min_value=0.0, max_value=1e4, allow_nan=False)),
        latest_ends_in_steps=tuple(
            sorted(draw(st.lists(st.integers(min_value=0, max_value=10_000), max_size=16)))
        ),
        since_step_s=draw(step_times),
    )


@given(inputs(), st.integers(min_value=0, max_value=10_000))
def test_more_sequences_waiting_for_a_seat_never_forecasts_a_sooner_first_token(
    base: TtftInputs, more: int
) -> None:
    fewer = forecast_ttft(base)
    more_waiting = forecast_ttft(dataclasses.replace(base, num_waiting=base.num_waiting + more))
    assert fewer is not None and more_waiting is not None
    assert more_waiting.total_s >= fewer.total_s


@given(inputs(), tokens)
def test_more_tokens_queued_ahead_never_forecasts_a_sooner_first_token(base: TtftInputs, more: int) -> None:
    shorter = forecast_ttft(base)
    longer = forecast_ttft(dataclasses.replace(base, queued_prompt_tokens=base.queued_prompt_tokens + more))
    assert shorter is not None and longer is not None
    assert longer.total_s >= shorter.total_s


@given(inputs(), tokens)
def test_a_longer_prompt_never_forecasts_a_sooner_first_token(base: TtftInputs, more: int) -> None:
    shorter = forecast_ttft(base)
    longer = forecast_ttft(dataclasses.replace(base, prompt_tokens=base.prompt_tokens + more))
    assert shorter is not None and longer is not None
    assert longer.total_s >= shorter.total_s


@given(
    st.integers(min_value=-(10**6), max_value=10**7),
    st.floats(allow_nan=True),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(min_value=-(10**6), max_value=10**7),
    st.floats(min_value=0.0, max_value=100.0),
)
def test_a_forecast_and_its_wait_are_never_negative(
    queued: int, rate: float, step_s: float, base_step_s: float, prompt: int, objective_s: float
) -> None:
    forecast = forecast_ttft(TtftInputs(queued, rate, step_s, base_step_s, prompt))
    if forecast is None:  # only a replica that has never measured its prefill rate has no forecast
        assert not rate > 0
        return
    assert min(forecast.queue_wait_s, forecast.prefill_s, forecast.step_s, forecast.total_s) >= 0
    assert wait_until_met_s(forecast, objective_s) >= 0


def test_the_forecast_is_the_queue_ahead_and_the_prompt_at_the_prefill_rate_and_one_step() -> None:
    forecast = forecast_ttft(TtftInputs(3000, 10_000.0, 0.02, 0.005, 1000))
    assert forecast is not None
    assert forecast.total_s == pytest.approx(0.3 + 0.1 + 0.02)
    # An idle replica (no step lately) waits out a step of its base time.
    idle = forecast_ttft(TtftInputs(0, 10_000.0, 0.0, 0.005, 1000))
    assert idle is not None and idle.total_s == pytest.approx(0.105)
    # A replica that has never prefilled (or an older one, whose beat says nothing of it): no forecast.
    assert forecast_ttft(TtftInputs(3000, 0.0, 0.02, 0.005, 1000)) is None


def test_a_replica_with_nothing_queued_meets_any_objective_and_a_busy_one_once_it_drains() -> None:
    # A prompt that alone takes longer than the objective is not refused for ever on an idle replica.
    alone = forecast_ttft(TtftInputs(0, 1000.0, 0.01, 0.0, 5000))
    assert alone is not None and alone.total_s > 1.0 and meets(alone, 1.0)
    busy = forecast_ttft(TtftInputs(4000, 1000.0, 0.01, 0.0, 100))
    assert busy is not None and not meets(busy, 1.0)
    # 4.11 s forecast: 3.41 s over the 0.7 s it must come within (HEADROOM), reached once 3.41 s of its
    # 4 s queue has drained.
    assert wait_until_met_s(busy, 1.0) == pytest.approx(4.11 - HEADROOM)
    long_prompt = forecast_ttft(TtftInputs(2000, 1000.0, 0.01, 0.0, 5000))
    assert long_prompt is not None and wait_until_met_s(long_prompt, 1.0) == pytest.approx(2.0)  # the queue
    assert meets(None, 0.001)  # no forecast: no refusal on a guess


def test_a_full_batch_adds_the_wait_for_a_seat_at_the_rate_its_steps_end_sequences() -> None:
    # 64 seats, all taken, 9 waiting: the new request is the 10th for a seat, at 20 freed a second.
    full = TtftInputs(1000, 10_000.0, 0.03, 0.01, 200, num_waiting=9, num_running=64, capacity=64)
    forecast = forecast_ttft(dataclasses.replace(full, seats_freed_per_s=20.0))
    assert forecast is not None
    assert forecast.seat_wait_s == pytest.approx(10 / 20)
    # The longer of the two waits, not their sum: the prompts ahead prefill as their seats free.
    assert forecast.total_s == pytest.approx(max(0.1, 0.5) + 0.02 + 0.03)
    assert not meets(forecast, 0.7) and meets(forecast, 1.0)
    # Seats to spare, or a capacity not known (an older replica), or no sequence ended yet: no seat wait.
    for inputs_ in (
        dataclasses.replace(full, num_running=50, seats_freed_per_s=20.0),
        dataclasses.replace(full, capacity=0, seats_freed_per_s=20.0),
        full,
    ):
        other = forecast_ttft(inputs_)
        assert other is not None and other.seat_wait_s == 0


def test_a_full_batch_whose_sequences_must_end_sooner_than_the_rate_says_waits_for_those_ends() -> None:
    # 4 seats, all taken, 1 waiting: the new request needs the 2nd seat to free. Its decoding sequences
    # must end within 1, 3 and 40 steps (their max_tokens): the 2nd seat is free 3 steps of 50 ms after
    # the last step ended, 20 ms ago, sooner than 2 seats at 1 a second.
    full = TtftInputs(
        0, 10_000.0, 0.05, 0.01, 100, num_waiting=1, num_running=4, capacity=4, seats_freed_per_s=1.0
    )
    ending = dataclasses.replace(full, latest_ends_in_steps=(1, 3, 40), since_step_s=0.02)
    forecast = forecast_ttft(ending)
    assert forecast is not None and forecast.seat_wait_s == pytest.approx(0.13)
    # Ends later than the rate says: the rate (EOS or a stop string may end them sooner).
    late = forecast_ttft(dataclasses.replace(ending, latest_ends_in_steps=(30, 60)))
    assert late is not None and late.seat_wait_s == pytest.approx(2.0)
    # Fewer ends listed than seats short: the rate; no rate yet: the ends alone, at least the last one.
    few = forecast_ttft(dataclasses.replace(ending, latest_ends_in_steps=(1,)))
    assert few is not None and few.seat_wait_s == pytest.approx(2.0)
    no_rate = dataclasses.replace(ending, seats_freed_per_s=0.0)
    assert forecast_ttft(no_rate).seat_wait_s == pytest.approx(0.13)  # type: ignore[union-attr]
    last = forecast_ttft(dataclasses.replace(no_rate, latest_ends_in_steps=(1,)))
    assert last is not None and last.seat_wait_s == pytest.approx(0.03)


def test_a_refused_request_waits_for_the_step_ends_that_drain_its_excess() -> None:
    # 0.7 s of prompts queued, its own 10 ms, a 50 ms step that began 10 ms ago: 0.76 s forecast.
    busy = TtftInputs(7000, 10_000.0, 0.05, 0.01, 100, num_running=8, since_step_s=0.01)
    forecast = forecast_ttft(busy)
    assert forecast is not None and forecast.total_s == pytest.approx(0.76)
    # 60 ms over the 0.7 s it must come within: the running step's end, 40 ms on, takes off 50 ms of it
    # (its work, begun before), the next one's, 50 ms later, the rest.
    assert wait_until_met_s(forecast, 1.0) == pytest.approx(0.04 + 0.05)
    # 5 ms over: met when the running step ends, not 5 ms on.
    assert wait_until_met_s(forecast, 0.755 / HEADROOM) == pytest.approx(0.04)
    # Not running a step: the excess itself, as it drains.
    idle = forecast_ttft(dataclasses.replace(busy, num_running=0))
    assert idle is not None and wait_until_met_s(idle, 1.0) == pytest.approx(0.76 - HEADROOM)


def _replica(
    replica_id: str,
    *,
    queued: int,
    rate: float = 10_000.0,
    is_ready: bool = True,
    step_s: float = 0.02,
    num_running: int = 4,
) -> ReplicaHandle:
    return ReplicaHandle(
        replica_id=replica_id,
        model_name="chat",
        version="v1",
        channel_name=f"switchyard.replica.{replica_id}",
        state="ready" if is_ready else "loading",
        load=0,
        kv_cache_usage=0.0,
        is_ready=is_ready,
        is_local=False,
        step_s=step_s,
        num_running=num_running,
        queued_prompt_tokens=queued,
        prefill_tokens_per_s=rate,
    )


def test_a_replica_forecast_to_miss_the_objective_is_skipped() -> None:
    candidates = [_replica("busy", queued=50_000), _replica("idle", queued=0), _replica("half", queued=1000)]
    # 5 s, 0.03 s and 0.13 s forecasts for a 100-token prompt, against 200 ms.
    assert replicas_to_skip(candidates, objective_ms=200, prompt_tokens=100) == {"busy"}
    assert replicas_to_skip(candidates, objective_ms=100, prompt_tokens=100) == {"busy", "half"}
    # One not ready, or with no forecast, is never the reason for a refusal.
    unknown = [_replica("busy", queued=50_000), _replica("new", queued=9_000, rate=0.0)]
    assert replicas_to_skip(unknown, objective_ms=100, prompt_tokens=100) == {"busy"}
    assert (
        replicas_to_skip([_replica("loading", queued=0, is_ready=False)], objective_ms=1, prompt_tokens=1)
        == set()
    )


def test_when_every_replica_is_forecast_to_miss_it_is_a_429_with_the_wait_until_the_best_would_meet_it() -> (
    None
):
    candidates = [
        _replica("a", queued=50_000),  # 5.03 s for a 100-token prompt
        # 3.03 s: meets 500 ms, with HEADROOM (a forecast within 350 ms), once 2.68 s of its queue has drained
        _replica("b", queued=30_000),
        _replica("gone", queued=0, is_ready=False),
    ]
    with pytest.raises(ObjectiveUnmet) as refused:
        replicas_to_skip(candidates, objective_ms=500, prompt_tokens=100)
    assert refused.value.status == 429
    assert refused.value.retry_after_s == pytest.approx(3.03 - 0.7 * 0.5)
    # Whole seconds, rounded up, and to the millisecond for clients that read it (the openai ones)
    assert refused.value.headers == {"Retry-After": "3", "retry-after-ms": "2680"}
    assert "500 ms" in refused.value.message and "3030 ms" in refused.value.message


def test_a_replica_whose_steps_are_slower_than_the_tpot_objective_is_skipped() -> None:
    candidates = [
        _replica("crowded", queued=0, step_s=0.050),
        _replica("brisk", queued=0, step_s=0.020),
        _replica("idle", queued=0, step_s=0.090, num_running=0),  # its last steps were a batch now gone
    ]
    assert replicas_to_skip(candidates, objective_ms=None, tpot_objective_ms=30, prompt_tokens=100) == {
        "crowded"
    }
    # Both objectives: a replica missing either is skipped.
    both = [_replica("slow-steps", queued=0, step_s=0.050), _replica("long-queue", queued=50_000)]
    with pytest.raises(ObjectiveUnmet) as refused:
        replicas_to_skip(both, objective_ms=500, tpot_objective_ms=30, prompt_tokens=100)
    # The TPOT miss would clear soonest (no figure says when; a beat or two), and the message names both.
    assert refused.value.retry_after_s == pytest.approx(1.0)
    assert "TPOT objective 30 ms, fastest step lately 50 ms" in refused.value.message
    assert "TTFT objective 500 ms" in refused.value.message


class _Runtime:
    """A data plane whose only part used here is candidates(): `replicas`, or a read that never ends."""

    def __init__(self, replicas: list[ReplicaHandle] | None) -> None:
        self.replicas = replicas
        self.reads = 0
        self.reading = asyncio.Event()

    async def candidates(self, model_name: str, version: str) -> list[ReplicaHandle]:
        self.reads += 1
        self.reading.set()
        if self.replicas is None:
            await asyncio.Event().wait()
        return self.replicas or []


@pytest.fixture
def memory_store():  # type: ignore[no-untyped-def]
    from serving.gateway.quota_memory import MemoryQuotaStore
    from serving.gateway.quota_store import reset_quota_store

    store = MemoryQuotaStore()
    reset_quota_store(store)
    yield store
    reset_quota_store()


def _hurried(**quota: object) -> TenantContext:
    return dataclasses.replace(
        TenantContext.unlimited("hurried"), tenant_id=7, ttft_objective_ms=100, **quota
    )


def _skip(runtime: _Runtime, context: TenantContext, ticket: Ticket | None, tier: str = "default"):  # type: ignore[no-untyped-def]
    return skipped_by_forecast(
        runtime,  # type: ignore[arg-type]
        context,
        model_name="chat",
        version="v1",
        submission={"input": "x" * 400, "messages": None},
        ticket=ticket,
        charge=Charge(context, 10),
        service_tier=tier,
    )


async def test_a_refusal_gives_back_what_admission_took(memory_store) -> None:  # type: ignore[no-untyped-def]
    context = _hurried()
    ticket = await memory_store.aadmit(context, tokens=10)
    with pytest.raises(ObjectiveUnmet):
        await _skip(_Runtime([_replica("busy", queued=50_000)]), context, ticket)
    assert memory_store.usage([context])[context.tenant_id].num_in_flight == 0
    assert slo_refusal_counts() == {("chat", "v1"): 1}


async def test_a_request_cancelled_while_the_replicas_are_read_gives_back_its_admission(memory_store) -> None:  # type: ignore[no-untyped-def]
    context = _hurried()
    ticket = await memory_store.aadmit(context, tokens=10)
    runtime = _Runtime(None)
    task = asyncio.create_task(_skip(runtime, context, ticket))
    await runtime.reading.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert memory_store.usage([context])[context.tenant_id].num_in_flight == 0


async def test_over_quota_is_still_the_answer_where_admission_was_to_go_with_the_send(memory_store) -> None:  # type: ignore[no-untyped-def]
    context = _hurried(requests_per_second=0.001)
    await memory_store.arelease(await memory_store.aadmit(context, tokens=10), used_tokens=0)  # its burst
    with pytest.raises(GatewayError) as refused:
        await _skip(_Runtime([_replica("busy", queued=50_000)]), context, None)
    assert refused.value.status == 429 and not isinstance(refused.value, ObjectiveUnmet)
    assert memory_store.usage([context])[context.tenant_id].num_in_flight == 0


async def test_a_tenant_without_an_objective_reads_no_forecast(memory_store) -> None:  # type: ignore[no-untyped-def]
    runtime = _Runtime([_replica("busy", queued=50_000)])
    context = dataclasses.replace(_hurried(), ttft_objective_ms=None)
    assert await _skip(runtime, context, None) == frozenset()
    assert runtime.reads == 0


async def test_a_flex_request_is_held_to_no_objective_and_a_priority_one_is(memory_store) -> None:  # type: ignore[no-untyped-def]
    runtime = _Runtime([_replica("busy", queued=50_000)])
    # Flex accepts a wait to be served at all: the replica's queue timeout bounds it, not a refusal.
    assert await _skip(runtime, _hurried(), None, tier="flex") == frozenset()
    assert runtime.reads == 0
    with pytest.raises(ObjectiveUnmet):
        await _skip(runtime, _hurried(), None, tier="priority")


async def test_a_tpot_objective_alone_is_admitted_by(memory_store) -> None:  # type: ignore[no-untyped-def]
    context = dataclasses.replace(_hurried(), ttft_objective_ms=None, tpot_objective_ms=30)
    runtime = _Runtime([_replica("slow", queued=0, step_s=0.05), _replica("quick", queued=0, step_s=0.01)])
    assert await _skip(runtime, context, None) == {"slow"}
