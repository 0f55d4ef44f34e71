"""Registry endpoints under /v1/. Tenants (by key) see only the models they may use; staff (by session)
see all; any other signed-in user gets 403. Registering a version: staff, and a tenant for its own
models (a new model it registers is its own). Tenants and keys: registry/tenant_api.py; aliases and
traffic: rollouts/traffic_api.py (they check for a deployment in flight)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from registry import selectors
from registry.callers import caller_context, visible_model
from registry.models import Model
from registry.registration_api import REGISTERED_SCHEMA, VersionRegistration, register_version


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
        "parent": serializers.CharField(allow_null=True),
        "quantization": serializers.CharField(allow_null=True),
        "quality": serializers.DictField(allow_null=True),
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
        models = selectors.models_visible_to(context=caller_context(request))
        return Response({"object": "list", "data": [_openai_model(m) for m in models]})


class ModelDetailView(APIView):
    @extend_schema(responses=ModelSchema)
    def get(self, request: Request, model: str) -> Response:
        return Response(_openai_model(visible_model(request, model)))


class ModelVersionListView(APIView):
    @extend_schema(responses=_VERSION_SCHEMA)
    def get(self, request: Request, model: str) -> Response:
        rows = selectors.model_versions_overview(model=visible_model(request, model))
        return Response(rows)

    @extend_schema(
        operation_id="models_versions_create",
        description="Register a version from a model directory under the server's import root (staff; a "
        "tenant for its own models, and a new model it registers is its own).",
        request=VersionRegistration,
        responses={201: REGISTERED_SCHEMA},
    )
    def post(self, request: Request, model: str) -> Response:
        return register_version(request, model)
