"""What the audit log keeps of a deployment and of a model's scaling bounds (audit.log.Snapshot), as
registry.snapshots does for the registry's objects: the same for every path that changes them."""

from __future__ import annotations

from audit.log import ObjectType, Snapshot
from rollouts.models import Deployment, ScalingBounds


def deployment(row: Deployment) -> Snapshot:
    return Snapshot(
        ObjectType.DEPLOYMENT,
        str(row.pk),
        {
            "model": row.model.name,
            "candidate": row.candidate.version,
            "incumbent": row.incumbent.version,
            "strategy": row.strategy,
            "state": row.state,
            "current_step": row.current_step,
            "current_pct": row.current_pct,
        },
    )


def scaling_bounds(row: ScalingBounds) -> Snapshot:
    return Snapshot(
        ObjectType.SCALING_BOUNDS,
        row.model.name,
        {"min_replicas": row.min_replicas, "max_replicas": row.max_replicas},
    )
