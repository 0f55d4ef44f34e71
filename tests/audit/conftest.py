"""Helpers for the audit log's tests: what the log holds, as tuples a test can compare whole."""

from __future__ import annotations

from typing import Any

import pytest


def logged(since: int = 0, **match: Any) -> list[tuple[str, str, str, str]]:
    """(actor, action, object type, object id) of each entry after id `since`, oldest first."""
    from audit.models import AuditEntry

    return list(
        AuditEntry.objects.filter(pk__gt=since, **match)
        .order_by("pk")
        .values_list("actor", "action", "object_type", "object_id")
    )


def last_id() -> int:
    """The id entries from now on come after."""
    from audit.models import AuditEntry

    return AuditEntry.objects.order_by("-pk").values_list("pk", flat=True).first() or 0


@pytest.fixture
def superuser_client(client):  # type: ignore[no-untyped-def]
    """The test client signed in to the admin as superuser `alice` (recorded as "staff:alice")."""
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.create_user("alice", is_staff=True, is_superuser=True))
    return client


def tenant_form(tenant: Any = None, **quota: Any) -> dict[str, Any]:
    """The admin's tenant page as a browser sends it, with its quota inline: the quota's defaults, but
    for the fields given (an empty one, "", is left out, as a browser sends an empty input: None)."""
    from registry.models import Quota

    values = {
        "requests_per_second": 10.0,
        "tokens_per_minute": 100_000,
        "max_concurrent_requests": 16,
        "may_pin": "",
        "may_deploy": "",
        "max_service_tier": "default",  # a select: always sent
        **quota,
    }
    existing = Quota.objects.filter(tenant=tenant).first() if tenant is not None else None
    return {
        "name": tenant.name if tenant is not None else "acme",
        "is_active": "on",
        "prefix_cache_group": "",
        "quota-TOTAL_FORMS": 1,
        "quota-INITIAL_FORMS": 1 if existing is not None else 0,
        "quota-MIN_NUM_FORMS": 0,
        "quota-MAX_NUM_FORMS": 1,
        "quota-0-id": existing.pk if existing is not None else "",
        "quota-0-tenant": tenant.pk if tenant is not None else "",
        **{f"quota-0-{k}": v for k, v in values.items() if v != ""},
    }
