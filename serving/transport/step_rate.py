"""A replica's rates per second of step time, as its heartbeat reports them for the gateway's TTFT
forecast (docs/architecture.md, "SLO-aware admission"): the prompt tokens its prefilling steps prefill,
and the sequences its steps end (the seats they free). Here, beside the heartbeat, because both the live
replica (serving/replica/load_report.py) and the fleet simulator (rollouts/fleet/simulator.py) measure
them, one from an engine's stats and one from its scheduler's output: one measure, over plain numbers."""

from __future__ import annotations

from collections import deque

from serving.transport.replica_directory import STEP_WINDOW_S


def prefilled_tokens(batched_tokens: int, scheduled_seqs: int) -> int:
    """A step's prompt tokens, from its counts alone: 0 unless it ran more tokens than sequences. When it
    did, every sequence in it but one is taken to have decoded one token, and the rest of its tokens to
    be prompt (a step's stats do not split them)."""
    if batched_tokens <= scheduled_seqs:
        return 0
    return batched_tokens - scheduled_seqs + 1


class StepRate:
    """An amount per second of step time, over the steps added that ended within `window_s` of the
    newest of them: STEP_WINDOW_S, step_s's window. The caller chooses the steps: only those that
    prefilled, for a prefill rate (how fast it prefills when it does); every one, for the sequences
    ended (how fast seats free while it runs). While none is added, the last figure stands (neither
    hardly changes while a replica idles); 0 until the first. The model thread adds; a reader reads
    `per_s`, one float replaced whole."""

    def __init__(self, window_s: float = STEP_WINDOW_S) -> None:
        self.window_s = window_s
        self.per_s = 0.0
        self._steps: deque[tuple[float, int, float]] = deque()  # (ended at, amount, seconds)
        self._amount = 0
        self._seconds = 0.0

    def add(self, ended_at: float, amount: int, seconds: float) -> None:
        """A step that ended at `ended_at` after `seconds`, having done `amount`."""
        if seconds <= 0:
            return
        self._steps.append((ended_at, amount, seconds))
        self._amount += amount
        self._seconds += seconds
        while self._steps[0][0] < ended_at - self.window_s:
            _, old_amount, old_seconds = self._steps.popleft()
            self._amount -= old_amount
            self._seconds -= old_seconds
        self.per_s = self._amount / self._seconds
