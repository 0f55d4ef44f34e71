"""A warning an outage would otherwise log once per request, logged once per interval instead."""

from __future__ import annotations

import math
import threading
import time


class Throttle:
    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._last = -math.inf
        self._lock = threading.Lock()  # the gateway's key lookups run on worker threads

    def is_due(self) -> bool:
        """True at most once per interval_s (the first call included)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                return False
            self._last = now
            return True
