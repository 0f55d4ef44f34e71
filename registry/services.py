"""Writes to the registry. Keyword-only, typed, one transaction each. Each change is recorded in the audit
log (audit.log.record) in its transaction, with the actor the caller names: every path (the API, the
dashboard, the admin's actions, the commands, the rollouts) comes through here, so each change is
recorded once."""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import shutil
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone

from audit import actors
from audit.log import Action, record
from registry import adapters, artifacts, quotas, snapshots
from registry.chat_template import check_chat_template
from registry.models import (
    Alias,
    AliasEvent,
    ApiKey,
    Model,
    ModelVersion,
    Quota,
    RoutingEntry,
    RoutingTable,
    ServiceTier,
    Tenant,
    is_valid_name,
)
from registry.quotas import KEEP, QuotaChange

logger = logging.getLogger(__name__)

STABLE_ALIAS = "stable"
API_KEY_PREFIX = "sy-"
WHOLE_KEY_LENGTH = len(API_KEY_PREFIX) + 43  # secrets.token_urlsafe(32): 32 bytes in unpadded base64


class RegistryError(Exception):
    """A request the registry refuses; the message says why in one line."""


class AlreadyExists(RegistryError):
    pass


def hash_api_key(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def model_version_register(
    *,
    name: str,
    version: str,
    source_dir: Path,
    kind: str = Model.Kind.CAUSAL_LM,
    created_by: str = "",
    parent: ModelVersion | None = None,
    owner: Tenant | None = None,
    actor: str = "",
    adapter_of: ModelVersion | None = None,
    quantization: str = "",
) -> ModelVersion:
    """Copy a model directory into the artifact store and record it. The first version of a model
    becomes its `stable` alias with all of its traffic; later ones start at 0%. `owner`: the tenant
    whose model a new one is (it may deploy it); for a model that exists, it must be its owner.
    `actor`: who, for the audit log and the alias's history (default: `created_by`). `adapter_of`: the
    base version a LoRA adapter directory applies to (registry/adapters.py); an adapter model's versions
    are all adapters, served on their bases' replicas. `quantization`: how a quantized sibling's weights
    were made from its `parent` (serving/management/commands/quantize.py)."""
    for field, value in (("name", name), ("version", version)):
        try:
            Model._meta.get_field("name").run_validators(value)
        except Exception as exc:
            raise RegistryError(
                f"invalid {field} {value!r}: {' '.join(getattr(exc, 'messages', []))}"
            ) from None
    root = Path(settings.ARTIFACT_ROOT)
    final_dir = root / name / version
    model = _check_registrable(
        name=name, version=version, kind=kind, owner=owner, final_dir=final_dir, adapter_of=adapter_of
    )
    if adapter_of is not None:  # the adapter's owner: the one named, or the model's
        adapters.check_base(adapter_of, owner_id=owner.pk if owner else model.owner_id if model else None)
    # The copy and its hashing take minutes for a large model, so they happen before the transaction:
    # on SQLite a transaction holds the database's one write lock from its start, and every other
    # writer (a rollback, the judge, the replicas' metrics) would wait for the copy and then fail.
    adapter_config = {"config_name": adapters.ADAPTER_CONFIG} if adapter_of is not None else {}
    staging, manifest = artifacts.stage_copy(Path(source_dir), root, **adapter_config)
    try:
        if adapter_of is not None:  # the copy, as below: what the digests cover is what was checked
            adapters.check_adapter(staging, adapter_of)
        else:
            artifacts.check_kind(staging, kind)
            check_chat_template(staging)  # the copy: what the digests cover is what was rendered
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    record = functools.partial(
        _record_version,
        name=name,
        version=version,
        kind=kind,
        owner=owner,
        parent=parent,
        adapter_of=adapter_of,
        quantization=quantization,
        created_by=created_by,
        actor=actor or created_by or actors.SYSTEM,
        manifest=manifest,
        staging=staging,
        final_dir=final_dir,
    )
    try:
        try:
            return record()
        except IntegrityError:
            if not staging.exists():
                raise  # moved into place already: the commit failed (Postgres checks foreign keys then)
            # Another registration committed the same new model meanwhile (Postgres lets both check,
            # then one insert waits for the other's): again, against what it wrote. The same version is
            # then AlreadyExists, another version of it is added.
            return record()
    except BaseException:
        moved = not staging.exists()  # the move is the transaction's last step
        shutil.rmtree(staging, ignore_errors=True)
        if moved:  # else the directory, if any, is another registration's
            _remove_if_unrecorded(final_dir, name=name, version=version)
        raise


def _remove_if_unrecorded(final_dir: Path, *, name: str, version: str) -> None:
    """After a failure: the artifact this registration moved into place, by a transaction whose commit
    then failed, has no rows, and would refuse every later registration of the version ("already exists
    in the artifact store"). Removed only when the database says for certain that the version is not
    registered: a commit whose outcome is unknown keeps it."""
    try:
        registered = ModelVersion.objects.filter(model__name=name, version=version).exists()
    except Exception:
        return
    if not registered:
        shutil.rmtree(final_dir, ignore_errors=True)


@transaction.atomic
def _record_version(
    *,
    name: str,
    version: str,
    kind: str,
    owner: Tenant | None,
    parent: ModelVersion | None,
    adapter_of: ModelVersion | None,
    quantization: str,
    created_by: str,
    actor: str,
    manifest: artifacts.ArtifactManifest,
    staging: Path,
    final_dir: Path,
) -> ModelVersion:
    """model_version_register's rows, with its checks again (the copy took a while), then the staged
    copy moved into place."""
    model = _check_registrable(
        name=name, version=version, kind=kind, owner=owner, final_dir=final_dir, adapter_of=adapter_of
    )
    if model is None:
        model = Model.objects.create(name=name, kind=kind, owner=owner)
        record(actor=actor, action=Action.CREATE, before=None, after=snapshots.model(model))
    model_version = ModelVersion.objects.create(
        model=model,
        version=version,
        artifact_uri=str(final_dir),
        sha256=manifest.sha256,
        format=ModelVersion.Format.SAFETENSORS,
        size_bytes=manifest.size_bytes,
        files=manifest.files,
        parent=parent,
        adapter_of=adapter_of,
        quantization=quantization,
        created_by=created_by,
    )
    table, _ = RoutingTable.objects.get_or_create(model=model)
    is_first = not table.entries.exists()
    RoutingEntry.objects.create(table=table, version=model_version, weight=100 if is_first else 0)
    after = snapshots.model_version(model_version, traffic_pct=100 if is_first else 0)
    record(actor=actor, action=Action.CREATE, before=None, after=after)
    routing_changed(model=model)
    if is_first:
        alias_set(
            model=model,
            name=STABLE_ALIAS,
            version=model_version,
            actor=actor,
            reason="first version registered",
        )
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(final_dir)
    return model_version


def _check_registrable(
    *,
    name: str,
    version: str,
    kind: str,
    owner: Tenant | None,
    final_dir: Path,
    adapter_of: ModelVersion | None = None,
) -> Model | None:
    """The model `name` (None if new) when `version` may be added to it, its files to `final_dir`; else
    the registry's refusal."""
    model = Model.objects.filter(name=name).first()
    if model is not None and model.versions.filter(version=version).exists():
        raise AlreadyExists(f"{name}:{version} is already registered")
    if model is not None and model.kind != kind:
        raise RegistryError(f"{name} is a {model.kind} model; cannot add a {kind} version")
    if model is not None and owner is not None and model.owner_id != owner.pk:
        raise RegistryError(f"{name} is not owned by tenant {owner.name!r}")
    if adapter_of is not None and kind != Model.Kind.CAUSAL_LM:
        raise RegistryError(f"an adapter is a causal-lm model, not a {kind} one")
    # An adapter model's versions are all adapters (served on their bases' replicas), a model's none.
    if model is not None and model.versions.filter(adapter_of__isnull=adapter_of is not None).exists():
        has = "LoRA adapters" if adapter_of is None else "full models"
        raise RegistryError(f"{name}'s versions are {has}; register this version as a new model")
    if final_dir.exists():
        raise AlreadyExists(f"{final_dir} already exists in the artifact store")
    return model


def routing_changed(*, model: Model) -> None:
    """Something a gateway routes the model by changed (its table, an alias, its scaling bounds): move
    its revision, so every gateway's cache reads the model afresh within a second."""
    RoutingTable.objects.filter(model=model).update(revision=F("revision") + 1)


@transaction.atomic
def alias_set(*, model: Model, name: str, version: ModelVersion, actor: str, reason: str = "") -> Alias:
    if version.model_id != model.pk:
        raise RegistryError(f"version {version.version} belongs to {version.model.name}, not {model.name}")
    alias = Alias.objects.select_for_update().filter(model=model, name=name).first()
    previous = alias.version if alias is not None else None
    before = snapshots.alias(alias) if alias is not None else None
    if alias is None:
        alias = Alias.objects.create(model=model, name=name, version=version)
    elif alias.version_id != version.pk:
        alias.version = version
        alias.save(update_fields=["version", "updated_at"])
    else:
        return alias
    AliasEvent.objects.create(
        alias=alias, from_version=previous, to_version=version, actor=actor, reason=reason
    )
    action = Action.CREATE if before is None else Action.UPDATE
    record(actor=actor, action=action, before=before, after=snapshots.alias(alias), reason=reason)
    routing_changed(model=model)
    return alias


@transaction.atomic
def routing_table_set(
    *, model: Model, weights: Mapping[str, int], actor: str = actors.SYSTEM, reason: str = ""
) -> RoutingTable:
    """Replace a model's traffic split; weights are whole percentages summing to 100."""
    if any(isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= 100 for w in weights.values()):
        raise RegistryError("each weight must be an integer percentage from 0 to 100")
    if sum(weights.values()) != 100:
        raise RegistryError(f"weights must sum to 100, got {sum(weights.values())}")
    # Only names a version could have: Postgres refuses a NUL in a query (a 500, not this 400).
    named = [name for name in weights if is_valid_name(name)]
    versions = {v.version: v for v in model.versions.filter(version__in=named)}
    unknown = sorted(set(weights) - set(versions))
    if unknown:
        raise RegistryError(f"unknown version(s) of {model.name}: {', '.join(unknown)}")
    table, _ = RoutingTable.objects.select_for_update().get_or_create(model=model)
    before = snapshots.routing_table(model)
    table.entries.exclude(version__version__in=list(weights)).update(weight=0)
    for name, weight in weights.items():
        RoutingEntry.objects.update_or_create(
            table=table, version=versions[name], defaults={"weight": weight}
        )
    routing_changed(model=model)
    record(
        actor=actor, action=Action.UPDATE, before=before, after=snapshots.routing_table(model), reason=reason
    )
    table.refresh_from_db()
    return table


@transaction.atomic
def routing_mirror_set(
    *,
    model: Model,
    version: ModelVersion | None,
    pct: int = 0,
    actor: str = actors.SYSTEM,
    reason: str = "",
) -> RoutingTable:
    """Copy `pct`% of the model's requests (those served by any other version) to `version`, output
    discarded; `version=None` stops mirroring. Gateways pick it up with the routing table."""
    if version is None:
        pct = 0
    elif version.model_id != model.pk:
        raise RegistryError(f"version {version.version} is not a version of {model.name}")
    elif isinstance(pct, bool) or not isinstance(pct, int) or not 1 <= pct <= 100:
        raise RegistryError(f"mirror percentage must be an integer from 1 to 100, got {pct!r}")
    table, _ = RoutingTable.objects.select_for_update().get_or_create(model=model)
    before = snapshots.routing_table(model)
    RoutingTable.objects.filter(pk=table.pk).update(
        mirror_version=version, mirror_pct=pct, revision=F("revision") + 1
    )
    record(
        actor=actor, action=Action.UPDATE, before=before, after=snapshots.routing_table(model), reason=reason
    )
    table.refresh_from_db()
    return table


@transaction.atomic
def tenant_create(
    *,
    name: str,
    requests_per_second: float = 10.0,
    tokens_per_minute: int = 100_000,
    max_concurrent_requests: int = 16,
    allowed_models: Iterable[Model] = (),
    may_pin: bool = False,
    may_deploy: bool = False,
    deployable_models: Iterable[Model] = (),
    max_service_tier: str = ServiceTier.DEFAULT,
    ttft_objective_ms: int | None = None,
    tpot_objective_ms: int | None = None,
    max_running_sequences: int | None = None,
    kv_share: float | None = None,
    actor: str = actors.SYSTEM,
) -> Tenant:
    """A tenant with its quota; the quota's settings keep registry.quotas' rules (None: no objective, no
    cap of its own)."""
    try:
        Tenant._meta.get_field("name").run_validators(name)
    except Exception as exc:
        raise RegistryError(
            f"invalid tenant name {name!r}: {' '.join(getattr(exc, 'messages', []))}"
        ) from None
    settings = {
        "requests_per_second": requests_per_second,
        "tokens_per_minute": tokens_per_minute,
        "max_concurrent_requests": max_concurrent_requests,
        "may_pin": may_pin,
        "may_deploy": may_deploy,
        "max_service_tier": max_service_tier,
        "ttft_objective_ms": ttft_objective_ms,
        "tpot_objective_ms": tpot_objective_ms,
        "max_running_sequences": max_running_sequences,
        "kv_share": kv_share,
    }
    if (problem := quotas.first_problem(settings)) is not None:
        raise RegistryError(problem)
    try:
        with transaction.atomic():
            tenant = Tenant.objects.create(name=name)
    except IntegrityError:
        raise AlreadyExists(f"tenant {name} already exists") from None
    quota = Quota.objects.create(tenant=tenant, **settings)
    quota.allowed_models.set(list(allowed_models))
    quota.deployable_models.set(list(deployable_models))
    record(actor=actor, action=Action.CREATE, before=None, after=snapshots.tenant(tenant))
    record(actor=actor, action=Action.CREATE, before=None, after=snapshots.quota(quota))
    return tenant


@transaction.atomic
def quota_set(*, tenant: Tenant, change: QuotaChange, actor: str) -> Quota:
    """Change a tenant's quota (made with the defaults if it has none), or refuse the whole change when
    one of its values breaks registry.quotas' rules. Gateways apply it once their cached copy of the
    tenant's key expires, within seconds."""
    if (problem := change.problem()) is not None:
        raise RegistryError(problem)
    quota = Quota.objects.select_for_update().filter(tenant=tenant).first()
    before = snapshots.quota(quota) if quota is not None else None
    quota = quota or Quota(tenant=tenant)
    for field, value in change.settings().items():
        setattr(quota, field, value)
    quota.save()
    if change.allowed_models is not KEEP:
        quota.allowed_models.set(change.allowed_models)
    if change.deployable_models is not KEEP:
        quota.deployable_models.set(change.deployable_models)
    action = Action.CREATE if before is None else Action.UPDATE
    record(actor=actor, action=action, before=before, after=snapshots.quota(quota))
    return quota


@transaction.atomic
def api_key_revoke(*, key: str, tenant: Tenant | None = None, actor: str = actors.SYSTEM) -> list[ApiKey]:
    """Revoke a live key, given whole (only that key) or by its printed prefix (exactly the stored
    prefix's length: only that much of a key is stored in the clear). A prefix that matches keys of more
    than one tenant, or several keys, is refused unless `tenant` narrows it to that tenant's keys: a typo
    must not revoke someone else's. Gateways stop accepting a revoked key within their auth cache's few
    seconds. Returns the keys revoked."""
    how = f"give the whole key or exactly its first {ApiKey.PREFIX_LENGTH} characters"
    if len(key) < ApiKey.PREFIX_LENGTH:
        raise RegistryError(how)
    live = ApiKey.objects.filter(revoked_at__isnull=True).select_related("tenant")
    if len(key) > ApiKey.PREFIX_LENGTH:
        keys = list(live.filter(key_hash=hash_api_key(key)))
        if not keys and len(key) < WHOLE_KEY_LENGTH:  # a longer prefix, which was taken for a whole key
            raise RegistryError(f"{key} is shorter than a whole key: {how}")
    else:
        keys = list(live.filter(prefix=key, **({"tenant": tenant} if tenant is not None else {})))
        if len(keys) > 1 and tenant is None:
            owners = sorted({k.tenant.name for k in keys})
            raise RegistryError(
                f"{len(keys)} live keys start with {key} (tenants: {', '.join(owners)}); "
                "give the whole key, or the tenant"
            )
    return api_keys_revoke(api_keys=keys, actor=actor)


@transaction.atomic
def api_keys_revoke(*, api_keys: Iterable[ApiKey], actor: str) -> list[ApiKey]:
    """Revoke those of these keys still live, each revocation recorded; returns them."""
    live = list(
        ApiKey.objects.select_for_update(of=("self",))
        .filter(pk__in=[k.pk for k in api_keys], revoked_at__isnull=True)
        .select_related("tenant")
        .order_by("pk")
    )
    now = timezone.now()
    for api_key in live:
        before = snapshots.api_key(api_key)
        api_key.revoked_at = now
        api_key.save(update_fields=["revoked_at"])
        record(actor=actor, action=Action.REVOKE, before=before, after=snapshots.api_key(api_key))
    return live


@transaction.atomic
def api_key_create(*, tenant: Tenant, name: str = "", actor: str = actors.SYSTEM) -> tuple[ApiKey, str]:
    """Return the stored record and the raw key; the raw key is never stored and cannot be shown again
    (the audit log keeps its prefix)."""
    raw_key = API_KEY_PREFIX + secrets.token_urlsafe(32)
    api_key = ApiKey.objects.create(
        tenant=tenant,
        name=name,
        prefix=raw_key[: ApiKey.PREFIX_LENGTH],
        key_hash=hash_api_key(raw_key),
    )
    record(actor=actor, action=Action.CREATE, before=None, after=snapshots.api_key(api_key))
    return api_key, raw_key


# A key's last use is written at most once a minute, and never on the request's way: on SQLite a write
# waits for the database's lock (up to its 20 s timeout) behind the metrics flushes and the judge. One
# thread per process writes; a key is handed to it at most once a minute, so a database that refuses
# the write (read-only, locked) costs a warning a minute, not one per lookup.
API_KEY_USE_RESOLUTION = timedelta(minutes=1)
_use_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-key-use")
_use_marked_at: dict[int, float] = {}  # key id -> when this process last handed it over (monotonic)
_use_lock = threading.Lock()


def api_key_mark_used(*, api_key: ApiKey, now: datetime | None = None) -> Future[None] | None:
    """Record, in the background, that the key was just presented, if its record is over a minute old.
    Returns the write's future (None: nothing to write); it never raises."""
    now = now or timezone.now()
    if api_key.last_used_at is not None and now - api_key.last_used_at < API_KEY_USE_RESOLUTION:
        return None
    with _use_lock:
        handed_at = _use_marked_at.get(api_key.pk)
        if handed_at is not None and time.monotonic() - handed_at < API_KEY_USE_RESOLUTION.total_seconds():
            return None  # this process asked for it within the minute: another lookup's record is on its way
        if len(_use_marked_at) > 10_000:
            _use_marked_at.clear()
        _use_marked_at[api_key.pk] = time.monotonic()
    return _use_writer.submit(_write_use, api_key.pk, api_key.prefix, now)


def _write_use(pk: int, prefix: str, now: datetime) -> None:
    try:
        ApiKey.objects.filter(pk=pk).update(last_used_at=now)
    except Exception as exc:  # no one reads the future: what is not logged here is lost
        logger.warning("could not record the use of API key %s…: %r", prefix, exc)
    finally:
        # Not kept open between writes a minute apart: an idle connection would outlive a database
        # restart, and hold up a DROP DATABASE (the test database's teardown).
        connection.close()
