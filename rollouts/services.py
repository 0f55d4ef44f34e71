"""Writes for rollouts: create a deployment, roll it back, promote it; and the default readiness hook
the judge asks whether the candidate is up. The judge's tick is rollouts.judge_tick; the writes both
are made of (events, transitions, routing edits, the row lock) are rollouts.transitions.

Every state change writes a DeploymentEvent with its reason and figures, in the same transaction as the
routing or alias edit it describes. Traffic moves only through registry.services (routing_table_set,
alias_set), so the data plane sees a rollout exactly as it sees any routing edit: a new revision, picked
up by every gateway within its revalidation interval (serving.gateway.router.REVALIDATE_S)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.log import Action, record
from registry.models import Alias, Model, ModelVersion, RoutingEntry, RoutingTable, is_valid_name
from registry.services import (
    STABLE_ALIAS,
    RegistryError,
    alias_set,
    routing_mirror_set,
)
from rollouts import snapshots
from rollouts.models import Deployment
from rollouts.steps import (
    MAX_BAKE_SECONDS,
    DeploymentConflict,
    DeploymentError,
    is_int,
    resolve_quality_floor,
    resolve_thresholds,
    validate_steps,
)
from rollouts.transitions import locked, log_event, noted, route, transition
from serving.selectors import embedded_replica_ready, fleet_replica_ready

CANARY_ALIAS = "canary"

State = Deployment.State


# --- the readiness hook -------------------------------------------------------------------------------


def candidate_is_ready(deployment: Deployment) -> bool:
    """Default readiness check (settings.ROLLOUT_READINESS_CHECK): a replica of the candidate reports
    ready. Two sources can say so: the replicas this process hosts itself (embedded mode: the judge runs
    in the server process, next to them), and the heartbeats in Redis (replica processes). A source that
    cannot answer (no runtime here; Redis down, or knowing no replica of this model at all) is skipped;
    when neither can, the old rule stands: the candidate holds the `canary` alias, so the replica
    supervisor has been told to start it, and one tick has passed since. With replica processes only
    (REDIS_URL, no embedded replicas) the heartbeats alone decide, and "cannot tell" is not ready."""
    if settings.REDIS_URL and not settings.EMBEDDED_REPLICAS:
        # Replicas are processes (run_replica, which every provisioner starts), and each publishes
        # heartbeats: only a fresh ready one counts. No heartbeat, or Redis unreadable, is "not yet";
        # the alias rule would send traffic to a version that may not be loaded anywhere.
        return _fleet_replica_ready(deployment) is True
    model_name, version = deployment.model.name, deployment.candidate.version
    base = deployment.candidate.adapter_of  # an adapter is served by its base's replicas
    if base is not None:
        model_name, version = base.model.name, base.version
    answers = [
        answer
        for answer in (embedded_replica_ready(model_name, version), _fleet_replica_ready(deployment))
        if answer is not None
    ]
    if answers:
        return any(answers)
    return Alias.objects.filter(
        model_id=deployment.model_id, name=CANARY_ALIAS, version_id=deployment.candidate_id
    ).exists()


def _fleet_replica_ready(deployment: Deployment) -> bool | None:
    """Does a replica process of the candidate publish a fresh `ready` heartbeat (serving.selectors)? For
    a LoRA adapter, one of its base (docs/architecture.md, "Adapters on a shared base")."""
    base = deployment.candidate.adapter_of
    if base is not None:
        return fleet_replica_ready(base.model.name, base.version, base.version)
    return fleet_replica_ready(
        deployment.model.name, deployment.candidate.version, deployment.incumbent.version
    )


# --- create -------------------------------------------------------------------------------------------


@transaction.atomic
def deployment_create(
    *,
    model: Model,
    version: str,
    created_by: str,
    strategy: str = Deployment.Strategy.CANARY,
    steps: object = None,
    bake_seconds: object = None,
    thresholds: object = None,
    mirror_pct: object = None,
    quality_floor: object = None,
) -> Deployment:
    """Validate everything, then record the deployment and start provisioning: the candidate gets the
    `canary` alias (logged), which makes the replica supervisor start a replica for it without traffic.
    Raises DeploymentError (400) or DeploymentConflict (409) with nothing written."""
    if strategy not in Deployment.Strategy.values:
        raise DeploymentError(f"strategy must be one of {', '.join(Deployment.Strategy.values)}")
    if not isinstance(version, str) or not version:
        raise DeploymentError("version must be a non-empty string")
    if strategy == Deployment.Strategy.CANARY:
        if steps is None:
            steps = [{"pct": pct} for pct in settings.ROLLOUT_DEFAULT_STEPS]
        steps = validate_steps(steps)
        if mirror_pct is not None:
            raise DeploymentError("mirror_pct is for the shadow strategy")
    else:
        if steps is not None:
            raise DeploymentError("a shadow deployment takes mirror_pct, not steps")
        steps = []
        mirror_pct = 100 if mirror_pct is None else mirror_pct
        if not is_int(mirror_pct) or not 1 <= mirror_pct <= 100:  # type: ignore[operator]
            raise DeploymentError(f"mirror_pct must be an integer from 1 to 100, got {mirror_pct!r}")
    bake_seconds = settings.ROLLOUT_BAKE_SECONDS if bake_seconds is None else bake_seconds
    if not is_int(bake_seconds) or not 0 <= bake_seconds <= MAX_BAKE_SECONDS:  # type: ignore[operator]
        raise DeploymentError(
            f"bake_seconds must be a non-negative integer up to {MAX_BAKE_SECONDS}, got {bake_seconds!r}"
        )
    resolved_thresholds = resolve_thresholds(thresholds)
    resolved_floor = resolve_quality_floor(quality_floor)
    if resolved_floor and strategy != Deployment.Strategy.CANARY:
        raise DeploymentError("quality_floor is for the canary strategy (a shadow moves no traffic)")

    model = Model.objects.select_for_update().get(pk=model.pk)  # serializes creates for this model
    candidate = (
        ModelVersion.objects.filter(model=model, version=version).first() if is_valid_name(version) else None
    )
    if candidate is None:
        # Naming the models that do have such a version would show other tenants' models to the caller.
        raise DeploymentError(f"model {model.name!r} has no version {version!r}")
    stable = Alias.objects.filter(model=model, name=STABLE_ALIAS).select_related("version").first()
    if stable is None:
        raise DeploymentConflict(f"model {model.name!r} has no stable version to compare against")
    if stable.version_id == candidate.pk:
        raise DeploymentConflict(f"{model.name}:{version} is already the stable version")
    in_flight = Deployment.objects.filter(model=model, state__in=Deployment.IN_FLIGHT_STATES).first()
    if in_flight is not None:
        raise DeploymentConflict(
            f"model {model.name!r} already has deployment {in_flight.pk} in flight ({in_flight.state})"
        )

    try:
        with transaction.atomic():
            deployment = Deployment.objects.create(
                model=model,
                candidate=candidate,
                incumbent=stable.version,
                strategy=strategy,
                steps=steps,
                mirror_pct=mirror_pct,
                bake_seconds=bake_seconds,
                thresholds=resolved_thresholds,
                quality_floor=resolved_floor,
                state=State.PENDING,
                created_by=created_by,
            )
    except IntegrityError:  # another create won the race past the check above
        raise DeploymentConflict(f"model {model.name!r} already has a deployment in flight") from None
    record(actor=created_by, action=Action.CREATE, before=None, after=snapshots.deployment(deployment))
    plan = (
        " -> ".join(f"{s['pct']}%" for s in steps)  # type: ignore[union-attr]
        if strategy == Deployment.Strategy.CANARY
        else f"mirror {mirror_pct}%"
    )
    log_event(
        deployment,
        from_state="",
        to_state=State.PENDING,
        actor=created_by,
        reason=f"{strategy} of {version} against {stable.version.version}: {plan}, bake {bake_seconds} s",
        figures={"thresholds": resolved_thresholds},
    )
    provision(deployment, actor=created_by)
    return deployment


def provision(deployment: Deployment, *, actor: str) -> None:
    """Point the canary alias at the candidate; the judge's tick then waits for its replicas."""
    alias_set(
        model=deployment.model,
        name=CANARY_ALIAS,
        version=deployment.candidate,
        actor=actor,
        reason=f"deployment {deployment.pk}: provision the candidate",
    )
    deployment.provisioning_started_at = timezone.now()
    transition(
        deployment,
        State.PROVISIONING,
        actor=actor,
        reason=f"canary alias -> {deployment.candidate.version}; waiting for a ready replica",
    )


# --- rollback and promote -----------------------------------------------------------------------------


def _stop_mirroring(deployment: Deployment, *, actor: str) -> None:
    if RoutingTable.objects.filter(model=deployment.model, mirror_version=deployment.candidate).exists():
        routing_mirror_set(
            model=deployment.model, version=None, actor=actor, reason=f"deployment {deployment.pk}"
        )


def park_canary_alias(deployment: Deployment, *, actor: str, outcome: str) -> None:
    """Point `canary` back at the incumbent (logged), so the candidate keeps no alias and, with no
    traffic either, its replicas drain. (Deleting the alias would delete its logged history.) A shadow
    deployment's mirroring stops with it."""
    _stop_mirroring(deployment, actor=actor)
    alias = Alias.objects.filter(model=deployment.model, name=CANARY_ALIAS).first()
    if alias is not None and alias.version_id == deployment.candidate_id:
        alias_set(
            model=deployment.model,
            name=CANARY_ALIAS,
            version=deployment.incumbent,
            actor=actor,
            reason=f"deployment {deployment.pk} {outcome}; candidate released",
        )


def roll_back(
    deployment: Deployment, *, actor: str, reason: str, figures: dict[str, Any], now: dt.datetime
) -> None:
    """The rollback itself, inside a transaction that holds the deployment's row (locked()): the
    operator's deployment_rollback() and the judge's tick both end here."""
    decided_at = now
    # Before its first step the table is still the operator's (a split between older versions, say):
    # routing it all to the incumbent would drop the rest. Only a share the candidate was given by hand
    # moves, to the incumbent, since the candidate is being rolled back.
    ramped = deployment.state not in (State.PENDING, State.PROVISIONING)
    transition(deployment, State.ROLLING_BACK, actor=actor, reason=reason, figures=figures, at=decided_at)
    # Aliases first, the routing edit last: all of it commits at once, and the revision recorded is then
    # the one gateways will see.
    park_canary_alias(deployment, actor=actor, outcome="rolled back")
    edit: dict[str, Any] = {}
    what = "mirroring stopped; traffic was never moved"
    if deployment.strategy == Deployment.Strategy.CANARY and not ramped:
        weights = dict(
            RoutingEntry.objects.filter(table__model=deployment.model, weight__gt=0).values_list(
                "version__version", "weight"
            )
        )
        moved = weights.pop(deployment.candidate.version, 0)
        what = "the candidate never ramped; routing left as it was"
        if moved:
            incumbent = deployment.incumbent.version
            weights[incumbent] = weights.get(incumbent, 0) + moved
            edit = route(deployment, weights, actor=actor)
            what = (
                f"the candidate's {moved}% (not the deployment's) to {incumbent}, the rest as it was "
                + noted(edit)
            )
    elif deployment.strategy == Deployment.Strategy.CANARY:
        stable = Alias.objects.filter(model=deployment.model, name=STABLE_ALIAS).first()
        if stable is not None and stable.version_id != deployment.incumbent_id:
            alias_set(
                model=deployment.model,
                name=STABLE_ALIAS,
                version=deployment.incumbent,
                actor=actor,
                reason=f"deployment {deployment.pk} rolled back",
            )
        edit = route(deployment, {deployment.incumbent.version: 100}, actor=actor)
        what = f"traffic 100% to {deployment.incumbent.version} {noted(edit)}"
    deployment.rollback_decided_at = decided_at
    deployment.rollback_edit_ms = edit.get("edit_ms")
    deployment.finished_at = timezone.now()
    transition(deployment, State.ROLLED_BACK, actor=actor, reason=what, figures=edit)
    deployment_id = deployment.pk
    transaction.on_commit(
        lambda: Deployment.objects.filter(pk=deployment_id).update(rollback_committed_at=timezone.now())
    )


def promote(
    deployment: Deployment, *, actor: str, reason: str, figures: dict[str, Any], now: dt.datetime
) -> None:
    """The promotion itself, under the row's lock as roll_back(): from deployment_promote() or the tick."""
    _stop_mirroring(deployment, actor=actor)
    alias_set(
        model=deployment.model,
        name=STABLE_ALIAS,
        version=deployment.candidate,
        actor=actor,
        reason=f"deployment {deployment.pk} promoted",
    )
    edit = route(deployment, {deployment.candidate.version: 100}, actor=actor)
    if deployment.steps:
        deployment.current_step = len(deployment.steps) - 1
    deployment.finished_at = now
    transition(
        deployment,
        State.PROMOTED,
        actor=actor,
        reason=f"{reason}; 100% to {deployment.candidate.version}, stable alias "
        f"{deployment.incumbent.version} -> {deployment.candidate.version}",
        figures={**figures, **edit},
        at=now,
    )


def _refuse_unless_in_flight(deployment: Deployment, action: str) -> None:
    if not deployment.is_in_flight:
        raise DeploymentConflict(f"deployment {deployment.pk} is {deployment.state}; cannot {action} it")


@transaction.atomic
def deployment_rollback(*, deployment: Deployment, actor: str, reason: str = "") -> Deployment:
    """Send all traffic back to the incumbent now (one routing edit) and release the candidate. Before
    the first step, only what the candidate was given by hand goes back, and the rest stays."""
    decided_at = timezone.now()
    deployment = locked(deployment)
    _refuse_unless_in_flight(deployment, "roll back")
    roll_back(
        # The default names no one: the event's actor says who, as each reader may know it (a tenant
        # sharing a platform model sees neither another tenant's name nor a staff login).
        deployment,
        actor=actor,
        reason=reason or "rollback requested",
        figures={},
        now=decided_at,
    )
    return deployment


@transaction.atomic
def deployment_promote(*, deployment: Deployment, actor: str, reason: str = "") -> Deployment:
    """Skip the remaining steps: 100% to the candidate and the `stable` alias moved to it (logged)."""
    deployment = locked(deployment)
    _refuse_unless_in_flight(deployment, "promote")
    if deployment.state == State.ROLLING_BACK:
        raise DeploymentConflict(f"deployment {deployment.pk} is rolling back; cannot promote it")
    if deployment.state in (State.PENDING, State.PROVISIONING):
        # Until the judge has seen a ready replica, 100% would go to a version nothing serves yet.
        raise DeploymentConflict(
            f"deployment {deployment.pk} is {deployment.state}: the candidate has no ready replica yet; "
            "promote it once it takes traffic (ramping or shadowing)"
        )
    try:
        promote(
            deployment,
            actor=actor,
            reason=reason or "promotion requested",  # as a rollback's: the actor says who
            figures={},
            now=timezone.now(),
        )
    except RegistryError as exc:
        raise DeploymentConflict(str(exc)) from exc
    return deployment
