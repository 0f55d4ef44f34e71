"""Writing the audit log: record() is the one way in. Services call it inside their own transaction, so
a change and its entry commit, or roll back, together."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from audit.models import AuditEntry

Action = AuditEntry.Action
ObjectType = AuditEntry.ObjectType


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One object as the log keeps it: what it is, and the fields a change to it is about, JSON-ready.
    Whoever builds one leaves secrets out (an API key is its prefix, never the key or its hash)."""

    object_type: str
    object_id: str
    fields: Mapping[str, Any]


def record(
    *,
    actor: str,
    action: str,
    before: Snapshot | None,
    after: Snapshot | None,
    reason: str = "",
) -> AuditEntry | None:
    """Log one change of one object: `before` None for a creation, `after` None for a deletion. A change
    that left every field the snapshot keeps as it was (a save of an unchanged form, an alias set to where
    it points) is no change: nothing is written, and None is returned."""
    subject = after if after is not None else before
    if subject is None:
        raise ValueError("an audit entry needs the object before or after the change")
    if before is not None and after is not None and dict(before.fields) == dict(after.fields):
        return None
    return AuditEntry.objects.create(
        at=timezone.now(),
        actor=(actor or "system")[:200],
        object_type=subject.object_type,
        object_id=subject.object_id[:200],
        action=action,
        before=dict(before.fields) if before is not None else None,
        after=dict(after.fields) if after is not None else None,
        reason=reason[:500],
    )
