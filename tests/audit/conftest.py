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
