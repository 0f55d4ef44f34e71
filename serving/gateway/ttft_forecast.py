"""A new request's time to first token on one replica, forecast from that replica's last heartbeat.

TTFT = the wait to start, + its own prompt at the replica's measured prefill rate, + one step (the one
running when it arrives, which it waits out). The wait to start is the longer of two: prefilling the
prompt tokens queued ahead of it, and, when the batch is full, waiting for a seat: the sequences ahead of
it that a free seat would not take, at the rate the replica's steps have lately ended sequences, or by
when that many of its running sequences must have ended (their max_tokens), whichever is sooner. Pure
functions over a typed record, so that the gateway's admission (slo_admission.py), the prediction-error
metric and the fleet simulator (rollouts/fleet/slo_gateway.py) read the same figures.
docs/architecture.md, "SLO-aware admission"."""

from __future__ import annotations

import math
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
    @property
    def latest_ends_in_steps(self) -> tuple[int, ...]: ...
    @property
    def since_step_s(self) -> float: ...


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
    # The steps within which its decoding sequences end at the latest, ascending (the soonest few), and
    # the seconds since its last step ended: () and 0 where not known.
    latest_ends_in_steps: tuple[int, ...] = ()
    since_step_s: float = 0.0

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
            latest_ends_in_steps=replica.latest_ends_in_steps,
            since_step_s=replica.since_step_s,
        )

    @property
    def seats_short(self) -> int:
        """The seats that must free before the new request has one: those the sequences waiting ahead
        of it and it itself need, less those free now. 0 where the capacity is not known."""
        if self.capacity <= 0:
            return 0
        free = max(self.capacity - self.num_running, 0)
        return max(self.num_waiting + 1 - free, 0)

    def seat_wait_s(self, step_s: float) -> float:
        """Until a seat is the new request's: the seats short at the rate steps end sequences, or by when
        that many running sequences must have ended (the k-th soonest end: that many steps of `step_s`
        from when the last step ended), whichever is sooner. Neither known: 0, no seat wait rather than
        a guess, as for the prefill rate."""
        short = self.seats_short
        if not short:
            return 0.0
        waits = [short / self.seats_freed_per_s] if self.seats_freed_per_s > 0 else []
        ends = self.latest_ends_in_steps
        if ends and step_s > 0 and (short <= len(ends) or not waits):
            # Short of more seats than ends are listed, and no rate: at least until the last listed end
            # (the rest end later), so that a request further back is never forecast sooner.
            end = ends[min(short, len(ends)) - 1]
            waits.append(max(0.0, end * step_s - self.since_step_s))
        return min(waits, default=0.0)

    def step_left_s(self, step_s: float) -> float:
        """What is left of the step it is running (its queue drains only when one ends); 0 when idle."""
        if not self.num_running or step_s <= 0:
            return 0.0
        return max(0.0, step_s - self.since_step_s)


@dataclass(frozen=True, slots=True)
class TtftForecast:
    queue_wait_s: float  # prefilling what is queued ahead of it
    prefill_s: float  # its own prompt
    step_s: float  # the step it arrives during
    seat_wait_s: float = 0.0  # for a seat in a full batch
    step_left_s: float = 0.0  # of the step running when it arrives: no queue drains before it ends

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
    return TtftForecast(
        queue_wait_s=max(inputs.queued_prompt_tokens, 0) / rate,
        prefill_s=max(inputs.prompt_tokens, 0) / rate,
        step_s=step_s,
        seat_wait_s=inputs.seat_wait_s(step_s),
        step_left_s=inputs.step_left_s(step_s),
    )


def meets(forecast: TtftForecast | None, objective_s: float) -> bool:
    """Whether a request sent to the replica is predicted to meet its objective, with HEADROOM to
    spare. One with nothing ahead
    of it does, whatever the forecast: no replica could serve it sooner, and a refusal would refuse it
    for ever. No forecast: taken to meet it (no refusal on a guess)."""
    return forecast is None or forecast.wait_s == 0 or forecast.total_s <= objective_s * HEADROOM


def wait_until_met_s(forecast: TtftForecast, objective_s: float) -> float:
    """How long until a request sent there would be predicted to meet the objective, were nothing more
    to arrive: until what is ahead of it has shrunk by the excess, or wholly. What is ahead shrinks only
    when a step ends, and then by a whole step's work (the running step's began before the forecast
    was made): so the first step end at which the steps ended make up the excess, the running step's
    first and one step_s apart after it. A replica that is not running a step: the excess itself."""
    excess = min(forecast.total_s - objective_s * HEADROOM, forecast.wait_s)
    if excess <= 0:
        return 0.0
    if forecast.step_s <= 0 or not forecast.step_left_s:
        return excess
    return forecast.step_left_s + (math.ceil(excess / forecast.step_s) - 1) * forecast.step_s


def estimate_prompt_tokens(input_chars: int) -> int:
    """A prompt's tokens before it is tokenised: about 4 characters a token, as admission estimates."""
    return max(1, input_chars // 4)
