"""Quota admission's rules: a tenant's limits and usage, the charge a request is admitted with, and the
refusal (a 429 with the longest Retry-After among the limits that bind, or a 400 when no wait would do).

Quota state is a token bucket for requests/s, one for tokens/min and the requests in flight per tenant
(by ticket id; in Redis, leases that expire if never released). The stores (quota_memory.py,
quota_redis.py) keep the state; quota_store.py picks the process's one."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from django.conf import settings

from registry.selectors import TenantContext
from serving.gateway.errors import GatewayError
from serving.gateway.prompt_size import prompt_chars
from serving.transport.protocol import max_tokens_for


@dataclass(frozen=True, slots=True)
class Ticket:
    """One admitted request; release it exactly once when the request ends."""

    ticket_id: str
    tenant_id: int
    charged_tokens: int
    # The tenant's tokens/min at admission: the Redis store's release needs it to keep a tenant's hash
    # until a debt is paid back (serving/gateway/quota_redis.py).
    tokens_per_minute: float = 0.0


class QuotaLimits(Protocol):
    """A tenant's limits: a TenantContext, or a registry Quota row (read by the dashboard)."""

    @property
    def tenant_id(self) -> int: ...
    @property
    def requests_per_second(self) -> float: ...
    @property
    def tokens_per_minute(self) -> int: ...
    @property
    def max_concurrent_requests(self) -> int: ...


@dataclass(frozen=True, slots=True)
class QuotaUsage:
    """A tenant's counters now, as the next admission would see them: both buckets refilled to this
    instant. A bucket's level is what is left; what was drawn refills at the quota's rate."""

    num_in_flight: int  # admitted and not yet released
    max_concurrent_requests: int
    request_bucket_level: float  # requests that may start at once now; admission needs >= 1
    request_bucket_size: float  # the burst: max(1, requests_per_second)
    token_bucket_level: float  # tokens left; below zero when requests used more than their estimate
    token_bucket_size: int  # tokens_per_minute

    @property
    def requests_drawn(self) -> float:
        return self.request_bucket_size - self.request_bucket_level

    @property
    def tokens_drawn(self) -> float:
        return self.token_bucket_size - self.token_bucket_level


def refilled(
    limits: QuotaLimits, *, request_tokens: float, token_tokens: float, elapsed_s: float
) -> tuple[float, float]:
    """Both bucket levels after `elapsed_s` of refill, capped at their sizes (the Redis script does
    the same in Lua)."""
    elapsed_s = max(0.0, elapsed_s)
    rps_burst = max(1.0, limits.requests_per_second)
    return (
        min(rps_burst, request_tokens + elapsed_s * limits.requests_per_second),
        min(float(limits.tokens_per_minute), token_tokens + elapsed_s * limits.tokens_per_minute / 60.0),
    )


def quota_usage(
    limits: QuotaLimits,
    *,
    request_tokens: float | None,
    token_tokens: float | None,
    num_in_flight: int,
    elapsed_s: float,
) -> QuotaUsage:
    """Usage from stored counters (None: no state yet, so full buckets), refilled to now."""
    rps_burst = max(1.0, limits.requests_per_second)
    request_level, token_level = refilled(
        limits,
        request_tokens=rps_burst if request_tokens is None else request_tokens,
        token_tokens=float(limits.tokens_per_minute) if token_tokens is None else token_tokens,
        elapsed_s=elapsed_s,
    )
    return QuotaUsage(
        num_in_flight=num_in_flight,
        max_concurrent_requests=limits.max_concurrent_requests,
        request_bucket_level=request_level,
        request_bucket_size=rps_burst,
        token_bucket_level=token_level,
        token_bucket_size=limits.tokens_per_minute,
    )


class QuotaStore(Protocol):
    # `room_for`: admit only if that many such requests would be, charging this one (see refusal).
    def admit(self, context: TenantContext, *, tokens: int, room_for: int = 1) -> Ticket: ...
    def release(self, ticket: Ticket, *, used_tokens: int) -> None: ...
    # The same, for the gateway's event loop: no thread hop.
    async def aadmit(self, context: TenantContext, *, tokens: int, room_for: int = 1) -> Ticket: ...
    async def arelease(self, ticket: Ticket, *, used_tokens: int) -> None: ...
    # Admission and the request's submission to its replica (a channel-layer send), together; and
    # whether that saves anything for this tenant now (else the gateway admits first).
    def sends_with_admission(self, context: TenantContext) -> bool: ...
    async def aadmit_and_send(
        self,
        context: TenantContext,
        *,
        tokens: int,
        layer: Any,
        channel: str,
        message: dict[str, Any],
        room_for: int = 1,
    ) -> Ticket: ...
    def refusals(self) -> dict[int, int] | None: ...  # None: the counters cannot be read now
    def usage(self, limits: Iterable[QuotaLimits]) -> dict[int, QuotaUsage]: ...
    # Extends the leases of this process's requests in flight (the runtime calls it every
    # LEASE_RENEW_EVERY_S): a store whose in-flight counts outlive the process holds a dead process's
    # requests only until their leases run out.
    async def arenew(self) -> None: ...


LEASE_RENEW_EVERY_S = 15.0


class Charge(NamedTuple):
    """What a submission's admission charges: one request of `tokens` for the tenant, admitted only if
    `room_for` such would be (QuotaStore.admit)."""

    context: TenantContext
    tokens: int
    room_for: int = 1


_ZERO_QUOTA_RETRY_S = 60.0


def refusal(
    context: TenantContext,
    *,
    request_tokens: float,
    token_tokens: float,
    num_in_flight: int,
    tokens: int,
    room_for: int = 1,
) -> GatewayError | None:
    """The refusal for this state, None to admit. Every limit that binds is checked and Retry-After is
    the longest wait among them: a retry after the first one's wait alone would be refused again.
    `room_for`: admit only if `room_for` such requests would be (the first choice of an OpenAI n, whose
    others are admitted right after it), though only this one is charged."""
    # A zero limit admits nothing until an operator raises it: a long Retry-After, or clients would retry
    # every second for ever.
    if context.requests_per_second <= 0:
        return GatewayError(
            429, "request rate quota is zero for this tenant", retry_after_s=_ZERO_QUOTA_RETRY_S
        )
    if context.max_concurrent_requests <= 0:
        return GatewayError(
            429, "concurrent request quota is zero for this tenant", retry_after_s=_ZERO_QUOTA_RETRY_S
        )
    binding: list[tuple[float, str]] = []  # (wait in seconds, what binds)
    if num_in_flight + room_for > context.max_concurrent_requests:
        # When one ends is unknown: 1 s, as a request rarely holds its slot for less.
        binding.append((1.0, f"too many concurrent requests (limit {context.max_concurrent_requests})"))
    if request_tokens < room_for:
        wait = (room_for - request_tokens) / context.requests_per_second
        binding.append((wait, f"request rate over quota ({context.requests_per_second:g}/s)"))
    if token_tokens < tokens * room_for:
        wait = (tokens * room_for - token_tokens) / (context.tokens_per_minute / 60.0)
        binding.append((wait, f"token rate over quota ({context.tokens_per_minute}/min)"))
    if not binding:
        return None
    binding.sort(key=lambda limit: -limit[0])  # the longest wait first: it is the one Retry-After reports
    return GatewayError(429, "; ".join(reason for _, reason in binding), retry_after_s=binding[0][0])


def check_fits_quota(context: TenantContext, tokens: int) -> None:
    """Raises the 400 for a request that no wait would admit; both stores call it before counting, so
    refusal never sees one. A 400, not a 429: clients (the openai one among them) retry 429s."""
    if tokens > context.tokens_per_minute:
        raise GatewayError(
            400,
            f"request needs an estimated {tokens} tokens, over this tenant's whole quota of "
            f"{context.tokens_per_minute} tokens/min, so it can never be admitted: lower max_tokens or "
            "shorten the prompt",
        )


async def admit_then_send(
    store: QuotaStore,
    context: TenantContext,
    *,
    tokens: int,
    layer: Any,
    channel: str,
    message: dict[str, Any],
    room_for: int = 1,
) -> Ticket:
    """Admission, then the layer's own send; a send that fails gives the admission back. Raises
    GatewayError on a refusal, before anything is sent."""
    ticket = await store.aadmit(context, tokens=tokens, room_for=room_for)
    try:
        await layer.send(channel, message)
    except BaseException:
        await store.arelease(ticket, used_tokens=0)
        raise
    return ticket


def estimate_tokens(*, input_chars: int, max_tokens: int) -> int:
    """What admission charges before the prompt is tokenised (about 4 characters a token); the
    difference is settled when the request ends."""
    return max_tokens + max(1, input_chars // 4)


def charge_estimate(
    context: TenantContext,
    *,
    params: dict[str, Any],
    text: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    inputs: list[str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    num_choices: int = 1,
) -> int:
    """The tokens admission charges one request (one choice of `num_choices`) before it is tokenised."""
    input_chars = prompt_chars(text=text, messages=messages, inputs=inputs, tools=tools)
    # None (to the end of the context) is charged at the ceiling and settled when it ends, but never at
    # more than its choice's share of the tenant's whole minute, which would refuse every such request
    # (or its last choice).
    budget = context.tokens_per_minute // max(1, num_choices)
    max_tokens = max_tokens_for(
        params.get("max_tokens", 1),
        room=budget - estimate_tokens(input_chars=input_chars, max_tokens=0),
        limit=settings.MAX_TOKENS_LIMIT,
    )
    return estimate_tokens(input_chars=input_chars, max_tokens=max_tokens)


def check_choices_fit(context: TenantContext, *, n: int, tokens: int) -> None:
    """Raises the 400 for n choices of one request (OpenAI's n, each a request of its own of `tokens`)
    that the tenant's quota could never admit together: refused with a 429, the client would retry a
    request that can never be admitted."""
    at_once = min(math.floor(max(1.0, context.requests_per_second)), context.max_concurrent_requests)
    if n > at_once:
        raise GatewayError(
            400,
            f"n={n} asks for more choices than this tenant's quota admits at once ({at_once}: each "
            f"choice counts as a request against {context.requests_per_second:g} requests/s and "
            f"{context.max_concurrent_requests} concurrent)",
        )
    if n * tokens > context.tokens_per_minute:
        raise GatewayError(
            400,
            f"n={n} choices of an estimated {tokens} tokens each are over this tenant's whole quota of "
            f"{context.tokens_per_minute} tokens/min, so they can never be admitted together: lower "
            "n, max_tokens or the prompt",
        )
