"""What a replica reports of its load in its heartbeat: its engine's queue, batch and KV-cache use, its
capacity, the recent steps' time and a step's fixed cost, and the prompt tokens queued ahead of a new
request with the rate its steps prefill them (the gateway's TTFT forecast). The model thread writes it
after each step; the event loop reads it to beat. Each figure is one int or float replaced whole, so a
beat reads no torn value (it may read one step's queue with the previous step's batch, which a beat a
second later mends)."""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

from registry.models import Model
from registry.selectors import VersionRef
from serving.transport.replica_directory import SEAT_ENDS_REPORTED, Heartbeat, RecentSteps
from serving.transport.step_rate import StepRate, prefilled_tokens

# Steps of one decoding sequence it takes before their median, not the warm-up's, is a step's base.
MIN_BASE_SAMPLES = 8


class LoadReport:
    def __init__(self) -> None:
        self.num_waiting = 0
        self.num_running = 0
        self.kv_cache_usage = 0.0
        self.capacity = 0  # set once the engine is built
        self.base_step_s = 0.0  # a step with one sequence decoding, set once the engine is warm
        self.recent_steps = RecentSteps()
        self.queued_prompt_tokens = 0  # not yet prefilled, over the waiting and running sequences
        self.prefill_rate = StepRate()  # prompt tokens, over the steps that prefilled
        self.seat_rate = StepRate()  # sequences ended, over every step: seats freed
        # The steps within which its decoding sequences end at the latest, and when its last step ended
        # (monotonic; 0: none has): the forecast's bound on a seat wait (Heartbeat.latest_ends_in_steps).
        self.latest_ends_in_steps: tuple[int, ...] = ()
        self.last_step_ended_at = 0.0
        self.num_adapters = (
            0  # LoRA adapters resident in the engine (docs/architecture.md, "Adapters on a shared base")
        )
        self._one_sequence_steps: deque[float] = deque(maxlen=64)  # the model thread's

    def account(self, stats: Any, model_time_s: float | None, *, engine: Any = None, ended: int = 0) -> None:
        """A step's engine stats (Engine.stats()), and its model time when a forward pass ran. `engine`:
        the engine itself, for its queued prompt tokens (an encoder's, which has none, reads as 0);
        `ended`: the requests the step ended, whose seats it freed."""
        self.num_waiting, self.num_running, self.kv_cache_usage = (
            stats.num_waiting,
            stats.num_running,
            stats.kv_cache_usage,
        )
        self.num_adapters = len(getattr(stats, "adapters_resident", ()))  # an encoder's: none
        queued = getattr(engine, "queued_prompt_tokens", None)
        self.queued_prompt_tokens = int(queued()) if queued is not None else 0
        ends = getattr(engine, "latest_ends_in_steps", None)
        self.latest_ends_in_steps = ends(SEAT_ENDS_REPORTED) if ends is not None else ()
        if model_time_s is None:
            return
        self.last_step_ended_at = ended_at = time.monotonic()
        self.recent_steps.add(ended_at, model_time_s)
        if prefilled := prefilled_tokens(stats.num_batched_tokens, stats.num_scheduled_seqs):
            self.prefill_rate.add(ended_at, prefilled, model_time_s)
        self.seat_rate.add(ended_at, ended, model_time_s)
        if stats.num_scheduled_seqs == 1 and stats.num_batched_tokens == 1:
            # One sequence decoding: what the warm-up timed, here without the warm-up's company (the
            # replicas of an embedded server warm up together) and with all of the step's own work. The
            # median of the latest, so that neither one lucky step nor one slow one sets it.
            self._one_sequence_steps.append(model_time_s)
            if len(self._one_sequence_steps) >= MIN_BASE_SAMPLES:
                self.base_step_s = statistics.median(self._one_sequence_steps)

    def heartbeat(
        self,
        ref: VersionRef,
        replica_id: str,
        channel_name: str,
        state: str,
        *,
        num_pending: int,
        idle_s: float,
    ) -> Heartbeat:
        """The replica's beat: this report, with what the replica knows of itself. `num_pending`: its
        arrivals not yet handed to the engine, which wait too."""
        steps = self.recent_steps.read(time.monotonic())
        return Heartbeat(
            replica_id=replica_id,
            model_name=ref.model_name,
            version=ref.version,
            channel_name=channel_name,
            state=str(state),
            num_waiting=self.num_waiting + num_pending,
            num_running=self.num_running,
            kv_cache_usage=self.kv_cache_usage,
            sent_at=time.time(),
            capacity=self.capacity,
            is_generative=ref.kind == Model.Kind.CAUSAL_LM,
            idle_s=idle_s,
            step_s=steps.mean_s,
            step_rate=steps.per_s,
            base_step_s=self.base_step_s,
            queued_prompt_tokens=self.queued_prompt_tokens,
            prefill_tokens_per_s=self.prefill_rate.per_s,
            seats_freed_per_s=self.seat_rate.per_s,
            num_adapters=self.num_adapters,
            latest_ends_in_steps=self.latest_ends_in_steps,
            since_step_s=self.since_step_s(),
        )

    def since_step_s(self) -> float:
        """Seconds since its last step ended; 0 before the first."""
        return time.monotonic() - self.last_step_ended_at if self.last_step_ended_at else 0.0
