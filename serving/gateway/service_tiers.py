"""The service tier a request is served at (docs/architecture.md, "Service tiers"): OpenAI's
`service_tier` field, checked at the edge against the tenant's quota.

- absent, null or "auto": "default", or the tenant's highest tier where that is lower (a flex-only
  tenant is served at flex);
- "priority", "default" or "flex": that tier, if the quota allows it; one above the quota's highest is
  a 403 (the request is refused, not quietly served lower: a client that asked for priority must know);
- anything else: a 400.
The tier granted travels with the submission to the replica, whose scheduler admits by it, and is
echoed in the response."""

from __future__ import annotations

from typing import Any

from registry.models import ServiceTier
from registry.selectors import TenantContext
from serving.gateway.errors import GatewayError

REQUESTABLE = ("auto", *ServiceTier.values)


def parse_service_tier(value: Any) -> str | None:
    """A body's `service_tier`, checked; None when absent or null."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in REQUESTABLE:
        raise GatewayError(400, f"service_tier must be one of {', '.join(REQUESTABLE)}")
    return value


def grant_tier(context: TenantContext, requested: str | None) -> str:
    """The tier this request is served at, or a 403 when it asks above the tenant's quota."""
    highest = context.max_service_tier
    if requested is None or requested == "auto":
        default = ServiceTier.DEFAULT.value
        return default if ServiceTier.rank(default) >= ServiceTier.rank(highest) else highest
    if ServiceTier.rank(requested) < ServiceTier.rank(highest):
        raise GatewayError(
            403, f"service_tier {requested!r} is above this key's quota (its highest tier is {highest!r})"
        )
    return requested
