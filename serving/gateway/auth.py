"""The gateway: API key -> tenant -> model and pin permissions -> quota admission.

Quota state is a token bucket for requests/s, one for tokens/min and the requests in flight per tenant
(by ticket id; in Redis, leases that expire if never released). It lives in Redis when REDIS_URL is set
(one Lua script, so it is atomic across gateway processes) and in process memory otherwise. A refusal
is a GatewayError carrying the HTTP status and Retry-After."""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from django.conf import settings
from django.db import DatabaseError

from registry.authentication import bearer_token
from registry.selectors import RoutingSnapshot, TenantContext, tenant_context_for_api_key
from registry.services import hash_api_key
from serving.throttle import Throttle

logger = logging.getLogger(__name__)


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
        # A refusal by a replica (a prompt too long for its version's model): the response's headers that
        # say which version and replica refused it (Dispatch.response_headers), as a served response's do.
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


# --- authentication ------------------------------------------------------------------------------

_AUTH_CACHE_TTL_S = 5.0
# While the database cannot be read, a key that passed within settings.AUTH_STALE_S still does: the data
# plane keeps serving the tenants it has seen through a control-plane outage (as routing keeps its last
# good table). The price: during an outage a key revoked, or a tenant deactivated, since that key last
# passed on this process (up to AUTH_STALE_S ago, an hour by default) works until the database answers.
_auth_cache: dict[str, tuple[float, TenantContext]] = {}  # key hash -> (checked at, monotonic; context)
_auth_cache_lock = threading.Lock()
_stale_warning = Throttle()  # one warning per 10 s of an outage, not one per request


def authenticate_from_cache(authorization: str | None) -> TenantContext | None:
    """The cached context for this key, without touching the database (None on a miss). Raises 401 for
    a missing key. Lets async callers skip a thread hop on the hot path."""
    token = bearer_token(authorization)
    if token is None:
        raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'")
    with _auth_cache_lock:
        hit = _auth_cache.get(hash_api_key(token))
    return hit[1] if hit is not None and time.monotonic() - hit[0] < _AUTH_CACHE_TTL_S else None


def authenticate(authorization: str | None) -> TenantContext:
    """Resolve the caller. Contexts are cached a few seconds by key hash, so a burst of requests (or
    of refusals) costs one database read; a revoked key stops working within that time. While the
    database cannot be read, a key that passed within settings.AUTH_STALE_S (an hour) still does."""
    cached = authenticate_from_cache(authorization)
    if cached is not None:
        return cached
    token = bearer_token(authorization)
    assert token is not None  # authenticate_from_cache raised otherwise
    cache_key = hash_api_key(token)
    now = time.monotonic()
    try:
        context = tenant_context_for_api_key(token)
    except DatabaseError as exc:
        with _auth_cache_lock:
            hit = _auth_cache.get(cache_key)
        if hit is not None and now - hit[0] < settings.AUTH_STALE_S:
            _warn_stale(exc)
            return hit[1]
        # A key not seen lately cannot be checked: the client should retry rather than read a 500.
        logger.warning("API key lookup failed (%s); answering 503", type(exc).__name__)
        raise GatewayError(503, "the API key could not be checked right now", retry_after_s=1) from exc
    if context is None:
        with _auth_cache_lock:  # revoked (or its tenant deactivated): no outage may bring it back
            _auth_cache.pop(cache_key, None)
        raise GatewayError(401, "invalid API key")
    with _auth_cache_lock:
        if len(_auth_cache) > 10_000:
            _auth_cache.clear()
        _auth_cache[cache_key] = (now, context)
    return context


def _warn_stale(exc: Exception) -> None:
    if _stale_warning.is_due():
        logger.warning(
            "API key lookup failed (%s); keys seen in the last %.0f s pass on their last check",
            type(exc).__name__,
            settings.AUTH_STALE_S,
        )


def clear_auth_cache() -> None:
    with _auth_cache_lock:
        _auth_cache.clear()


# The aliases any tenant that may use a model may name. Another (`canary`, which a deployment in flight
# points at its candidate) chooses a version as a pin does, and needs the right to pin: any tenant could
# otherwise send a candidate all the traffic it liked and steer the rollout judge's verdict.
PUBLIC_ALIASES = frozenset({"stable"})


def authorize_model(
    context: TenantContext, snapshot: RoutingSnapshot, *, pinned_version: str | None, alias: str | None = None
) -> None:
    """Against the model's owner as the routing cache has it (within a second of a change)."""
    model_name, owner_id = snapshot.model_name, snapshot.owner_id
    if context.is_hidden(model_name, owner_id=owner_id):  # as an unknown model: its name tells nothing
        raise GatewayError(404, f"model {model_name!r} not found")
    if not context.may_use(model_name, owner_id=owner_id):
        raise GatewayError(403, f"tenant {context.tenant_name!r} may not use model {model_name!r}")
    if pinned_version is not None and not context.may_pin:
        raise GatewayError(403, f"tenant {context.tenant_name!r} may not pin versions (X-Version-Pin)")
    if alias is not None and alias not in PUBLIC_ALIASES and not context.may_pin:
        raise GatewayError(
            403,
            f"tenant {context.tenant_name!r} may not choose a version by alias ({model_name}@{alias}): "
            f"{', '.join(f'@{a}' for a in sorted(PUBLIC_ALIASES))} needs no right, others the right to pin",
        )


# --- quota admission -----------------------------------------------------------------------------


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


def _refilled(
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
    request_level, token_level = _refilled(
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
    # `room_for`: admit only if that many such requests would be, charging this one (see _refusal).
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


@dataclass(slots=True)
class _TenantState:
    request_tokens: float
    token_tokens: float
    updated_at: float
    # Admitted and not yet released, by ticket id: a second release of one ticket frees no other's slot,
    # as in the Redis store, whose in-flight requests are leases by ticket id.
    in_flight: set[str] = field(default_factory=set)


class MemoryQuotaStore:
    """Per-process counters: exact for one server process (the embedded default)."""

    def __init__(self, clock: object = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[int, _TenantState] = {}
        self._num_refused: dict[int, int] = {}  # tenant id -> 429s since this process started
        self._lock = threading.Lock()

    def _refill(self, context: TenantContext, now: float) -> _TenantState:
        state = self._states.get(context.tenant_id)
        if state is None:
            state = _TenantState(max(1.0, context.requests_per_second), float(context.tokens_per_minute), now)
            self._states[context.tenant_id] = state
        state.request_tokens, state.token_tokens = _refilled(
            context,
            request_tokens=state.request_tokens,
            token_tokens=state.token_tokens,
            elapsed_s=now - state.updated_at,
        )
        state.updated_at = now
        return state

    def admit(self, context: TenantContext, *, tokens: int, room_for: int = 1) -> Ticket:
        check_fits_quota(context, tokens)
        ticket = Ticket(uuid.uuid4().hex, context.tenant_id, tokens)
        with self._lock:
            state = self._refill(context, self._clock())  # type: ignore[operator]
            refusal = _refusal(
                context,
                request_tokens=state.request_tokens,
                token_tokens=state.token_tokens,
                num_in_flight=len(state.in_flight),
                tokens=tokens,
                room_for=room_for,
            )
            if refusal is not None:
                self._num_refused[context.tenant_id] = self._num_refused.get(context.tenant_id, 0) + 1
                raise refusal
            state.request_tokens -= 1.0
            state.token_tokens -= tokens
            state.in_flight.add(ticket.ticket_id)
        return ticket

    def release(self, ticket: Ticket, *, used_tokens: int) -> None:
        with self._lock:
            state = self._states.get(ticket.tenant_id)
            if state is None or ticket.ticket_id not in state.in_flight:
                return  # released already, or never admitted: it holds nothing to give back
            state.in_flight.remove(ticket.ticket_id)
            # Settle the estimate charged at admission against what the request really used.
            state.token_tokens += ticket.charged_tokens - used_tokens

    # No I/O: the event loop may call the sync methods directly (the lock is never held across I/O).
    async def aadmit(self, context: TenantContext, *, tokens: int, room_for: int = 1) -> Ticket:
        return self.admit(context, tokens=tokens, room_for=room_for)

    async def arelease(self, ticket: Ticket, *, used_tokens: int) -> None:
        self.release(ticket, used_tokens=used_tokens)

    def sends_with_admission(self, context: TenantContext) -> bool:
        return False  # admission costs no round trip here: admit before anything else is built

    async def aadmit_and_send(
        self,
        context: TenantContext,
        *,
        tokens: int,
        layer: Any,
        channel: str,
        message: dict[str, Any],
        room_for: int = 1,
    ) -> Ticket:
        return await admit_then_send(
            self, context, tokens=tokens, layer=layer, channel=channel, message=message, room_for=room_for
        )

    async def arenew(self) -> None:
        pass  # the counts are this process's own, and go with it

    def refusals(self) -> dict[int, int]:
        """429s per tenant id since this process started."""
        with self._lock:
            return dict(self._num_refused)

    def usage(self, limits: Iterable[QuotaLimits]) -> dict[int, QuotaUsage]:
        """Each tenant's usage now, in this process; reading refills nothing (admission does that)."""
        with self._lock:
            now = self._clock()  # type: ignore[operator]
            result = {}
            for tenant in limits:
                state = self._states.get(tenant.tenant_id)
                result[tenant.tenant_id] = quota_usage(
                    tenant,
                    request_tokens=state.request_tokens if state else None,
                    token_tokens=state.token_tokens if state else None,
                    num_in_flight=len(state.in_flight) if state else 0,
                    elapsed_s=now - state.updated_at if state else 0.0,
                )
            return result


_ZERO_QUOTA_RETRY_S = 60.0


def _refusal(
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
    _refusal never sees one. A 400, not a 429: clients (the openai one among them) retry 429s."""
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


_quota_store: QuotaStore | None = None
_quota_store_lock = threading.Lock()


def quota_store() -> QuotaStore:
    global _quota_store
    with _quota_store_lock:
        if _quota_store is None:
            if settings.REDIS_URL:
                from serving.gateway.quota_redis import RedisQuotaStore

                _quota_store = RedisQuotaStore(settings.REDIS_URL)
            else:
                _quota_store = MemoryQuotaStore()
        return _quota_store


def reset_quota_store(store: QuotaStore | None = None) -> None:
    global _quota_store
    with _quota_store_lock:
        _quota_store = store


def estimate_tokens(*, input_chars: int, max_tokens: int) -> int:
    """What admission charges before the prompt is tokenised (about 4 characters a token); the
    difference is settled when the request ends."""
    return max_tokens + max(1, input_chars // 4)
