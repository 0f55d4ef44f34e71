"""A circuit breaker per replica, in each gateway process: after `failure_threshold` consecutive
failures (a refused or failed submission, a replica that died under a request) the replica gets no
traffic for `open_s`; then one trial request is let through (half-open), and its outcome closes the
breaker or opens it again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _State:
    num_failures: int = 0
    opened_at: float | None = None
    is_trial_in_flight: bool = False


class CircuitBreaker:
    def __init__(
        self, *, failure_threshold: int = 3, open_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._failure_threshold = failure_threshold
        self._open_s = open_s
        self._clock = clock
        self._states: dict[str, _State] = {}
        self._lock = threading.Lock()

    def allows(self, replica_id: str) -> bool:
        with self._lock:
            state = self._states.get(replica_id)
            if state is None or state.opened_at is None:
                return True
            if self._clock() - state.opened_at < self._open_s or state.is_trial_in_flight:
                return False
            state.is_trial_in_flight = True  # half-open: this caller is the one trial
            return True

    def is_open(self, replica_id: str) -> bool:
        with self._lock:
            state = self._states.get(replica_id)
            return state is not None and state.opened_at is not None

    def record_success(self, replica_id: str) -> None:
        with self._lock:
            self._states.pop(replica_id, None)

    def record_failure(self, replica_id: str) -> None:
        with self._lock:
            state = self._states.setdefault(replica_id, _State())
            state.num_failures += 1
            state.is_trial_in_flight = False
            if state.opened_at is not None or state.num_failures >= self._failure_threshold:
                state.opened_at = self._clock()


breaker = CircuitBreaker()
