"""What the audit log keeps of each registry object (audit.log.Snapshot): its name, and the fields a change
to it is about. One function per object type, used by the services and by the admin alike, so an entry
reads the same whichever path made the change. Never a secret: an API key is its prefix, not the key nor
its hash."""

from __future__ import annotations

from audit.log import ObjectType, Snapshot
from registry.models import Alias, ApiKey, Model, ModelVersion, Quota, RoutingEntry, RoutingTable, Tenant


def model(row: Model) -> Snapshot:
    owner = row.owner.name if row.owner is not None else None
    return Snapshot(ObjectType.MODEL, row.name, {"kind": row.kind, "owner": owner})


def model_version(row: ModelVersion, *, traffic_pct: int) -> Snapshot:
    return Snapshot(
        ObjectType.MODEL_VERSION,
        f"{row.model.name}:{row.version}",
        {
            "sha256": row.sha256,
            "size_bytes": row.size_bytes,
            "parent": row.parent.version if row.parent is not None else None,
            "created_by": row.created_by,
            "traffic_pct": traffic_pct,
        },
    )


def alias(row: Alias) -> Snapshot:
    return Snapshot(ObjectType.ALIAS, f"{row.model.name}@{row.name}", {"version": row.version.version})


def routing_table(of: Model) -> Snapshot:
    """The model's traffic as gateways route it: each version's share above 0, and the mirror."""
    table = RoutingTable.objects.filter(model=of).select_related("mirror_version").first()
    weights = dict(
        RoutingEntry.objects.filter(table__model=of, weight__gt=0)
        .order_by("version__version")
        .values_list("version__version", "weight")
    )
    mirror = None
    if table is not None and table.mirror_version is not None and table.mirror_pct > 0:
        mirror = {"version": table.mirror_version.version, "pct": table.mirror_pct}
    return Snapshot(ObjectType.ROUTING_TABLE, of.name, {"weights": weights, "mirror": mirror})


def tenant(row: Tenant) -> Snapshot:
    return Snapshot(
        ObjectType.TENANT,
        row.name,
        {"name": row.name, "is_active": row.is_active, "prefix_cache_group": row.prefix_cache_group},
    )


def quota(row: Quota) -> Snapshot:
    return Snapshot(
        ObjectType.QUOTA,
        row.tenant.name,
        {
            "requests_per_second": row.requests_per_second,
            "tokens_per_minute": row.tokens_per_minute,
            "max_concurrent_requests": row.max_concurrent_requests,
            "may_pin": row.may_pin,
            "may_deploy": row.may_deploy,
            "max_service_tier": row.max_service_tier,
            "ttft_objective_ms": row.ttft_objective_ms,
            "tpot_objective_ms": row.tpot_objective_ms,
            "max_running_sequences": row.max_running_sequences,
            "kv_share": row.kv_share,
            "allowed_models": sorted(m.name for m in row.allowed_models.all()),
            "deployable_models": sorted(m.name for m in row.deployable_models.all()),
        },
    )


def api_key(row: ApiKey) -> Snapshot:
    return Snapshot(
        ObjectType.API_KEY,
        row.prefix,
        {
            "id": row.pk,  # two keys may share a prefix
            "tenant": row.tenant.name,
            "name": row.name,
            "revoked_at": row.revoked_at.isoformat() if row.revoked_at is not None else None,
        },
    )
