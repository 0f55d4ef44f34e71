"""Failed sign-ins, counted, and refused for a while once there are too many: API keys (the data plane and
the control plane's API) per client address and per key prefix, the staff login per client address and
per user name. A refusal is a 429 with Retry-After, and it holds even for the right key or password: an
attacker who guesses right after the limit learns nothing from the answer.

A sliding window per key of the attempt (`addr:<ip>`, `key:<prefix>`, `user:<name>`): more than
AUTH_FAILURE_LIMIT failures within AUTH_FAILURE_WINDOW_S refuse the next attempts until the oldest of
them leaves the window. Decided from each process's memory, so an attempt costs nothing more; with Redis
(REDIS_URL) each failure is also counted there, and the process takes back the fleet's count
(registry/shared_failures.py): a fleet of N gateways lets through the limit plus at most one attempt
each, not N times the limit."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from django.conf import settings

from registry.models import ApiKey
from registry.shared_failures import SharedFailures

# The most keys counted at once: past it the counts start again (an attacker spraying addresses cannot
# grow this without bound; the limit per key is what protects a key).
MAX_TRACKED = 100_000


class FailureThrottle:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: dict[str, deque[float]] = {}
        self._shared: tuple[str, SharedFailures] | None = None  # (its REDIS_URL, the counts there)

    def retry_after_s(self, keys: tuple[str, ...]) -> float | None:
        """Seconds until an attempt under these keys is let through again; None: it is now."""
        limit, window_s = settings.AUTH_FAILURE_LIMIT, settings.AUTH_FAILURE_WINDOW_S
        now = self._clock()
        wait = 0.0
        with self._lock:
            for key in keys:
                times = self._failures.get(key)
                if times is None:
                    continue
                while times and now - times[0] >= window_s:
                    times.popleft()
                if len(times) >= limit:
                    wait = max(wait, window_s - (now - times[-limit]))
        return wait if wait > 0 else None

    def record(self, keys: tuple[str, ...]) -> None:
        limit = max(1, settings.AUTH_FAILURE_LIMIT)
        shared = self._shared_failures()
        window_s = settings.AUTH_FAILURE_WINDOW_S
        fleet = None if shared is None else shared.record(keys, window_s=window_s, limit=limit)
        now = self._clock()
        with self._lock:
            if len(self._failures) > MAX_TRACKED:
                self._failures.clear()
            for key in keys:
                if fleet is not None:  # the fleet's failures, this one among them
                    self._failures[key] = deque(fleet[key], maxlen=limit)
                else:
                    self._failures.setdefault(key, deque(maxlen=limit)).append(now)

    def _shared_failures(self) -> SharedFailures | None:
        url = settings.REDIS_URL
        if not url:
            return None
        if self._shared is None or self._shared[0] != url:
            self._shared = (url, SharedFailures(url, clock=self._clock))
        return self._shared[1]

    def clear(self) -> None:
        """Forget every failure, the fleet's too."""
        with self._lock:
            self._failures.clear()
        shared = self._shared_failures()
        if shared is not None:
            shared.clear()


def api_key_attempt(client: str | None, token: str | None) -> tuple[str, ...]:
    """The keys an API-key attempt counts under: its client's address, and the key's printed prefix
    (all a guesser keeps constant when it tries many keys of one tenant)."""
    keys = []
    if client:
        keys.append(f"addr:{client}")
    if token:
        keys.append(f"key:{token[: ApiKey.PREFIX_LENGTH]}")
    return tuple(keys)


def login_attempt(client: str | None, username: str | None) -> tuple[str, ...]:
    keys = []
    if client:
        keys.append(f"addr:{client}")
    if username:
        keys.append(f"user:{username.lower()}")
    return tuple(keys)


api_key_failures = FailureThrottle()
login_failures = FailureThrottle()
