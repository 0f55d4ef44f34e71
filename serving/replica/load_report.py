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
from serving.transport.replica_directory import STEP_WINDOW_S, Heartbeat, RecentSteps

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
        self.prefill_rate = PrefillRate()
        self._one_sequence_steps: deque[float] = deque(maxlen=64)  # the model thread's

    def account(self, stats: Any, model_time_s: float | None, *, engine: Any = None) -> None:
        """A step's engine stats (Engine.stats()), and its model time when a forward pass ran. `engine`:
        the engine itself, for its queued prompt tokens (an encoder's, which has none, reads as 0)."""
        self.num_waiting, self.num_running, self.kv_cache_usage = (
            stats.num_waiting,
            stats.num_running,
            stats.kv_cache_usage,
        )
        queued = getattr(engine, "queued_prompt_tokens", None)
        self.queued_prompt_tokens = int(queued()) if queued is not None else 0
        if model_time_s is None:
            return
        ended_at = time.monotonic()
        self.recent_steps.add(ended_at, model_time_s)
        # A step that ran more tokens than sequences prefilled. Every sequence in it but one is taken to
        # have decoded one token, and the rest of its tokens to be prompt.
        if stats.num_batched_tokens > stats.num_scheduled_seqs:
            prefilled = stats.num_batched_tokens - stats.num_scheduled_seqs + 1
            self.prefill_rate.add(ended_at, prefilled, model_time_s)
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
        )


class PrefillRate:
    """The prompt tokens prefilled a second of model time by the steps that prefilled, over the
    `window_s` up to the newest of them: step_s's window. A replica that has prefilled nothing since
    keeps its last figure (how fast it prefills hardly changes while it idles); 0 until it first
    prefills. The model thread adds; a reader reads `per_s`, one float replaced whole."""

    def __init__(self, window_s: float = STEP_WINDOW_S) -> None:
        self.window_s = window_s
        self.per_s = 0.0
        self._steps: deque[tuple[float, int, float]] = deque()  # (ended at, tokens, seconds)
        self._tokens = 0
        self._seconds = 0.0

    def add(self, ended_at: float, tokens: int, seconds: float) -> None:
        self._steps.append((ended_at, tokens, seconds))
        self._tokens += tokens
        self._seconds += seconds
        while self._steps[0][0] < ended_at - self.window_s:
            _, old_tokens, old_seconds = self._steps.popleft()
            self._tokens -= old_tokens
            self._seconds -= old_seconds
        if self._seconds > 0:
            self.per_s = self._tokens / self._seconds
