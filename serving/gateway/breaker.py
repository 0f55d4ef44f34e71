"""A circuit breaker per replica, in each gateway process: after `failure_threshold` consecutive
failures (a refused or failed submission, a replica that died under a request), or at once when its
heartbeats stop (`trip`), the replica gets no traffic for `open_s`; then one trial request is let
through (half-open), and its outcome closes the breaker or opens it again.

Choosing a replica asks `allows` of every candidate and `claim`s only the one chosen, so a half-open
replica that was a candidate but not the choice still has its trial to come. The trial ends when the
replica accepts the request (`record_accepted(is_trial=True)`, closed) or fails it
(`record_failure(is_trial=True)`, open again); a trial that ends without a verdict (refused by quota
before it was sent, a full queue, a request-level error, a client gone before the acceptance) is
`release`d, and the next request is the trial. A claim nobody settles (a bug) stops counting after
`trial_timeout_s`. Only the trial closes an open breaker: a request sent before it opened that then
ends well, or is accepted late, says nothing of the replica now; one that fails keeps it open longer
but leaves a trial under way to its verdict.

Replica ids are new at every start, so the states of replicas that died would pile up for the gateway's
life: a state nothing has touched for `forget_after_s` is dropped (checked at most once a minute, when a
failure adds one). By then a dead replica's heartbeat is long gone from the directory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _State:
    num_failures: int = 0
    opened_at: float | None = None
    trial_started_at: float | None = None
    touched_at: float = 0.0  # its last failure, trip or claim


_PRUNE_EVERY_S = 60.0


class CircuitBreaker:
    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        open_s: float = 5.0,
        trial_timeout_s: float = 60.0,
        forget_after_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._failure_threshold = failure_threshold
        self._open_s = open_s
        self._trial_timeout_s = trial_timeout_s
        self._forget_after_s = forget_after_s
        self._clock = clock
        self._pruned_at = clock()
        self._states: dict[str, _State] = {}
        self._lock = threading.Lock()

    def allows(self, replica_id: str) -> bool:
        """Whether the replica may be chosen now: closed, or half-open with no trial running. Claims
        nothing; `claim` the replica chosen."""
        with self._lock:
            return self._allows(self._states.get(replica_id), self._clock())

    def claim(self, replica_id: str) -> bool:
        """For the replica chosen, just before a request goes to it: True if it may. While half-open,
        only the first claim is true, and that request is the trial."""
        with self._lock:
            state, now = self._states.get(replica_id), self._clock()
            if not self._allows(state, now):
                return False
            if state is not None and state.opened_at is not None:
                state.trial_started_at = state.touched_at = now
            return True

    def _allows(self, state: _State | None, now: float) -> bool:
        if state is None or state.opened_at is None:
            return True
        if now - state.opened_at < self._open_s:
            return False
        return state.trial_started_at is None or now - state.trial_started_at >= self._trial_timeout_s

    def release(self, replica_id: str) -> None:
        """A claimed trial ended without a verdict on the replica: the next request may be the trial."""
        with self._lock:
            state = self._states.get(replica_id)
            if state is not None:
                state.trial_started_at = None

    def record_accepted(self, replica_id: str, *, is_trial: bool = False) -> None:
        """The replica took a request: the trial's acceptance closes a half-open breaker. A closed one
        keeps its count, so that failures after acceptance (a replica that dies mid-stream) still add
        up."""
        with self._lock:
            state = self._states.get(replica_id)
            if is_trial and state is not None and state.opened_at is not None:
                del self._states[replica_id]

    def is_open(self, replica_id: str) -> bool:
        with self._lock:
            state = self._states.get(replica_id)
            return state is not None and state.opened_at is not None

    def record_success(self, replica_id: str) -> None:
        """A request ended well: a closed breaker's count starts again. An open one waits for its trial."""
        with self._lock:
            state = self._states.get(replica_id)
            if state is not None and state.opened_at is None:
                del self._states[replica_id]

    def trip(self, replica_id: str) -> None:
        """Open now, whatever the count: the replica's heartbeats stopped. A trial under way keeps its
        claim: its verdict comes, or the claim runs out."""
        with self._lock:
            state = self._touched(replica_id)
            state.opened_at = state.touched_at

    def record_failure(self, replica_id: str, *, is_trial: bool = False) -> None:
        with self._lock:
            state = self._touched(replica_id)
            state.num_failures += 1
            if is_trial:
                state.trial_started_at = None
            if state.opened_at is not None or state.num_failures >= self._failure_threshold:
                state.opened_at = state.touched_at

    def _touched(self, replica_id: str) -> _State:
        """Under the lock: the replica's state, created if need be, touched now."""
        now = self._clock()
        if now - self._pruned_at >= _PRUNE_EVERY_S:
            self._pruned_at = now
            for stale in [r for r, s in self._states.items() if now - s.touched_at >= self._forget_after_s]:
                del self._states[stale]
        state = self._states.setdefault(replica_id, _State())
        state.touched_at = now
        return state


breaker = CircuitBreaker()
