"""DRF authentication by `Authorization: Bearer <api key>`; the tenant rides on request.auth."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from registry import request_tenant
from registry.auth_throttle import api_key_attempt, api_key_failures
from registry.selectors import TenantContext, tenant_context_for_api_key


class TenantPrincipal:
    """Stands in for request.user when a tenant's key authenticated the call."""

    is_authenticated = True
    is_staff = False

    def __init__(self, context: TenantContext) -> None:
        self.context = context

    def __str__(self) -> str:
        return f"tenant:{self.context.tenant_name}"


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request: Any) -> tuple[TenantPrincipal, TenantContext] | None:
        header = request.META.get("HTTP_AUTHORIZATION")
        if not header:
            return None
        token = bearer_token(header)
        attempt = api_key_attempt(request.META.get("REMOTE_ADDR"), token)
        wait_s = api_key_failures.retry_after_s(attempt)
        if wait_s is not None:  # the right key too: registry/auth_throttle.py
            raise exceptions.Throttled(
                wait=wait_s, detail="too many failed API key attempts; try again later"
            )
        context = tenant_context_for_api_key(token) if token else None
        if context is None:
            api_key_failures.record(attempt)
            raise exceptions.AuthenticationFailed("invalid API key")
        request_tenant.note(context.tenant_id)
        return TenantPrincipal(context), context

    def authenticate_header(self, request: Any) -> str:
        return 'Bearer realm="switchyard"'


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    target_class = "registry.authentication.ApiKeyAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "a tenant API key"}
