"""API key -> tenant (cached for a few seconds), and whether the tenant may use a model, a pin or an alias."""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings
from django.db import DatabaseError

from registry.authentication import bearer_token
from registry.selectors import RoutingSnapshot, TenantContext, tenant_context_for_api_key
from registry.services import hash_api_key
from serving.gateway.errors import GatewayError
from serving.throttle import Throttle

logger = logging.getLogger(__name__)

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
