"""Tenants, their quotas and their API keys under /v1/tenants: staff only (a tenant's key, or a signed-in
user who is not staff, gets 403). Each write is one registry service, so it is checked, done in one
transaction and recorded in the audit log as `manage.py create_tenant`, `create_api_key` and
`revoke_api_key` are. A new key is in the response that creates it and nowhere else (it is stored
hashed); a key is revoked by the prefix the listings show."""

from __future__ import annotations

import re
from typing import Any

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from registry import snapshots
from registry.bodies import Refused, read_body
from registry.callers import caller_actor, staff_only
from registry.models import ApiKey, Model, Quota, ServiceTier, Tenant, is_valid_name
from registry.quotas import models_named
from registry.services import (
    AlreadyExists,
    QuotaChange,
    RegistryError,
    api_key_create,
    api_keys_revoke,
    quota_set,
    tenant_create,
)

MAX_INT = 2**31 - 1  # the database's integer columns
PREFIX = re.compile(rf"[A-Za-z0-9_-]{{{ApiKey.PREFIX_LENGTH}}}")  # a key's first characters (base64url)


class QuotaFields(serializers.Serializer):  # type: ignore[type-arg]
    requests_per_second = serializers.FloatField(min_value=0, required=False)
    tokens_per_minute = serializers.IntegerField(min_value=0, max_value=MAX_INT, required=False)
    max_concurrent_requests = serializers.IntegerField(min_value=0, max_value=MAX_INT, required=False)
    may_pin = serializers.BooleanField(required=False)
    may_deploy = serializers.BooleanField(required=False)
    max_service_tier = serializers.ChoiceField(
        choices=ServiceTier.values,
        required=False,
        help_text="The highest service_tier its requests may ask for (default: default).",
    )
    ttft_objective_ms = serializers.IntegerField(
        min_value=1,
        max_value=MAX_INT,
        required=False,
        allow_null=True,
        help_text="Its p99 time-to-first-token objective, in ms; null: none.",
    )
    tpot_objective_ms = serializers.IntegerField(
        min_value=1,
        max_value=MAX_INT,
        required=False,
        allow_null=True,
        help_text="Its time-per-output-token objective, in ms; null: none.",
    )
    max_running_sequences = serializers.IntegerField(
        min_value=1,
        max_value=MAX_INT,
        required=False,
        allow_null=True,
        help_text="The most of its sequences one replica runs at once; null: the replica's default.",
    )
    kv_share = serializers.FloatField(
        min_value=0.01,
        max_value=1,
        required=False,
        allow_null=True,
        help_text="The share of a replica's KV-cache blocks its sequences may hold; null: the replica's "
        "default.",
    )
    allowed_models = serializers.ListField(
        child=serializers.CharField(max_length=63),
        required=False,
        help_text="Models it may use besides its own; empty: every model but other tenants' own.",
    )
    deployable_models = serializers.ListField(
        child=serializers.CharField(max_length=63),
        required=False,
        help_text="Platform models it may roll out too (with may_deploy).",
    )


class TenantCreation(QuotaFields):
    name = serializers.CharField(max_length=63)


class ApiKeyCreation(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(max_length=63, required=False, allow_blank=True)


_QUOTA_SCHEMA = inline_serializer(
    "Quota",
    {
        "requests_per_second": serializers.FloatField(),
        "tokens_per_minute": serializers.IntegerField(),
        "max_concurrent_requests": serializers.IntegerField(),
        "may_pin": serializers.BooleanField(),
        "may_deploy": serializers.BooleanField(),
        "max_service_tier": serializers.ChoiceField(choices=ServiceTier.values),
        "ttft_objective_ms": serializers.IntegerField(allow_null=True),
        "tpot_objective_ms": serializers.IntegerField(allow_null=True),
        "max_running_sequences": serializers.IntegerField(allow_null=True),
        "kv_share": serializers.FloatField(allow_null=True),
        "allowed_models": serializers.ListField(child=serializers.CharField()),
        "deployable_models": serializers.ListField(child=serializers.CharField()),
    },
)
_TENANT_SCHEMA = inline_serializer(
    "Tenant",
    {"name": serializers.CharField(), "is_active": serializers.BooleanField(), "quota": _QUOTA_SCHEMA},
)
_KEY_FIELDS = {
    "tenant": serializers.CharField(),
    "prefix": serializers.CharField(),
    "name": serializers.CharField(),
    "created_at": serializers.DateTimeField(),
    "revoked_at": serializers.DateTimeField(allow_null=True),
}
_NEW_KEY_SCHEMA = inline_serializer(
    "ApiKeyCreated",
    {**_KEY_FIELDS, "key": serializers.CharField(help_text="The key itself: shown this once, never again.")},
)
_REVOKED_SCHEMA = inline_serializer(
    "ApiKeysRevoked", {"revoked": inline_serializer("ApiKey", _KEY_FIELDS, many=True)}
)


def _quota(quota: Quota) -> dict[str, Any]:
    """A quota as the API answers it: the fields the audit log keeps of it (registry/snapshots.py)."""
    return dict(snapshots.quota(quota).fields)


def _key(api_key: ApiKey) -> dict[str, Any]:
    return {
        "tenant": api_key.tenant.name,
        "prefix": api_key.prefix,
        "name": api_key.name,
        "created_at": api_key.created_at,
        "revoked_at": api_key.revoked_at,
    }


def _models(names: list[str] | None) -> tuple[Model, ...] | None:
    """The models named, all of which must exist."""
    if names is None:
        return None
    try:
        return models_named(names)
    except LookupError as exc:
        raise Refused(400, str(exc)) from None


def _tenant(request: Request, name: str) -> Tenant:
    staff_only(request, "tenants, quotas and API keys")
    tenant = Tenant.objects.filter(name=name).first() if is_valid_name(name) else None
    if tenant is None:
        raise NotFound(f"tenant {name!r} not found")
    return tenant


class TenantListView(APIView):
    @extend_schema(operation_id="tenants_create", request=TenantCreation, responses={201: _TENANT_SCHEMA})
    def post(self, request: Request) -> Response:
        staff_only(request, "tenants, quotas and API keys")
        body = read_body(request, TenantCreation)
        allowed = _models(body.pop("allowed_models", []))
        deployable = _models(body.pop("deployable_models", []))
        try:
            tenant = tenant_create(
                **body,
                allowed_models=allowed or (),
                deployable_models=deployable or (),
                actor=caller_actor(request),
            )
        except AlreadyExists as exc:
            raise Refused(409, str(exc)) from None
        except RegistryError as exc:
            raise Refused(400, str(exc)) from None
        return Response(
            {"name": tenant.name, "is_active": tenant.is_active, "quota": _quota(tenant.quota)},
            status=status.HTTP_201_CREATED,
        )


class QuotaView(APIView):
    # A comment, not a docstring: drf-spectacular would publish it as the operation's description.
    # PATCH: the fields given change, the others stay (null empties an objective or a cap); a tenant
    # made without a quota gets one.
    @extend_schema(operation_id="tenants_quota_update", request=QuotaFields, responses=_QUOTA_SCHEMA)
    def patch(self, request: Request, tenant: str) -> Response:
        found = _tenant(request, tenant)
        body = read_body(request, QuotaFields)
        lists: dict[str, Any] = {
            k: _models(body.pop(k)) for k in ("allowed_models", "deployable_models") if k in body
        }
        change = QuotaChange(**body, **lists)  # null: no objective, no cap of its own
        try:
            quota = quota_set(tenant=found, change=change, actor=caller_actor(request))
        except RegistryError as exc:
            raise Refused(400, str(exc)) from None
        return Response(_quota(quota))


class ApiKeyListView(APIView):
    @extend_schema(
        operation_id="tenants_api_keys_create", request=ApiKeyCreation, responses={201: _NEW_KEY_SCHEMA}
    )
    def post(self, request: Request, tenant: str) -> Response:
        found = _tenant(request, tenant)
        body = read_body(request, ApiKeyCreation)
        if not found.is_active:
            raise Refused(409, f"tenant {found.name!r} is inactive: a key of it would not authenticate")
        api_key, raw_key = api_key_create(
            tenant=found, name=body.get("name", ""), actor=caller_actor(request)
        )
        return Response(
            {**_key(api_key), "key": raw_key},
            status=status.HTTP_201_CREATED,
            headers={"Cache-Control": "no-store"},  # the raw key is in this response and nowhere else
        )


class ApiKeyRevokeView(APIView):
    @extend_schema(operation_id="tenants_api_keys_revoke", request=None, responses=_REVOKED_SCHEMA)
    def post(self, request: Request, tenant: str, prefix: str) -> Response:
        found = _tenant(request, tenant)
        if not PREFIX.fullmatch(prefix):
            # Never a whole key: a URL ends up in access logs.
            raise Refused(400, f"name a key by its first {ApiKey.PREFIX_LENGTH} characters (its prefix)")
        keys = list(ApiKey.objects.filter(tenant=found, prefix=prefix).select_related("tenant"))
        if not keys:
            raise NotFound(f"tenant {found.name!r} has no key {prefix}")
        revoked = api_keys_revoke(api_keys=keys, actor=caller_actor(request))
        if not revoked:
            raise Refused(409, f"key {prefix} of tenant {found.name!r} is already revoked")
        return Response({"revoked": [_key(k) for k in revoked]})
