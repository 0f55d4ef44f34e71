"""A model's traffic by hand over REST: PUT /v1/models/{model}/aliases/{alias} points an alias at a
version, PUT /v1/models/{model}/traffic sets the split, through the registry's services (so gateways
follow within a second, and each change is in the audit log once, with the caller as actor).

Staff may edit any model's; a tenant only its own model's, and only with may_deploy (a hand edit of the
traffic is a rollout without the judge). Apart from the registry's API because a deployment in flight
owns its model's traffic and its canary alias until it ends: an edit then is a 409, checked under the
model's row lock, the lock deployment_create takes."""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from registry.bodies import Refused, read_body
from registry.callers import caller_actor, owned_model
from registry.models import Model, is_valid_name
from registry.selectors import TenantContext
from registry.services import RegistryError, alias_set, routing_table_set
from rollouts.selectors import deployment_in_flight
from rollouts.services import CANARY_ALIAS


class AliasMove(serializers.Serializer):  # type: ignore[type-arg]
    version = serializers.CharField(max_length=63)
    reason = serializers.CharField(max_length=255, required=False, allow_blank=True)


class TrafficSplit(serializers.Serializer):  # type: ignore[type-arg]
    weights = serializers.DictField(
        child=serializers.JSONField(),  # checked by the service: whole percentages summing to 100
        help_text='Version -> whole percentage, summing to 100: {"v1": 90, "v2": 10}. A version left out '
        "gets 0.",
    )


_ALIAS_SCHEMA = inline_serializer(
    "AliasSet",
    {"model": serializers.CharField(), "alias": serializers.CharField(), "version": serializers.CharField()},
)
_TRAFFIC_SCHEMA = inline_serializer(
    "TrafficSet",
    {
        "model": serializers.CharField(),
        "revision": serializers.IntegerField(),
        "weights": serializers.DictField(child=serializers.IntegerField()),
    },
)


def _editable_model(request: Request, name: str) -> Model:
    """The model, locked for the rest of the transaction, if the caller may edit its traffic."""
    model = owned_model(request, name)  # 404 for one the tenant may not use, 403 for one it does not own
    if isinstance(request.auth, TenantContext) and not request.auth.may_deploy:
        raise PermissionDenied(f"tenant {request.auth.tenant_name!r} may not deploy")
    return Model.objects.select_for_update().get(pk=model.pk)


class AliasView(APIView):
    @extend_schema(operation_id="models_aliases_update", request=AliasMove, responses=_ALIAS_SCHEMA)
    @transaction.atomic
    def put(self, request: Request, model: str, alias: str) -> Response:
        found = _editable_model(request, model)
        body = read_body(request, AliasMove)
        if not is_valid_name(alias):
            raise Refused(400, f"invalid alias name {alias!r}")
        version = found.versions.filter(version=body["version"]).first()
        if version is None:
            raise Refused(400, f"model {found.name!r} has no version {body['version']!r}")
        in_flight = deployment_in_flight(model=found)
        if alias == CANARY_ALIAS and in_flight is not None:
            raise Refused(
                409,
                f"deployment {in_flight.pk} of {found.name} is in flight: its canary alias is the rollout's",
            )
        alias_set(
            model=found,
            name=alias,
            version=version,
            actor=caller_actor(request),
            reason=body.get("reason") or "set by hand (API)",
        )
        return Response({"model": found.name, "alias": alias, "version": version.version})


class TrafficView(APIView):
    @extend_schema(operation_id="models_traffic_update", request=TrafficSplit, responses=_TRAFFIC_SCHEMA)
    @transaction.atomic
    def put(self, request: Request, model: str) -> Response:
        found = _editable_model(request, model)
        body = read_body(request, TrafficSplit)
        in_flight = deployment_in_flight(model=found)
        if in_flight is not None:
            raise Refused(
                409,
                f"deployment {in_flight.pk} of {found.name} is in flight ({in_flight.state}): it moves the "
                "traffic until it ends; roll it back or promote it first",
            )
        try:
            table = routing_table_set(model=found, weights=body["weights"], actor=caller_actor(request))
        except RegistryError as exc:
            raise Refused(400, str(exc)) from None
        weights = dict(table.entries.filter(weight__gt=0).values_list("version__version", "weight"))
        return Response({"model": found.name, "revision": table.revision, "weights": weights})
