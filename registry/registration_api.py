"""POST /v1/models/{model}/versions: register a version from a directory under the import root
(settings.ARTIFACT_IMPORT_ROOT), through the service `manage.py register_model` calls, with its checks.
Staff may register any model's; a tenant its own model's, and a new model it registers is its own."""

from __future__ import annotations

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from registry import selectors
from registry.artifacts import ArtifactError
from registry.bodies import Refused, read_body
from registry.callers import caller_actor, caller_context, owned_model
from registry.import_root import OutsideImportRoot, import_dir
from registry.models import Model, ModelVersion, Tenant, is_valid_name
from registry.selectors import TenantContext
from registry.services import AlreadyExists, RegistryError, model_version_register


class VersionRegistration(serializers.Serializer):  # type: ignore[type-arg]
    version = serializers.CharField(max_length=63)
    artifact_dir = serializers.CharField(
        max_length=4096, help_text="A model directory under the server's import root, relative to it."
    )
    kind = serializers.ChoiceField(
        choices=Model.Kind.values, required=False, help_text="A new model's; default: causal-lm."
    )
    parent = serializers.CharField(
        max_length=63, required=False, help_text="The version of this model this one was made from."
    )
    owner = serializers.CharField(
        max_length=63,
        required=False,
        help_text="Staff only: a new model's owning tenant (a tenant's new model is its own).",
    )
    adapter_of = serializers.CharField(
        max_length=127,
        required=False,
        help_text="BASE:VERSION: the directory is a PEFT LoRA adapter of that base version, served on its "
        "replicas.",
    )


REGISTERED_SCHEMA = inline_serializer(
    "ModelVersionRegistered",
    {
        "model": serializers.CharField(),
        "version": serializers.CharField(),
        "kind": serializers.CharField(),
        "owner": serializers.CharField(allow_null=True),
        "sha256": serializers.CharField(),
        "size_bytes": serializers.IntegerField(),
        "traffic_pct": serializers.IntegerField(),
        "aliases": serializers.ListField(child=serializers.CharField()),
        "created_by": serializers.CharField(),
        "created_at": serializers.DateTimeField(),
        "adapter_of": serializers.CharField(allow_null=True),
    },
)


def register_version(request: Request, name: str) -> Response:
    """POST /v1/models/{model}/versions: copy a directory under the import root into the artifact store
    as name:version, with the checks `manage.py register_model` makes (the same service)."""
    context = caller_context(request)
    body = read_body(request, VersionRegistration)
    if not is_valid_name(name):
        raise Refused(400, f"invalid model name {name!r}")
    model = owned_model(request, name) if Model.objects.filter(name=name).exists() else None
    owner = _owner(context, body.get("owner"))
    if model is not None and "kind" not in body:
        body["kind"] = model.kind
    parent = None
    if "parent" in body:
        parent = ModelVersion.objects.filter(model=model, version=body["parent"]).first() if model else None
        if parent is None:
            raise Refused(400, f"no version {name}:{body['parent']} to be the parent")
    adapter_of = _base(context, body["adapter_of"]) if "adapter_of" in body else None
    try:
        source = import_dir(body["artifact_dir"])
    except OutsideImportRoot as exc:
        raise PermissionDenied(str(exc)) from None
    except ArtifactError as exc:
        raise Refused(400, str(exc)) from None
    actor = caller_actor(request)
    try:
        registered = model_version_register(
            name=name,
            version=body["version"],
            source_dir=source,
            kind=body.get("kind", Model.Kind.CAUSAL_LM),
            created_by=actor,
            parent=parent,
            owner=owner,
            actor=actor,
            adapter_of=adapter_of,
        )
    except AlreadyExists as exc:
        raise Refused(409, str(exc)) from None
    except (ArtifactError, RegistryError) as exc:
        # The message names the directory as the server sees it: the caller's own path, under the root.
        raise Refused(400, str(exc).replace(str(source), body["artifact_dir"])) from None
    row = next(
        r
        for r in selectors.model_versions_overview(model=registered.model)
        if r["version"] == registered.version
    )
    payload = {
        "model": name,
        "version": registered.version,
        "kind": registered.model.kind,
        "owner": registered.model.owner.name if registered.model.owner is not None else None,
        "sha256": registered.sha256,
        "size_bytes": registered.size_bytes,
        "traffic_pct": row["traffic_pct"],
        "aliases": row["aliases"],
        "created_by": registered.created_by,
        "created_at": registered.created_at,
        "adapter_of": str(registered.adapter_of) if registered.adapter_of is not None else None,
    }
    return Response(
        payload, status=status.HTTP_201_CREATED, headers={"Location": f"/v1/models/{name}/versions"}
    )


def _base(context: TenantContext | None, named: str) -> ModelVersion:
    """An adapter's base version, BASE:VERSION, if the caller may use it (else as if there were none)."""
    name, _, version = named.partition(":")
    base = None
    if is_valid_name(name) and is_valid_name(version):
        base = ModelVersion.objects.filter(model__name=name, version=version).select_related("model").first()
    if base is None or (context is not None and not context.may_use(name, owner_id=base.model.owner_id)):
        raise Refused(400, f"no base version {named!r} (give it as BASE:VERSION)")
    return base


def _owner(context: TenantContext | None, named: str | None) -> Tenant | None:
    """A new model's owner: the calling tenant itself; for staff, the tenant the body names, if any."""
    if context is not None:
        if named is not None and named != context.tenant_name:
            raise PermissionDenied("a tenant's new model is its own: only staff name another owner")
        return Tenant.objects.get(pk=context.tenant_id)
    if named is None:
        return None
    tenant = Tenant.objects.filter(name=named).first() if is_valid_name(named) else None
    if tenant is None:
        raise Refused(400, f"no tenant {named!r} to own the model")
    return tenant
