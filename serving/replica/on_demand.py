"""Which versions with traffic an embedded supervisor starts a replica for only when a request asks (a cold
start), as the fleet's autoscaler does: those of a model that scales to zero (its scaling bounds'
min_replicas 0, `manage.py set_scaling MODEL --min 0`) held by nothing but their routing weight or the
`stable` alias. A version another alias names (a deployment's `canary`: it waits for its candidate's
replica) or shadow copies go to keeps one up, as the autoscaler's kept-warm versions do
(docs/architecture.md, "Replicas kept warm"). The seeded demo tenant's own model is one: `make serve`
runs no replica for it until it is used (serving/management/commands/seed_demo.py)."""

from __future__ import annotations

from registry.models import Alias, ModelVersion, RoutingTable
from registry.selectors import VersionRef
from registry.services import STABLE_ALIAS


def started_on_demand(refs: list[VersionRef]) -> set[tuple[str, str]]:
    """Of these versions (versions_to_serve's), those whose replica is started on demand and retired once
    idle, as (model, version)."""
    ids = {ref.version_id for ref in refs}
    # scaling_bounds: rollouts' one-to-one row, read through the relation (no import of rollouts)
    idle_to_zero = set(
        ModelVersion.objects.filter(pk__in=ids, model__scaling_bounds__min_replicas=0).values_list(
            "pk", flat=True
        )
    )
    if not idle_to_zero:
        return set()
    held = set(
        Alias.objects.filter(version_id__in=idle_to_zero)
        .exclude(name=STABLE_ALIAS)
        .values_list("version_id", flat=True)
    )
    held |= set(
        RoutingTable.objects.filter(mirror_version_id__in=idle_to_zero, mirror_pct__gt=0).values_list(
            "mirror_version_id", flat=True
        )
    )
    return {(ref.model_name, ref.version) for ref in refs if ref.version_id in idle_to_zero - held}
