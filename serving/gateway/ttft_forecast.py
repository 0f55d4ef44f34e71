"""A new request's time to first token on one replica, forecast from that replica's last heartbeat.

TTFT = the prompt tokens queued ahead of it, prefilled at the replica's measured rate, + its own prompt
at the same rate + one step (the one running when it arrives, which it waits out). Pure functions over a
typed record, so that the gateway's admission (slo_admission.py) and the prediction-error metric read
the same figures. docs/architecture.md, "SLO-aware admission"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ReplicaFigures(Protocol):
    """What the forecast reads of a replica (a ReplicaHandle, from a heartbeat or a local replica)."""

    @property
    def queued_prompt_tokens(self) -> int: ...
    @property
    def prefill_tokens_per_s(self) -> float: ...
    @property
    def step_s(self) -> float: ...
    @property
    def base_step_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class TtftInputs:
    """A forecast's inputs: the replica's queue and speed, and the new request's prompt."""

    queued_prompt_tokens: int  # not yet prefilled, over its waiting and running sequences
    prefill_tokens_per_s: float  # 0: never measured
    step_s: float  # its steps' mean time lately; 0: none ran
    base_step_s: float  # a step with one sequence decoding; 0: not known
    prompt_tokens: int  # the new request's, as estimated before it is tokenised

    @classmethod
    def of(cls, replica: ReplicaFigures, *, prompt_tokens: int) -> TtftInputs:
        return cls(
            queued_prompt_tokens=replica.queued_prompt_tokens,
            prefill_tokens_per_s=replica.prefill_tokens_per_s,
            step_s=replica.step_s,
            base_step_s=replica.base_step_s,
            prompt_tokens=prompt_tokens,
        )


@dataclass(frozen=True, slots=True)
class TtftForecast:
    queue_wait_s: float  # prefilling what is queued ahead of it
    prefill_s: float  # its own prompt
    step_s: float  # the step it arrives during

    @property
    def total_s(self) -> float:
        return self.queue_wait_s + self.prefill_s + self.step_s


def forecast_ttft(inputs: TtftInputs) -> TtftForecast | None:
    """The forecast; None when the replica has never measured its prefill rate (an older replica, or
    one that has served nothing yet): no forecast rather than a guess."""
    rate = inputs.prefill_tokens_per_s
    if not rate > 0:  # 0, or a NaN
        return None
    step_s = inputs.step_s if inputs.step_s > 0 else max(inputs.base_step_s, 0.0)
    return TtftForecast(
        queue_wait_s=max(inputs.queued_prompt_tokens, 0) / rate,
        prefill_s=max(inputs.prompt_tokens, 0) / rate,
        step_s=step_s,
    )


def meets(forecast: TtftForecast | None, objective_s: float) -> bool:
    """Whether a request sent to the replica is predicted to meet its objective. One with nothing queued
    ahead of it does, whatever the forecast: no replica could serve it sooner, and a refusal would
    refuse it for ever. No forecast: taken to meet it (no refusal on a guess)."""
    return forecast is None or forecast.queue_wait_s == 0 or forecast.total_s <= objective_s


def wait_until_met_s(forecast: TtftForecast, objective_s: float) -> float:
    """How long until a request sent there would be predicted to meet the objective, were nothing more
    to arrive: until the queue ahead has drained by the excess, or wholly."""
    return max(0.0, min(forecast.total_s - objective_s, forecast.queue_wait_s))


def estimate_prompt_tokens(input_chars: int) -> int:
    """A prompt's tokens before it is tokenised: about 4 characters a token, as admission estimates."""
    return max(1, input_chars // 4)
