"""The gateway's refusals: an HTTP status, a message for the client and, where a wait helps, Retry-After."""

from __future__ import annotations

import math


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after_s: float | None = None,
        served_by: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        # A refusal by a replica (a prompt too long for its version's model): the response's headers
        # that say which version and replica refused it (InFlightRequest.response_headers), as a served
        # response's do.
        self.served_by = served_by or {}

    @property
    def retry_after(self) -> int | None:
        """The wait as a client is told it, in whole seconds (Retry-After over HTTP, `retry_after` in a
        WebSocket error message): rounded up, at least 1. None: no wait given."""
        if self.retry_after_s is None:
            return None
        return max(1, math.ceil(self.retry_after_s))

    @property
    def headers(self) -> dict[str, str]:
        retry_after = self.retry_after
        if retry_after is None:
            return dict(self.served_by)
        return {**self.served_by, "Retry-After": str(retry_after)}


class MaybeSent(GatewayError):
    """A submission that failed in a way that leaves it unknown whether the request reached its
    replica's channel (the connection dropped mid-send): the caller aborts it there, a no-op if not."""
