"""Which tenant the request being served is for, as the access log records it (config/access_log.py):
the log wraps the whole application, and learns the tenant only once a key has authenticated deep
inside it (registry/authentication.py for the control plane, serving/gateway/dispatch.py for
inference). A context variable holds a small mutable record that the log makes per request, because
the view may run in a task of its own, whose context is a copy: a change to the variable there would
not come back, a change to the record does."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(slots=True)
class RequestTenant:
    tenant_id: int | None = None


_current: ContextVar[RequestTenant | None] = ContextVar("switchyard_request_tenant", default=None)


def begin() -> RequestTenant:
    """A record for the request starting in this context (the access log's)."""
    record = RequestTenant()
    _current.set(record)
    return record


def note(tenant_id: int) -> None:
    """The request's key authenticated as `tenant_id`; nothing where no access log is recording."""
    record = _current.get()
    if record is not None:
        record.tenant_id = tenant_id
