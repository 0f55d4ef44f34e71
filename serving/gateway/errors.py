"""The gateway's refusals: an HTTP status, a message for the client and, where a wait helps, Retry-After
(whole seconds, as HTTP has it) with retry-after-ms beside it (the same wait to the millisecond, which
the `openai` clients read first): a forecast wait of 40 ms told as "1" would hold a client back 25
times too long (docs/api.md, "Conventions")."""

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
    def retry_after_ms(self) -> int | None:
        """The same wait in milliseconds, rounded up, at least 1. None: no wait given."""
        if self.retry_after_s is None:
            return None
        return max(1, math.ceil(self.retry_after_s * 1000))

    @property
    def headers(self) -> dict[str, str]:
        retry_after, retry_after_ms = self.retry_after, self.retry_after_ms
        if retry_after is None or retry_after_ms is None:
            return dict(self.served_by)
        return {**self.served_by, "Retry-After": str(retry_after), "retry-after-ms": str(retry_after_ms)}


class MaybeSent(GatewayError):
    """A submission that failed in a way that leaves it unknown whether the request reached its
    replica's channel (the connection dropped mid-send): the caller aborts it there, a no-op if not."""
