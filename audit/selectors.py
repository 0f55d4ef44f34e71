"""Reading the audit log: newest first, narrowed by object type, actor and time range."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import QuerySet

from audit.models import AuditEntry


@dataclass(frozen=True, slots=True)
class AuditQuery:
    object_type: str = ""  # "": every type
    actor: str = ""  # part of the actor's name, any case: "alice" finds "staff:alice"
    since: dt.datetime | None = None  # inclusive
    until: dt.datetime | None = None  # exclusive


@dataclass(frozen=True, slots=True)
class AuditRow:
    """An entry as a page shows it: before and after as indented JSON, and which fields changed."""

    entry: AuditEntry
    before: str
    after: str
    changed: tuple[str, ...]


def audit_entries(query: AuditQuery) -> QuerySet[AuditEntry]:
    entries = AuditEntry.objects.order_by("-at", "-id")
    if query.object_type:
        entries = entries.filter(object_type=query.object_type)
    if query.actor:
        entries = entries.filter(actor__icontains=query.actor)
    if query.since is not None:
        entries = entries.filter(at__gte=query.since)
    if query.until is not None:
        entries = entries.filter(at__lt=query.until)
    return entries


def audit_row(entry: AuditEntry) -> AuditRow:
    before, after = entry.before or {}, entry.after or {}
    changed = tuple(sorted(k for k in {*before, *after} if before.get(k) != after.get(k)))
    return AuditRow(entry=entry, before=_json(entry.before), after=_json(entry.after), changed=changed)


def _json(value: object) -> str:
    if value is None:
        return ""
    return json.dumps(value, indent=1, sort_keys=True, cls=DjangoJSONEncoder, ensure_ascii=False)
