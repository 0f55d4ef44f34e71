"""Deployment endpoints under /v1/. Thin: authorize, call one service or selector, format.

Allowed to staff (session) and to tenants whose quota has may_deploy, on models they own and on the
platform's models granted them (Quota.deployable_models; TenantContext.may_deploy_to: being allowed to
use a model is not enough); anyone else gets 403, an unknown model or deployment, or another tenant's
model, 404.
Refusals use the one error shape (registry.errors)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from registry import api as registry_api
from registry.bodies import Refused, json_body
from registry.callers import caller_actor
from registry.models import Model, is_valid_name
from registry.selectors import TenantContext
from rollouts import judge_lease, selectors, services, steps
from rollouts.models import Deployment

logger = logging.getLogger(__name__)

CREATE_FIELDS = frozenset(
    {"model", "version", "strategy", "steps", "bake_seconds", "thresholds", "mirror_pct", "quality_floor"}
)


def _actor(request: Request) -> str:
    return caller_actor(request)  # one spelling of who, with the audit log's


def _authorize(request: Request, model: Model | None = None) -> None:
    """Without a model: may the caller deploy anything at all? With one: that model too?"""
    context = request.auth if isinstance(request.auth, TenantContext) else None
    if context is None:
        if not getattr(request.user, "is_staff", False):
            raise PermissionDenied("deployments are for staff and for tenants allowed to deploy")
        return
    if not context.may_deploy:
        raise PermissionDenied(f"tenant {context.tenant_name!r} may not deploy")
    if model is None or context.may_deploy_to(model.name, owner_id=model.owner_id):
        return
    if not context.may_use(model.name, owner_id=model.owner_id):
        # As the registry answers for it: a model this tenant may not use does not exist for it (a 403
        # would name a platform model its quota keeps from it, and by deployment id, every one).
        raise NotFound(f"model {model.name!r} not found")
    raise PermissionDenied(
        f"tenant {context.tenant_name!r} may not deploy {model.name!r}: a tenant deploys its own models "
        "(registered with --owner) and the platform's granted it (create_tenant --deploy-model)"
    )


def _deployment(request: Request, deployment_id: int) -> Deployment:
    _authorize(request)
    deployment = selectors.deployment_get(deployment_id=deployment_id)
    if deployment is None:
        raise NotFound(f"deployment {deployment_id} not found")
    try:
        _authorize(request, deployment.model)
    except NotFound:  # another tenant's model: its deployments' ids name nothing either
        raise NotFound(f"deployment {deployment_id} not found") from None
    return deployment


def _accepted(deployment: Deployment) -> Response:
    body: dict[str, Any] = {"deployment_id": deployment.pk, "state": deployment.state}
    if deployment.rollback_decided_at is not None:
        body["rollback"] = {
            "decided_at": deployment.rollback_decided_at,
            "edit_ms": deployment.rollback_edit_ms,
        }
    return Response(
        body, status=status.HTTP_202_ACCEPTED, headers={"Location": f"/v1/deployments/{deployment.pk}"}
    )


_ACCEPTED_SCHEMA = inline_serializer(
    "DeploymentAccepted", {"deployment_id": serializers.IntegerField(), "state": serializers.CharField()}
)
# A canary's floor on its candidate's recorded evaluation against its parent (rollouts/quality_floor.py).
_QUALITY_FLOOR_SCHEMA = inline_serializer(
    "QualityFloor",
    {
        "min_greedy_agreement": serializers.FloatField(
            min_value=0, max_value=1, allow_null=True, required=False
        ),
        "max_perplexity_increase": serializers.FloatField(min_value=0, allow_null=True, required=False),
    },
    required=False,
)
_CREATE_SCHEMA = inline_serializer(
    "DeploymentCreate",
    {
        "model": serializers.CharField(),
        "version": serializers.CharField(),
        "strategy": serializers.ChoiceField(choices=Deployment.Strategy.values, required=False),
        "steps": serializers.ListField(child=serializers.DictField(), required=False),
        "bake_seconds": serializers.IntegerField(min_value=0, required=False),
        "thresholds": serializers.DictField(required=False),
        "mirror_pct": serializers.IntegerField(min_value=1, max_value=100, required=False),
        "quality_floor": _QUALITY_FLOOR_SCHEMA,
    },
)
_ACTION_SCHEMA = inline_serializer("DeploymentAction", {"reason": serializers.CharField(required=False)})


# A page of the deployments list: OpenAI's list shape, newest first, `after` a cursor (a deployment id).
DEFAULT_PAGE, MAX_PAGE = 20, 100
_SUMMARY_FIELDS = {
    "deployment_id": serializers.IntegerField(),
    "model": serializers.CharField(),
    "version": serializers.CharField(),
    "incumbent": serializers.CharField(),
    "strategy": serializers.CharField(),
    "state": serializers.CharField(),
    "current_pct": serializers.IntegerField(),
    "created_by": serializers.CharField(),
    "created_at": serializers.DateTimeField(),
    "finished_at": serializers.DateTimeField(allow_null=True),
}
_PAGE_SCHEMA = inline_serializer(
    "DeploymentPage",
    {
        "object": serializers.CharField(),
        "data": inline_serializer("DeploymentSummary", _SUMMARY_FIELDS, many=True),
        "has_more": serializers.BooleanField(),
        "first_id": serializers.IntegerField(allow_null=True),
        "last_id": serializers.IntegerField(allow_null=True),
    },
)


def _page_params(request: Request) -> tuple[int | None, int]:
    """`after` and `limit` from the query, or a 400 naming the one that is wrong."""
    after_text, limit_text = request.query_params.get("after"), request.query_params.get("limit")
    if after_text is not None and not after_text.isdigit():
        raise Refused(400, "after must be a deployment id (a positive integer)")
    if limit_text is not None and not (limit_text.isdigit() and 1 <= int(limit_text) <= MAX_PAGE):
        raise Refused(400, f"limit must be an integer from 1 to {MAX_PAGE}")
    return (int(after_text) if after_text else None), (int(limit_text) if limit_text else DEFAULT_PAGE)


class DeploymentListView(APIView):
    @extend_schema(
        operation_id="deployments_list",
        parameters=[
            OpenApiParameter("after", int, description="the last deployment id of the page before"),
            OpenApiParameter("limit", int, description=f"1 to {MAX_PAGE} (default {DEFAULT_PAGE})"),
        ],
        responses={200: _PAGE_SCHEMA},
    )
    def get(self, request: Request) -> Response:
        """The deployments the caller may act on, newest first: staff every one, a tenant those of its
        own models and of the platform's granted it."""
        _authorize(request)
        after, limit = _page_params(request)
        context = request.auth if isinstance(request.auth, TenantContext) else None
        viewer = _actor(request) if context is not None else None
        rows, has_more = selectors.deployment_page(context=context, after=after, limit=limit)
        data = [selectors.deployment_summary(deployment=d, viewer=viewer) for d in rows]
        return Response(
            {
                "object": "list",
                "data": data,
                "has_more": has_more,
                "first_id": data[0]["deployment_id"] if data else None,
                "last_id": data[-1]["deployment_id"] if data else None,
            }
        )

    @extend_schema(
        operation_id="deployments_create", request=_CREATE_SCHEMA, responses={202: _ACCEPTED_SCHEMA}
    )
    def post(self, request: Request) -> Response:
        _authorize(request)
        body = json_body(request)
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        unknown = sorted(set(body) - CREATE_FIELDS)
        if unknown:
            raise Refused(400, f"unknown field(s): {', '.join(unknown)}")
        for name in ("model", "version"):
            if not isinstance(body.get(name), str) or not body[name]:
                raise Refused(400, f"{name} is required (a string)")
        model = Model.objects.filter(name=body["model"]).first() if is_valid_name(body["model"]) else None
        if model is None:
            raise NotFound(f"model {body['model']!r} not found")
        _authorize(request, model)
        try:
            deployment = services.deployment_create(
                model=model,
                version=body["version"],
                created_by=_actor(request),
                strategy=body.get("strategy", Deployment.Strategy.CANARY),
                steps=body.get("steps"),
                bake_seconds=body.get("bake_seconds"),
                thresholds=body.get("thresholds"),
                mirror_pct=body.get("mirror_pct"),
                quality_floor=body.get("quality_floor"),
            )
        except steps.DeploymentError as exc:
            raise Refused(exc.status, str(exc)) from exc
        if not judge_lease.is_running():  # in the server's log, where whoever started it looks
            logger.warning(
                "deployment %s: no rollout judge is running on this database, so it will not move. %s",
                deployment.pk,
                judge_lease.MISSING_JUDGE,
            )
        return _accepted(deployment)


class DeploymentDetailView(APIView):
    @extend_schema(
        responses=inline_serializer(
            "Deployment",
            {
                **_SUMMARY_FIELDS,
                "current_step": serializers.IntegerField(allow_null=True),
                "steps": serializers.ListField(child=serializers.DictField()),
                "quality_floor": _QUALITY_FLOOR_SCHEMA,
                "waiting_on": serializers.CharField(allow_null=True),
                "events": serializers.ListField(child=serializers.DictField()),
            },
        )
    )
    def get(self, request: Request, deployment_id: int) -> Response:
        viewer = _actor(request) if isinstance(request.auth, TenantContext) else None
        detail = selectors.deployment_detail(deployment=_deployment(request, deployment_id), viewer=viewer)
        return Response(detail)


def _reason(request: Request) -> str:
    body = json_body(request)
    body = body if isinstance(body, dict) else {}
    reason = body.get("reason", "")
    return reason[:500] if isinstance(reason, str) else ""


# POST …/rollback and …/promote: one services call on the deployment, refusals as the JSON error. (A
# comment, not a docstring: drf-spectacular would publish a docstring as both endpoints' description.)
class _DeploymentActionView(APIView):
    # Not `action`: DRF and drf-spectacular read that name as a viewset action.
    deployment_action: Callable[..., Deployment]

    @extend_schema(request=_ACTION_SCHEMA, responses={202: _ACCEPTED_SCHEMA})
    def post(self, request: Request, deployment_id: int) -> Response:
        deployment = _deployment(request, deployment_id)
        try:
            deployment = type(self).deployment_action(
                deployment=deployment, actor=_actor(request), reason=_reason(request)
            )
        except steps.DeploymentError as exc:
            raise Refused(exc.status, str(exc)) from exc
        return _accepted(deployment)


class DeploymentRollbackView(_DeploymentActionView):
    deployment_action = staticmethod(services.deployment_rollback)


class DeploymentPromoteView(_DeploymentActionView):
    deployment_action = staticmethod(services.deployment_promote)


class ModelVersionListView(registry_api.ModelVersionListView):
    """The registry's /v1/models/{model}/versions with each version's state from deployments merged in
    (routed before the registry's own view: the registry may not import rollouts)."""

    @extend_schema(
        operation_id="models_versions_list",
        responses=inline_serializer(
            "ModelVersionWithDeploymentState",
            many=True,
            fields={
                "version": serializers.CharField(),
                "traffic_pct": serializers.IntegerField(),
                "state": serializers.CharField(
                    help_text="serving / idle, or from deployments: pending, provisioning, ramping, "
                    "shadowing, promoted, completed, rolling_back, rolled_back, incumbent"
                ),
                "aliases": serializers.ListField(child=serializers.CharField()),
                "sha256": serializers.CharField(),
                "created_at": serializers.DateTimeField(),
                "parent": serializers.CharField(allow_null=True),
                "quantization": serializers.CharField(allow_null=True),
                "quality": serializers.DictField(allow_null=True),
            },
        ),
    )
    def get(self, request: Request, model: str) -> Response:
        response = super().get(request, model)  # 404 for a model the caller may not see
        states = selectors.version_states(model=Model.objects.get(name=model))
        for row in response.data:
            row["state"] = states.get(row["version"], row["state"])
        return response
