"""SLO-aware admission: a tenant with latency objectives is sent only to a replica forecast to meet
them, and refused at once, with a 429 and a Retry-After from the forecast, when none is; and every
generative request's first token is set against the forecast for its replica (the forecast's error, on
/metrics). docs/architecture.md, "SLO-aware admission".

The objectives are the tenant's quota's, for its `priority` and `default` requests. A `flex` request
has none: it is the tier that accepts a wait to be served at all, and the replica's queue timeout
bounds that wait (docs/architecture.md, "Service tiers")."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from registry.models import ServiceTier
from registry.selectors import TenantContext
from serving.gateway.breaker import breaker
from serving.gateway.data_plane import DataPlane, ReplicaHandle
from serving.gateway.errors import GatewayError
from serving.gateway.in_flight import InFlightRequest
from serving.gateway.prompt_size import prompt_chars
from serving.gateway.quota import Charge, Ticket
from serving.gateway.quota_store import quota_store
from serving.gateway.ttft_forecast import (
    TtftInputs,
    estimate_prompt_tokens,
    forecast_ttft,
    meets,
    wait_until_met_s,
)
from serving.telemetry.ttft_forecasts import count_slo_refusal, record_ttft_forecast

logger = logging.getLogger(__name__)

# The wait a refusal names when a replica misses only the TPOT objective: nothing in a heartbeat says
# when its batch will thin out, and a second is a beat or two, when the router sees it again.
TPOT_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class Objectives:
    """A request's latency objectives, in milliseconds; None: none of that kind."""

    ttft_ms: int | None
    tpot_ms: int | None


def objectives_for(context: TenantContext, service_tier: str) -> Objectives | None:
    """The objectives admission holds a request of `context`'s at `service_tier` to; None for a flex
    request or a tenant with none."""
    if service_tier == ServiceTier.FLEX.value:
        return None
    if context.ttft_objective_ms is None and context.tpot_objective_ms is None:
        return None
    return Objectives(ttft_ms=context.ttft_objective_ms, tpot_ms=context.tpot_objective_ms)


class ObjectiveUnmet(GatewayError):
    """No replica is forecast to meet the request's latency objectives: a 429, to retry after the wait
    until the best of them would."""

    def __init__(self, *, missed: str, wait_s: float) -> None:
        super().__init__(
            429,
            f"no replica is forecast to meet this key's latency objectives ({missed}): try again after "
            "Retry-After",
            retry_after_s=wait_s,
        )


def prompt_tokens_of(submission: dict[str, Any]) -> int:
    """A generative submission's prompt tokens, estimated before it is tokenised."""
    messages, tools = submission.get("messages") or (), submission.get("tools")
    return estimate_prompt_tokens(prompt_chars(text=submission.get("input"), messages=messages, tools=tools))


def misses_tpot(replica: ReplicaHandle, objective_s: float) -> bool:
    """Whether a request's tokens there would come slower than the TPOT objective: its steps lately
    took longer. One more sequence barely lengthens a step that is bound by reading the weights, so the
    recent mean is the forecast; a replica running nothing meets it (no faster one could exist)."""
    return replica.num_running > 0 and replica.step_s > objective_s


def replicas_to_skip(
    candidates: list[ReplicaHandle],
    *,
    objective_ms: int | None,
    prompt_tokens: int,
    tpot_objective_ms: int | None = None,
) -> frozenset[str]:
    """Of the replicas the router would consider (ready, past their circuit breaker), those forecast
    to miss the TTFT objective (`objective_ms`) or the TPOT one: the router chooses among the others
    as ever. Raises ObjectiveUnmet when that is every one of them. None to consider skips none:
    placing the request answers (a 503, a cold start)."""
    considered = [r for r in candidates if r.is_ready and breaker.allows(r.replica_id)]
    waits: dict[str, float] = {}  # a missing replica: how long until it would meet them
    best_ttft_s, best_step_s = math.inf, math.inf
    for replica in considered:
        wait_s = None
        if objective_ms is not None:
            forecast = forecast_ttft(TtftInputs.of(replica, prompt_tokens=prompt_tokens))
            if forecast is not None and not meets(forecast, objective_ms / 1000):
                wait_s = wait_until_met_s(forecast, objective_ms / 1000)
                best_ttft_s = min(best_ttft_s, forecast.total_s)
        if tpot_objective_ms is not None and misses_tpot(replica, tpot_objective_ms / 1000):
            wait_s = max(wait_s or 0.0, TPOT_RETRY_S)
            best_step_s = min(best_step_s, replica.step_s)
        if wait_s is not None:
            waits[replica.replica_id] = wait_s
    if considered and len(waits) == len(considered):
        missed = []
        if best_ttft_s < math.inf:
            missed.append(
                f"TTFT objective {objective_ms} ms, best forecast {math.ceil(best_ttft_s * 1000)} ms"
            )
        if best_step_s < math.inf:
            fastest_ms = math.ceil(best_step_s * 1000)
            missed.append(f"TPOT objective {tpot_objective_ms} ms, fastest step lately {fastest_ms} ms")
        raise ObjectiveUnmet(missed="; ".join(missed), wait_s=min(waits.values()))
    return frozenset(waits)


async def skipped_by_forecast(
    runtime: DataPlane,
    context: TenantContext,
    *,
    model_name: str,
    version: str,
    submission: dict[str, Any],
    ticket: Ticket | None,
    charge: Charge,
    service_tier: str = ServiceTier.DEFAULT.value,
) -> frozenset[str]:
    """replicas_to_skip for a request of `context`'s to a generative version; none for a request with
    no objectives (objectives_for). A refusal gives back what admission took (`ticket`), or, where
    admission was to go with the send (no ticket yet), asks the quota first: over quota is still the
    first answer."""
    objectives = objectives_for(context, service_tier)
    if objectives is None:
        return frozenset()
    try:
        try:
            candidates = await runtime.candidates(model_name, version)
        except Exception:  # the directory unreadable: placing the request reads it again, and says so
            return frozenset()
        return replicas_to_skip(
            candidates,
            objective_ms=objectives.ttft_ms,
            tpot_objective_ms=objectives.tpot_ms,
            prompt_tokens=prompt_tokens_of(submission),
        )
    except BaseException as exc:  # refused, or cancelled while the directory was read
        store = quota_store()
        if ticket is not None:
            await store.arelease(ticket, used_tokens=0)
        elif isinstance(exc, ObjectiveUnmet):
            over = await store.aadmit(charge.context, tokens=charge.tokens, room_for=charge.room_for)
            await store.arelease(over, used_tokens=0)
        if isinstance(exc, ObjectiveUnmet):
            count_slo_refusal(model_name, version)
        raise


class ForecastRequest(InFlightRequest):
    """A generative request whose first token's arrival is set against the TTFT forecast, made when it
    was routed, for the replica it went to (serving/telemetry/ttft_forecasts.py). A request retried on
    another replica is not: the forecast was for the first."""

    _routed_at: float | None = None

    async def submit(self, *, exclude: frozenset[str] = frozenset(), charge: Charge | None = None) -> None:
        if self._routed_at is None:  # not again for a retry
            self._routed_at = time.monotonic()
        await super().submit(exclude=exclude, charge=charge)

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        routed_at = self._routed_at
        async with contextlib.aclosing(super().events()) as events:
            async for event in events:
                if routed_at is not None and "token" in event:
                    self._record_first_token(time.monotonic() - routed_at)
                    routed_at = None
                yield event

    def _record_first_token(self, actual_s: float) -> None:
        if self.replica is None or self.num_retries:
            return
        forecast = forecast_ttft(
            TtftInputs.of(self.replica, prompt_tokens=prompt_tokens_of(self._submission))
        )
        if forecast is not None:
            record_ttft_forecast(
                self.model_name, self.version, forecast_s=forecast.total_s, actual_s=actual_s
            )
