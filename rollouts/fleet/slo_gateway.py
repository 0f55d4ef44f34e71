"""The simulated gateway's SLO-aware admission: at a request's arrival, each ready replica's time to first
token is forecast from what its heartbeat would carry (its prompt tokens not yet prefilled, its measured
prefill rate, its recent step time, its seats and how fast its steps free them); the router chooses among
those forecast to meet the request's TTFT objective, and when none is, the request is refused with a
Retry-After, the forecast wait until the best of them would. As serving/gateway/slo_admission.py's
replicas_to_skip does live (docs/architecture.md, "SLO-aware admission"), with the same pure functions.

Each refusal is also followed to the wait it avoided: the virtual time from the refusal until this gateway,
forecasting the same request again after any replica's step, would first have admitted it. So a Retry-After
can be set against what the simulation then did (docs/benchmarks.md, "SLO-aware admission in the
simulator")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

from serving.gateway.ttft_forecast import ReplicaFigures, TtftInputs, forecast_ttft, meets, wait_until_met_s

R = TypeVar("R", bound=ReplicaFigures)


@dataclass(slots=True)
class Refusal:
    request_id: str
    at_s: float
    prompt_tokens: int
    retry_after_s: float  # the forecast wait, as GatewayError carries it before it is rounded
    avoided_wait_s: float | None = None  # observed (see the module's docstring); None: not by the end

    @property
    def retry_after_header_s(self) -> int:
        """The wait as Retry-After tells it: whole seconds, at least 1 (GatewayError.retry_after)."""
        return max(1, math.ceil(self.retry_after_s))

    @property
    def retry_after_ms_header(self) -> int:
        """The wait as retry-after-ms tells it: milliseconds, at least 1 (GatewayError.retry_after_ms)."""
        return max(1, math.ceil(self.retry_after_s * 1000))


class SloAdmission:
    """Every request carries the same objective here: the fleet serves one tenant with one."""

    def __init__(self, *, objective_s: float) -> None:
        self.objective_s = objective_s
        self.refusals: list[Refusal] = []
        self._unresolved: list[Refusal] = []  # refusals whose avoided wait is not yet observed

    def admit(self, request_id: str, prompt_tokens: int, ready: list[R], now: float) -> list[R] | None:
        """Of the ready replicas, those forecast to meet the objective, for the router to choose among;
        None, with the refusal recorded, when there are some and none is."""
        forecasts = [(r, forecast_ttft(TtftInputs.of(r, prompt_tokens=prompt_tokens))) for r in ready]
        meeting = [r for r, f in forecasts if meets(f, self.objective_s)]
        if meeting or not ready:
            return meeting
        # Every one missed, so every one has a forecast (a replica with none is taken to meet it).
        wait_s = min(wait_until_met_s(f, self.objective_s) for _, f in forecasts if f is not None)
        refusal = Refusal(request_id, now, prompt_tokens, wait_s)
        self.refusals.append(refusal)
        self._unresolved.append(refusal)
        return None

    def observe(self, ready: list[ReplicaFigures], now: float) -> None:
        """After a step ended (the only time a queue drains): the refusals that would now be admitted
        have avoided the wait until now."""
        if not self._unresolved:
            return
        still = []
        for refusal in self._unresolved:
            if any(
                meets(forecast_ttft(TtftInputs.of(r, prompt_tokens=refusal.prompt_tokens)), self.objective_s)
                for r in ready
            ):
                refusal.avoided_wait_s = now - refusal.at_s
            else:
                still.append(refusal)
        self._unresolved = still
