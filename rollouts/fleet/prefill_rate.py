"""A simulated replica's prefill rate, measured as its heartbeat measures it live: the prompt tokens its
prefilling steps processed per second of their step time, over the steps of the last `window_s` up to the
newest of them; the last figure is kept while it prefills nothing, 0 until it first does. The gateway's
TTFT forecast reads it (docs/architecture.md, "SLO-aware admission").

The live measure is serving/replica/load_report.py's PrefillRate, on the replica side: the import rules
(docs/architecture.md, "Import rules") keep it out of rollouts' reach, and it reads a step's engine stats,
where the simulator has the step's scheduler output; so the same measure over plain numbers here."""

from __future__ import annotations

from collections import deque


class PrefillRate:
    def __init__(self, window_s: float) -> None:  # the heartbeat's step window: STEP_WINDOW_S
        self.window_s = window_s
        self.per_s = 0.0
        self._steps: deque[tuple[float, int, float]] = deque()  # (ended at, tokens, seconds)
        self._tokens = 0
        self._seconds = 0.0

    def add_step(self, ended_at: float, *, batched_tokens: int, scheduled_seqs: int, seconds: float) -> None:
        """A step that ended. One that ran more tokens than sequences prefilled: every sequence in it but
        one is taken to have decoded one token, and the rest of its tokens to be prompt (as live)."""
        if batched_tokens <= scheduled_seqs or seconds <= 0:
            return
        tokens = batched_tokens - scheduled_seqs + 1
        self._steps.append((ended_at, tokens, seconds))
        self._tokens += tokens
        self._seconds += seconds
        while self._steps[0][0] < ended_at - self.window_s:
            _, old_tokens, old_seconds = self._steps.popleft()
            self._tokens -= old_tokens
            self._seconds -= old_seconds
        self.per_s = self._tokens / self._seconds
