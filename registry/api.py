"""Registry endpoints under /v1/. Tenants (by key) see only the models they may use; staff (by session)
see all; any other signed-in user gets 403."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from registry import selectors
from registry.models import Model, is_valid_name
from registry.selectors import TenantContext


def _caller_context(request: Request) -> TenantContext | None:
    """The tenant calling with its key, or None for staff."""
    if isinstance(request.auth, TenantContext):
        return request.auth
    if not getattr(request.user, "is_staff", False):  # a session of someone who is neither
        raise PermissionDenied("the model registry is for tenants' API keys and for staff")
    return None


def _visible_model(request: Request, name: str) -> Model:
    context = _caller_context(request)
    model = (
        Model.objects.filter(name=name).select_related("routing_table").first()
        if is_valid_name(name)
        else None
    )
    # A model the caller may not use is reported exactly like one that does not exist.
    if model is None or (context is not None and not context.may_use(name, owner_id=model.owner_id)):
        raise NotFound(f"model {name!r} not found")
    return model


def _openai_model(model: Model) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": int(model.created_at.timestamp()),
        "owned_by": "switchyard",
        # ours: which endpoints serve it (causal-lm: completions; embedding: embeddings; classifier: infer)
        "kind": model.kind,
    }


class ModelSchema(serializers.Serializer):  # documents the OpenAI model object
    id = serializers.CharField()
    object = serializers.CharField()
    created = serializers.IntegerField()
    owned_by = serializers.CharField()
    kind = serializers.ChoiceField(choices=Model.Kind.choices)


_VERSION_SCHEMA = inline_serializer(
    "ModelVersionState",
    many=True,
    fields={
        "version": serializers.CharField(),
        "traffic_pct": serializers.IntegerField(),
        "state": serializers.CharField(),
        "aliases": serializers.ListField(child=serializers.CharField()),
        "sha256": serializers.CharField(),
        "created_at": serializers.DateTimeField(),
    },
)


class ModelListView(APIView):
    @extend_schema(
        operation_id="models_list",
        responses=inline_serializer(
            "ModelList", {"object": serializers.CharField(), "data": ModelSchema(many=True)}
        ),
    )
    def get(self, request: Request) -> Response:
        models = selectors.models_visible_to(context=_caller_context(request))
        return Response({"object": "list", "data": [_openai_model(m) for m in models]})


class ModelDetailView(APIView):
    @extend_schema(responses=ModelSchema)
    def get(self, request: Request, model: str) -> Response:
        return Response(_openai_model(_visible_model(request, model)))


class ModelVersionListView(APIView):
    @extend_schema(responses=_VERSION_SCHEMA)
    def get(self, request: Request, model: str) -> Response:
        rows = selectors.model_versions_overview(model=_visible_model(request, model))
        return Response(rows)
