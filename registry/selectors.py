"""Reads from the registry, shaped for the data plane and the APIs."""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db.models import Prefetch

from registry.models import Alias, ApiKey, Model, ModelVersion, Quota, RoutingEntry, RoutingTable, Tenant
from registry.services import api_key_mark_used, hash_api_key


@dataclass(frozen=True, slots=True)
class TenantContext:
    """What the gateway needs about a caller, read once per request (or from a short cache)."""

    tenant_id: int
    tenant_name: str
    cache_group: str
    requests_per_second: float
    tokens_per_minute: int
    max_concurrent_requests: int
    allowed_model_names: frozenset[str]  # empty: every model but other tenants' own
    may_pin: bool
    may_deploy: bool
    deployable_model_names: frozenset[str] = frozenset()  # platform models it may deploy besides its own
    # The hash of the API key that authenticated it ("" for none): the gateway watches it for
    # revocation while the caller's streams run (serving/gateway/key_watch.py).
    api_key_hash: str = field(default="", compare=False)
    # Service and latency policy (docs/architecture.md, "Service tiers" and "SLO-aware admission"): the
    # highest service_tier it may ask for, its TTFT and TPOT objectives, and its caps inside each replica.
    max_service_tier: str = "default"
    ttft_objective_ms: int | None = None
    tpot_objective_ms: int | None = None
    max_running_sequences: int | None = None
    kv_share: float | None = None

    def may_use(self, model_name: str, *, owner_id: int | None) -> bool:
        """Its own model (Model.owner), and a model the quota names; with none named, any model but
        another tenant's own. An admin shares a tenant's model with another by naming it in that one's
        quota. `owner_id`: the model's owner as of now (the routing cache's, within a second), never a
        copy kept with this context."""
        if owner_id is not None and owner_id == self.tenant_id:
            return True
        if self.allowed_model_names:
            return model_name in self.allowed_model_names
        return owner_id is None

    def may_deploy_to(self, model_name: str, *, owner_id: int | None) -> bool:
        """Its own model, or one of the platform's granted it (Quota.deployable_models): deploying moves
        the traffic of everyone the model serves, so a model that is merely open to it is not enough."""
        if not self.may_deploy:
            return False
        if owner_id is not None:
            return owner_id == self.tenant_id
        return model_name in self.deployable_model_names

    def is_hidden(self, model_name: str, *, owner_id: int | None) -> bool:
        """Another tenant's model this one may not use: answered as if it did not exist."""
        return owner_id not in (None, self.tenant_id) and not self.may_use(model_name, owner_id=owner_id)

    @classmethod
    def unlimited(cls, name: str) -> TenantContext:
        """A caller inside the process with no quota to speak of (the demo's and tests' load
        generators): never a database row, never reachable with an API key."""
        return cls(
            tenant_id=0,
            tenant_name=name,
            cache_group=name,
            requests_per_second=1e6,
            tokens_per_minute=10**9,
            max_concurrent_requests=10_000,
            allowed_model_names=frozenset(),
            may_pin=False,
            may_deploy=False,
        )


@dataclass(frozen=True, slots=True)
class VersionRef:
    model_name: str
    version: str
    version_id: int
    artifact_uri: str
    sha256: str
    files: dict[str, str] = field(hash=False, compare=False)
    kind: str = Model.Kind.CAUSAL_LM
    # A LoRA adapter's base version (None: not an adapter): served by its base's replicas, never loaded
    # as a model.
    adapter_of_id: int | None = None

    @property
    def is_adapter(self) -> bool:
        return self.adapter_of_id is not None


@dataclass(frozen=True, slots=True)
class AdapterTarget:
    """Where a LoRA adapter version's requests run (docs/architecture.md, "Adapters on a shared base"):
    on its base version's replicas, which load its files (checked against its digest) on first use."""

    base_model: str
    base_version: str
    artifact_uri: str
    sha256: str
    version_id: int  # the adapter version's: its requests' metrics are its own


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    model_name: str
    kind: str
    revision: int
    weights: dict[str, int]  # version -> percent; only versions with a weight > 0
    aliases: dict[str, str]  # alias -> version
    versions: frozenset[str]  # every registered version
    mirror: tuple[str, int] | None = None  # (version, percent) that shadow copies go to
    # Its idle versions may have no replica (rollouts.ScalingBounds with min_replicas 0): a request that
    # finds none waits while one starts, where it would otherwise get a 503 at once.
    scales_to_zero: bool = False
    owner_id: int | None = None  # the tenant whose model it is (Model.owner); None: the platform's
    adapters: dict[str, AdapterTarget] = field(default_factory=dict)  # its versions that are LoRA adapters

    def serves(self, version: str) -> bool:
        """Whether the version must have replicas: traffic, an alias or shadow copies (as
        versions_with_traffic)."""
        return (
            self.weights.get(version, 0) > 0
            or version in self.aliases.values()
            or (self.mirror is not None and self.mirror[0] == version)
        )


def tenant_context_for_api_key(raw_key: str) -> TenantContext | None:
    """Resolve a presented key. Candidates are found by their visible prefix; the hashes are then
    compared in constant time, so response timing says nothing about how much of a key matched."""
    # A NUL is in no key, and Postgres refuses it in a query (a DataError, which the gateway would take
    # for the database being down, and answer "try again" to a bad key).
    if not raw_key or len(raw_key) > 256 or "\x00" in raw_key:
        return None
    presented_hash = hash_api_key(raw_key)
    candidates = ApiKey.objects.filter(
        prefix=raw_key[: ApiKey.PREFIX_LENGTH], revoked_at__isnull=True, tenant__is_active=True
    ).select_related("tenant")
    for api_key in candidates:
        if hmac.compare_digest(api_key.key_hash, presented_hash):
            api_key_mark_used(api_key=api_key)  # at most once a minute: the admin's "last used"
            return dataclasses.replace(tenant_context(tenant=api_key.tenant), api_key_hash=presented_hash)
    return None


def live_api_key_hashes(key_hashes: Iterable[str]) -> set[str]:
    """Which of these key hashes still authenticate: not revoked, their tenant active. One query."""
    wanted = set(key_hashes)
    if not wanted:
        return set()
    live = ApiKey.objects.filter(key_hash__in=wanted, revoked_at__isnull=True, tenant__is_active=True)
    return set(live.values_list("key_hash", flat=True))


def tenant_context(*, tenant: Tenant) -> TenantContext:
    quota = (
        Quota.objects.filter(tenant=tenant).prefetch_related("allowed_models", "deployable_models").first()
    )
    allowed: frozenset[str] = frozenset()
    deployable: frozenset[str] = frozenset()
    if quota is None:  # a tenant made by hand in the admin without a quota gets the defaults
        quota = Quota(tenant=tenant)
    else:
        allowed = frozenset(m.name for m in quota.allowed_models.all())
        deployable = frozenset(m.name for m in quota.deployable_models.all())
    return TenantContext(
        tenant_id=tenant.pk,
        tenant_name=tenant.name,
        # Named groups and the default ones apart: a group typed as "tenant:7" must not join tenant 7's
        # own (sharing blocks lets one time the other's prompts).
        cache_group=(
            f"group:{tenant.prefix_cache_group}" if tenant.prefix_cache_group else f"tenant:{tenant.pk}"
        ),
        requests_per_second=quota.requests_per_second,
        tokens_per_minute=quota.tokens_per_minute,
        max_concurrent_requests=quota.max_concurrent_requests,
        allowed_model_names=allowed,
        may_pin=quota.may_pin,
        may_deploy=quota.may_deploy,
        deployable_model_names=deployable,
        max_service_tier=quota.max_service_tier,
        ttft_objective_ms=quota.ttft_objective_ms,
        tpot_objective_ms=quota.tpot_objective_ms,
        max_running_sequences=quota.max_running_sequences,
        kv_share=quota.kv_share,
    )


def routing_revision(*, model_name: str) -> tuple[int, int | None] | None:
    """What a cached RoutingSnapshot is checked against: its table's revision, and the model's owner
    (who may use it), so that an owner changed by any means, not only the admin's form, counts."""
    row = (
        RoutingTable.objects.filter(model__name=model_name).values_list("revision", "model__owner_id").first()
    )
    return (row[0], row[1]) if row is not None else None


def routing_snapshot(*, model_name: str) -> RoutingSnapshot | None:
    model = (
        Model.objects.filter(name=model_name)
        # scaling_bounds: rollouts' one-to-one row, read through the relation (no import of rollouts)
        .select_related("routing_table", "routing_table__mirror_version", "scaling_bounds")
        .prefetch_related(
            Prefetch("aliases", queryset=Alias.objects.select_related("version")),
            Prefetch("versions", queryset=ModelVersion.objects.select_related("adapter_of__model")),
        )
        .first()
    )
    if model is None:
        return None
    table = getattr(model, "routing_table", None)
    entries = (
        RoutingEntry.objects.filter(table=table, weight__gt=0).select_related("version") if table else []
    )
    return RoutingSnapshot(
        model_name=model.name,
        kind=model.kind,
        revision=table.revision if table else 0,
        weights={e.version.version: e.weight for e in entries},
        aliases={a.name: a.version.version for a in model.aliases.all()},
        versions=frozenset(v.version for v in model.versions.all()),
        mirror=(table.mirror_version.version, table.mirror_pct)
        if table is not None and table.mirror_version is not None and table.mirror_pct > 0
        else None,
        scales_to_zero=getattr(model, "scaling_bounds", None) is not None
        and model.scaling_bounds.min_replicas == 0,
        owner_id=model.owner_id,
        adapters={
            v.version: AdapterTarget(
                v.adapter_of.model.name, v.adapter_of.version, v.artifact_uri, v.sha256, v.pk
            )
            for v in model.versions.all()
            if v.adapter_of is not None
        },
    )


def version_ref(*, model_name: str, version: str) -> VersionRef | None:
    mv = ModelVersion.objects.filter(model__name=model_name, version=version).select_related("model").first()
    if mv is None:
        return None
    return _ref(mv)


def _ref(mv: ModelVersion) -> VersionRef:
    return VersionRef(
        model_name=mv.model.name,
        version=mv.version,
        version_id=mv.pk,
        artifact_uri=mv.artifact_uri,
        sha256=mv.sha256,
        files=dict(mv.files),
        kind=mv.model.kind,
        adapter_of_id=mv.adapter_of_id,
    )


def versions_with_traffic() -> list[VersionRef]:
    """Versions that must have a replica: any routing weight above zero, an alias pointing at them, or
    shadow copies going to them."""
    ids = set(RoutingEntry.objects.filter(weight__gt=0).values_list("version_id", flat=True))
    ids |= set(Alias.objects.values_list("version_id", flat=True))
    ids |= set(
        RoutingTable.objects.filter(mirror_version__isnull=False, mirror_pct__gt=0).values_list(
            "mirror_version_id", flat=True
        )
    )
    return [_ref(mv) for mv in ModelVersion.objects.filter(pk__in=ids).select_related("model")]


def versions_to_serve() -> list[VersionRef]:
    """versions_with_traffic as replicas are started for them: an adapter version's requests run on its
    base's replicas, so it stands for its base version (once, however many adapters name it)."""
    refs = versions_with_traffic()
    served = {r.version_id: r for r in refs if r.adapter_of_id is None}
    missing = {r.adapter_of_id for r in refs if r.adapter_of_id is not None} - set(served)
    for mv in ModelVersion.objects.filter(pk__in=missing).select_related("model"):
        served[mv.pk] = _ref(mv)
    return list(served.values())


def models_visible_to(*, context: TenantContext | None) -> list[Model]:
    models = Model.objects.all()
    if context is None:
        return list(models)
    return [m for m in models if context.may_use(m.name, owner_id=m.owner_id)]


def model_versions_overview(*, model: Model) -> list[dict[str, object]]:
    table = getattr(model, "routing_table", None)
    weights = {e.version_id: e.weight for e in table.entries.all()} if table else {}
    aliases: dict[int, list[str]] = {}
    for alias in model.aliases.all():
        aliases.setdefault(alias.version_id, []).append(alias.name)
    rows = []
    # Sorted here rather than by order_by(), which would query again past a prefetch of the versions.
    versions = sorted(model.versions.all(), key=lambda v: (v.created_at, v.pk))
    names = {mv.pk: mv.version for mv in versions}  # a parent is a version of the same model
    for mv in versions:
        pct = weights.get(mv.pk, 0)
        rows.append(
            {
                "version": mv.version,
                "traffic_pct": pct,
                "state": "serving" if pct > 0 else "idle",
                "aliases": sorted(aliases.get(mv.pk, [])),
                "sha256": mv.sha256,
                "created_at": mv.created_at,
                # A quantized sibling: how it was made, from which version, and what it measured
                # against that one (docs/architecture.md, "Quantized siblings"); {} when not measured.
                "parent": names.get(mv.parent_id) if mv.parent_id is not None else None,
                "quantization": mv.quantization or None,
                "quality": mv.quality or None,
            }
        )
    return rows
