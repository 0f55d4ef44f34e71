"""SLO-aware admission: a tenant with a TTFT objective is sent only to a replica forecast to meet it
(ttft_forecast.py), and refused at once, with a 429 and a Retry-After from the forecast, when none is;
and every generative request's first token is set against the forecast for its replica (the forecast's
error, on /metrics). docs/architecture.md, "SLO-aware admission"."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator
from typing import Any

from registry.selectors import TenantContext
from serving.gateway.breaker import breaker
from serving.gateway.data_plane import DataPlane, ReplicaHandle
from serving.gateway.errors import GatewayError
from serving.gateway.in_flight import InFlightRequest
from serving.gateway.quota import Charge, Ticket
from serving.gateway.quota_store import quota_store
from serving.gateway.ttft_forecast import (
    TtftForecast,
    TtftInputs,
    estimate_prompt_tokens,
    forecast_ttft,
    meets,
    wait_until_met_s,
)
from serving.telemetry.ttft_forecasts import count_slo_refusal, record_ttft_forecast

logger = logging.getLogger(__name__)


class ObjectiveUnmet(GatewayError):
    """No replica is forecast to meet the tenant's TTFT objective: a 429, to retry after the wait
    until the best of them would."""

    def __init__(self, *, objective_ms: int, best: TtftForecast, wait_s: float) -> None:
        super().__init__(
            429,
            f"no replica is forecast to serve the first token within the TTFT objective of "
            f"{objective_ms} ms (best forecast {math.ceil(best.total_s * 1000)} ms): try again after "
            "Retry-After",
            retry_after_s=wait_s,
        )


def prompt_tokens_of(submission: dict[str, Any]) -> int:
    """A generative submission's prompt tokens, estimated before it is tokenised."""
    if submission.get("input") is not None:
        return estimate_prompt_tokens(len(submission["input"]))
    return estimate_prompt_tokens(sum(len(m["content"]) for m in submission.get("messages") or ()))


def replicas_to_skip(
    candidates: list[ReplicaHandle], *, objective_ms: int, prompt_tokens: int
) -> frozenset[str]:
    """Of the replicas the router would consider (ready, past their circuit breaker), those forecast
    to miss the objective: the router chooses among the others as ever. Raises ObjectiveUnmet when that
    is every one of them. None to consider skips none: placing the request answers (a 503, a cold start)."""
    objective_s = objective_ms / 1000
    considered = [r for r in candidates if r.is_ready and breaker.allows(r.replica_id)]
    forecasts = {
        r.replica_id: forecast_ttft(TtftInputs.of(r, prompt_tokens=prompt_tokens)) for r in considered
    }
    missing = {
        replica_id: f for replica_id, f in forecasts.items() if f is not None and not meets(f, objective_s)
    }
    if considered and len(missing) == len(considered):
        best = min(missing.values(), key=lambda f: f.total_s)
        wait_s = min(wait_until_met_s(f, objective_s) for f in missing.values())
        raise ObjectiveUnmet(objective_ms=objective_ms, best=best, wait_s=wait_s)
    return frozenset(missing)


async def skipped_by_forecast(
    runtime: DataPlane,
    context: TenantContext,
    *,
    model_name: str,
    version: str,
    submission: dict[str, Any],
    ticket: Ticket | None,
    charge: Charge,
) -> frozenset[str]:
    """replicas_to_skip for a request of `context`'s to a generative version; none for a tenant with no
    TTFT objective. A refusal gives back what admission took (`ticket`), or, where admission was to go
    with the send (no ticket yet), asks the quota first: over quota is still the first answer."""
    if context.ttft_objective_ms is None:
        return frozenset()
    try:
        try:
            candidates = await runtime.candidates(model_name, version)
        except Exception:  # the directory unreadable: placing the request reads it again, and says so
            return frozenset()
        return replicas_to_skip(
            candidates, objective_ms=context.ttft_objective_ms, prompt_tokens=prompt_tokens_of(submission)
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
