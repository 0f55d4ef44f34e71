"""The replica's queue timeout (docs/architecture.md, "Service tiers"): a request that waited past
REPLICA_QUEUE_TIMEOUT_S for a first seat ends with `queue_timeout` (a 503 with Retry-After to a client that
is not streaming), rather than waiting on in silence until its client gives up. The model thread asks
between steps, twice a second or five times per timeout if that is shorter, so a request ends at most a
fifth past its timeout."""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings

from serving.replica.step_result import Route, StepResult, error_sample
from serving.telemetry.recorder import RequestSample
from serving.transport.protocol import QUEUE_TIMEOUT, error_event

CHECK_EVERY_S = 0.5


class QueueTimeout:
    def __init__(self) -> None:
        self._next_check = 0.0

    def expire(
        self, engine: Any, routes: dict[str, Route], result: StepResult, ended: list[RequestSample]
    ) -> None:
        """End the engine's requests that waited too long: each one's error event into `result`, its
        route dropped, its sample into `ended`."""
        timeout_s, now = settings.REPLICA_QUEUE_TIMEOUT_S, time.monotonic()
        if not timeout_s or now < self._next_check:
            return
        self._next_check = now + min(CHECK_EVERY_S, timeout_s / 5)
        for request_id in engine.expire_waiting(timeout_s):
            route = routes.pop(request_id, None)
            if route is not None:
                message = f"it waited over {timeout_s:g} s in the replica's queue for a seat; try again later"
                result.add(route, request_id, error_event(QUEUE_TIMEOUT, message))
                ended.append(error_sample(QUEUE_TIMEOUT, route))
