"""A new request's time to first token on one replica, forecast from that replica's last heartbeat.

TTFT = the wait to start, + its own prompt at the replica's measured prefill rate, + one step (the one
running when it arrives, which it waits out). The wait to start is the longer of two: prefilling the
prompt tokens queued ahead of it, and, when the batch is full, waiting for a seat: the sequences ahead of
it that a free seat would not take, at the rate the replica's steps have lately ended sequences. Pure
functions over a typed record, so that the gateway's admission (slo_admission.py), the prediction-error
metric and the fleet simulator (rollouts/fleet/slo_gateway.py) read the same figures.
docs/architecture.md, "SLO-aware admission"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# The share of an objective a forecast must come within. A forecast is a mean: the seats a full batch
# frees in the next second, say, vary about it, so requests forecast just under the objective miss it
# about half the time. Aiming a fifth under it sends them to a replica with room to spare instead
# (docs/benchmarks.md, "SLO-aware admission in the simulator").
HEADROOM = 0.7


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
    @property
    def queue_depth(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def seats_freed_per_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class TtftInputs:
    """A forecast's inputs: the replica's queue and speed, and the new request's prompt."""

    queued_prompt_tokens: int  # not yet prefilled, over its waiting and running sequences
    prefill_tokens_per_s: float  # 0: never measured
    step_s: float  # its steps' mean time lately; 0: none ran
    base_step_s: float  # a step with one sequence decoding; 0: not known
    prompt_tokens: int  # the new request's, as estimated before it is tokenised
    num_waiting: int = 0  # sequences waiting for a seat
    num_running: int = 0
    capacity: int = 0  # seats: the most sequences it runs at once; 0: not known
    seats_freed_per_s: float = 0.0  # sequences its steps end a second; 0: not known

    @classmethod
    def of(cls, replica: ReplicaFigures, *, prompt_tokens: int) -> TtftInputs:
        return cls(
            queued_prompt_tokens=replica.queued_prompt_tokens,
            prefill_tokens_per_s=replica.prefill_tokens_per_s,
            step_s=replica.step_s,
            base_step_s=replica.base_step_s,
            prompt_tokens=prompt_tokens,
            num_waiting=replica.queue_depth,
            num_running=replica.num_running,
            capacity=replica.capacity,
            seats_freed_per_s=replica.seats_freed_per_s,
        )

    @property
    def seats_short(self) -> int:
        """The seats that must free before the new request has one: those the sequences waiting ahead
        of it and it itself need, less those free now. 0 where the capacity is not known."""
        if self.capacity <= 0:
            return 0
        free = max(self.capacity - self.num_running, 0)
        return max(self.num_waiting + 1 - free, 0)


@dataclass(frozen=True, slots=True)
class TtftForecast:
    queue_wait_s: float  # prefilling what is queued ahead of it
    prefill_s: float  # its own prompt
    step_s: float  # the step it arrives during
    seat_wait_s: float = 0.0  # for a seat in a full batch

    @property
    def wait_s(self) -> float:
        """Before its prompt starts: the sequences ahead prefill as seats free, so the longer of the two."""
        return max(self.queue_wait_s, self.seat_wait_s)

    @property
    def total_s(self) -> float:
        return self.wait_s + self.prefill_s + self.step_s


def forecast_ttft(inputs: TtftInputs) -> TtftForecast | None:
    """The forecast; None when the replica has never measured its prefill rate (an older replica, or
    one that has served nothing yet): no forecast rather than a guess."""
    rate = inputs.prefill_tokens_per_s
    if not rate > 0:  # 0, or a NaN
        return None
    step_s = inputs.step_s if inputs.step_s > 0 else max(inputs.base_step_s, 0.0)
    seats_short, seat_rate = inputs.seats_short, inputs.seats_freed_per_s
    return TtftForecast(
        queue_wait_s=max(inputs.queued_prompt_tokens, 0) / rate,
        prefill_s=max(inputs.prompt_tokens, 0) / rate,
        step_s=step_s,
        # A full batch whose steps have ended nothing yet gives no rate to wait at: no seat wait rather
        # than a guess, as for the prefill rate.
        seat_wait_s=seats_short / seat_rate if seats_short and seat_rate > 0 else 0.0,
    )


def meets(forecast: TtftForecast | None, objective_s: float) -> bool:
    """Whether a request sent to the replica is predicted to meet its objective, with HEADROOM to
    spare. One with nothing ahead
    of it does, whatever the forecast: no replica could serve it sooner, and a refusal would refuse it
    for ever. No forecast: taken to meet it (no refusal on a guess)."""
    return forecast is None or forecast.wait_s == 0 or forecast.total_s <= objective_s * HEADROOM


def wait_until_met_s(forecast: TtftForecast, objective_s: float) -> float:
    """How long until a request sent there would be predicted to meet the objective, were nothing more
    to arrive: until what is ahead of it has shrunk by the excess, or wholly."""
    return max(0.0, min(forecast.total_s - objective_s * HEADROOM, forecast.wait_s))


def estimate_prompt_tokens(input_chars: int) -> int:
    """A prompt's tokens before it is tokenised: about 4 characters a token, as admission estimates."""
    return max(1, input_chars // 4)
