"""Who is calling the control-plane API, and which models it may see and change: a tenant by its key
(request.auth is its TenantContext), staff by their session; any other signed-in user gets 403."""

from __future__ import annotations

from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.request import Request

from audit import actors
from registry.models import Model, is_valid_name
from registry.selectors import TenantContext


def caller_context(request: Request) -> TenantContext | None:
    """The tenant calling with its key, or None for staff."""
    if isinstance(request.auth, TenantContext):
        return request.auth
    if not getattr(request.user, "is_staff", False):  # a session of someone who is neither
        raise PermissionDenied("the model registry is for tenants' API keys and for staff")
    return None


def caller_actor(request: Request) -> str:
    """Who is calling, as the audit log and the rollout histories name them."""
    if isinstance(request.auth, TenantContext):
        return actors.tenant(request.auth.tenant_name)
    return actors.staff(request.user)


def owned_model(request: Request, name: str) -> Model:
    """The model `name` for a change by the caller: staff may change any; a tenant its own only. One it
    may not use is not found, as everywhere; one it may use but does not own (the platform's, one shared
    with it) is a 403."""
    model = visible_model(request, name)
    context = caller_context(request)
    if context is not None and model.owner_id != context.tenant_id:
        raise PermissionDenied(f"tenant {context.tenant_name!r} may change only its own models")
    return model


def visible_model(request: Request, name: str) -> Model:
    context = caller_context(request)
    model = (
        Model.objects.filter(name=name).select_related("routing_table").first()
        if is_valid_name(name)
        else None
    )
    # A model the caller may not use is reported exactly like one that does not exist.
    if model is None or (context is not None and not context.may_use(name, owner_id=model.owner_id)):
        raise NotFound(f"model {name!r} not found")
    return model


def staff_only(request: Request, what: str) -> None:
    """Refuse (403) a tenant's key and a signed-in user who is not staff."""
    if isinstance(request.auth, TenantContext) or not getattr(request.user, "is_staff", False):
        raise PermissionDenied(f"{what} are for staff")
