"""Writes for rollouts: create a deployment, run one judge tick on it, roll it back, promote it.

Every state change writes a DeploymentEvent with its reason and figures, in the same transaction as the
routing or alias edit it describes. Traffic moves only through registry.services (routing_table_set,
alias_set), so the data plane sees a rollout exactly as it sees any routing edit: a new revision, picked
up by every gateway within its revalidation interval (serving.gateway.router.REVALIDATE_S)."""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from registry.models import Alias, Model, ModelVersion, RoutingEntry, RoutingTable, is_valid_name
from registry.services import (
    STABLE_ALIAS,
    RegistryError,
    alias_set,
    routing_mirror_set,
    routing_table_set,
)
from rollouts import judge
from rollouts.models import Deployment, DeploymentEvent
from rollouts.selectors import (
    MetricsUnavailable,
    WindowReader,
    window_reader,
)
from rollouts.steps import (
    MAX_BAKE_SECONDS,
    DeploymentConflict,
    DeploymentError,
    is_int,
    resolve_thresholds,
    validate_steps,
)
from serving.selectors import embedded_replica_ready, fleet_replica_ready

logger = logging.getLogger(__name__)

JUDGE_ACTOR = "rollout-judge"
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
    """Does a replica process of the candidate publish a fresh `ready` heartbeat (serving.selectors)?"""
    return fleet_replica_ready(
        deployment.model.name, deployment.candidate.version, deployment.incumbent.version
    )


def _readiness_check() -> Any:
    return import_string(settings.ROLLOUT_READINESS_CHECK)


# --- helpers that write -------------------------------------------------------------------------------


def _event(
    deployment: Deployment,
    *,
    to_state: str,
    actor: str,
    reason: str,
    figures: dict[str, Any] | None = None,
    from_state: str | None = None,
    at: dt.datetime | None = None,
) -> DeploymentEvent:
    return DeploymentEvent.objects.create(
        deployment=deployment,
        at=at or timezone.now(),
        from_state=deployment.state if from_state is None else from_state,
        to_state=to_state,
        actor=actor,
        reason=reason,
        figures=figures or {},
    )


def _transition(
    deployment: Deployment,
    to_state: str,
    *,
    actor: str,
    reason: str,
    figures: dict[str, Any] | None = None,
    at: dt.datetime | None = None,
) -> None:
    _event(deployment, to_state=to_state, actor=actor, reason=reason, figures=figures, at=at)
    deployment.state = to_state
    deployment.save()


def _route(deployment: Deployment, weights: dict[str, int]) -> dict[str, Any]:
    """One routing edit; returns the revision and how long the edit took."""
    started = time.perf_counter()
    table = routing_table_set(model=deployment.model, weights=weights)
    return {
        "routing": weights,
        "routing_revision": table.revision,
        "edit_ms": round((time.perf_counter() - started) * 1000.0, 3),
    }


def _noted(edit: dict[str, Any]) -> str:
    """A routing edit as an event's reason names it."""
    return f"(routing revision {edit['routing_revision']}, edit {edit['edit_ms']:.1f} ms)"


def _split(deployment: Deployment, pct: int) -> dict[str, int]:
    if pct >= 100:
        return {deployment.candidate.version: 100}
    return {deployment.candidate.version: pct, deployment.incumbent.version: 100 - pct}


def _locked(deployment: Deployment) -> Deployment:
    """The deployment's row, locked for the rest of the transaction (SQLite: the settings open every
    transaction IMMEDIATE, which takes the database's write lock up front). Its row only (of=self): the
    joined model and versions locked FOR UPDATE too would hold back, for a whole judge tick, every
    metrics flush of either version (a row's foreign key takes a KEY SHARE lock on the version) and
    anything else that locks the model. Creates lock the model themselves; routing edits their table."""
    return (
        Deployment.objects.select_for_update(of=("self",))
        .select_related("model", "candidate", "incumbent")
        .get(pk=deployment.pk)
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
                state=State.PENDING,
                created_by=created_by,
            )
    except IntegrityError:  # another create won the race past the check above
        raise DeploymentConflict(f"model {model.name!r} already has a deployment in flight") from None
    plan = (
        " -> ".join(f"{s['pct']}%" for s in steps)  # type: ignore[union-attr]
        if strategy == Deployment.Strategy.CANARY
        else f"mirror {mirror_pct}%"
    )
    _event(
        deployment,
        from_state="",
        to_state=State.PENDING,
        actor=created_by,
        reason=f"{strategy} of {version} against {stable.version.version}: {plan}, bake {bake_seconds} s",
        figures={"thresholds": resolved_thresholds},
    )
    _provision(deployment, actor=created_by)
    return deployment


def _provision(deployment: Deployment, *, actor: str) -> None:
    alias_set(
        model=deployment.model,
        name=CANARY_ALIAS,
        version=deployment.candidate,
        actor=actor,
        reason=f"deployment {deployment.pk}: provision the candidate",
    )
    deployment.provisioning_started_at = timezone.now()
    _transition(
        deployment,
        State.PROVISIONING,
        actor=actor,
        reason=f"canary alias -> {deployment.candidate.version}; waiting for a ready replica",
    )


# --- the judge's tick ---------------------------------------------------------------------------------


@transaction.atomic
def deployment_judge(
    *,
    deployment: Deployment,
    now: dt.datetime | None = None,
    read_window: WindowReader | None = None,
) -> judge.Verdict | None:
    """One judge tick for one deployment: finish provisioning when the candidate is ready; while ramping
    (or shadowing), compare the candidate's window with the incumbent's over [step start, now) and act on
    the verdict. Returns the verdict, or None when there was nothing to judge."""
    now = now or timezone.now()
    deployment = _locked(deployment)
    if deployment.state == State.PENDING:
        _provision(deployment, actor=JUDGE_ACTOR)
        return None
    if deployment.state == State.PROVISIONING:
        _tick_provisioning(deployment, now=now)
        return None
    if deployment.state == State.ROLLING_BACK:  # only if a rollback was interrupted mid-way
        _rollback(
            deployment, actor=JUDGE_ACTOR, reason="finishing an interrupted rollback", figures={}, now=now
        )
        return None
    if deployment.state not in (State.RAMPING, State.SHADOWING):
        return None

    verdict = _verdict(deployment, now=now, read_window=read_window)
    deployment.last_judged_at = now
    deployment.last_verdict = {
        "verdict": verdict.kind.value,
        "reason": verdict.reason,
        "figures": verdict.figures,
    }
    if verdict.kind == judge.VerdictKind.ROLLBACK:
        _rollback(
            deployment, actor=JUDGE_ACTOR, reason=f"judge: {verdict.reason}", figures=verdict.figures, now=now
        )
    elif verdict.kind == judge.VerdictKind.ADVANCE:
        _advance(deployment, verdict=verdict, now=now)
    else:
        deployment.save(update_fields=["last_judged_at", "last_verdict", "step_looks", "updated_at"])
        _note_overdue_step(deployment, verdict=verdict, now=now)
    return verdict


def _note_overdue_step(deployment: Deployment, *, verdict: judge.Verdict, now: dt.datetime) -> None:
    """A hold inside the bake window is routine and writes nothing (last_verdict shows it). A step still
    held once its window is over is one an operator should see in the history, with the judge's
    reasons: written once per step, at the first tick past the window."""
    if deployment.state != State.RAMPING or deployment.step_started_at is None:
        return
    elapsed_s = (now - deployment.step_started_at).total_seconds()
    if elapsed_s < deployment.bake_seconds:
        return
    if deployment.events.filter(
        actor=JUDGE_ACTOR,
        to_state=State.RAMPING,
        at__gte=deployment.step_started_at,
        reason__contains="held past",
    ).exists():
        return
    step = deployment.current_step
    _event(
        deployment,
        to_state=State.RAMPING,
        actor=JUDGE_ACTOR,
        reason=(
            f"judge: step {step + 1}/{len(deployment.steps)} ({deployment.steps[step]['pct']}%) held past "
            f"its {deployment.bake_seconds:g} s bake window: {verdict.reason}"
        ),
        figures=verdict.figures,
        at=now,
    )


def _tick_provisioning(deployment: Deployment, *, now: dt.datetime) -> None:
    if _readiness_check()(deployment):
        deployment.step_looks = 0
        if deployment.strategy == Deployment.Strategy.SHADOW:
            deployment.step_started_at = now
            routing_mirror_set(
                model=deployment.model, version=deployment.candidate, pct=int(deployment.mirror_pct or 0)
            )
            _transition(
                deployment,
                State.SHADOWING,
                actor=JUDGE_ACTOR,
                reason=f"candidate ready; mirroring {deployment.mirror_pct}% of traffic to it",
                figures={"mirror_pct": deployment.mirror_pct},
                at=now,
            )
            return
        pct = int(deployment.steps[0]["pct"])
        edit = _route(deployment, _split(deployment, pct))
        deployment.current_step = 0
        deployment.step_started_at = now
        _transition(
            deployment,
            State.RAMPING,
            actor=JUDGE_ACTOR,
            reason=f"candidate ready; step 1/{len(deployment.steps)}: {pct}% of traffic",
            figures=edit,
            at=now,
        )
        return
    started = deployment.provisioning_started_at or deployment.created_at
    waited_s = (now - started).total_seconds()
    limit_s = settings.ROLLOUT_PROVISION_TIMEOUT_S
    if waited_s > limit_s:
        _rollback(
            deployment,
            actor=JUDGE_ACTOR,
            reason=f"candidate not ready after {waited_s:.0f} s (limit {limit_s} s)",
            figures={"waited_s": round(waited_s, 3)},
            now=now,
        )


def num_looks(*, bake_seconds: float) -> int:
    """How many times the judge tests a step's window before it can advance: once per tick over the
    bake window, plus the tick that ends it. The judge divides alpha by it (rollouts.judge)."""
    return math.ceil(bake_seconds / settings.ROLLOUT_JUDGE_INTERVAL_S) + 1


def _verdict(deployment: Deployment, *, now: dt.datetime, read_window: WindowReader | None) -> judge.Verdict:
    thresholds = judge.Thresholds.from_dict(deployment.thresholds)
    start = deployment.step_started_at or now
    bake_elapsed_s = max(0.0, (now - start).total_seconds())
    try:
        read = read_window or window_reader()
        with transaction.atomic():  # a failed read must not poison the transaction we write in
            canary = read(
                model_name=deployment.model.name, version=deployment.candidate.version, start=start, end=now
            )
            incumbent = read(
                model_name=deployment.model.name, version=deployment.incumbent.version, start=start, end=now
            )
    except Exception as exc:  # the store is down or the contract drifted: hold, never act blind
        if not isinstance(exc, MetricsUnavailable):
            logger.exception("rollout judge: reading metrics for deployment %s failed", deployment.pk)
        return judge.Verdict(
            judge.VerdictKind.INSUFFICIENT_DATA,
            (f"metrics unavailable: {exc}",),
            {"bake_elapsed_s": round(bake_elapsed_s, 3), "bake_seconds": deployment.bake_seconds},
        )
    planned = num_looks(bake_seconds=deployment.bake_seconds)
    verdict = judge.decide(
        canary,
        incumbent,
        thresholds=thresholds,
        bake_elapsed_s=bake_elapsed_s,
        bake_seconds=deployment.bake_seconds,
        num_looks=planned,
        # Counted, not derived from the clock: ticks that waited for min_samples ran no test, and
        # counting them would leave a slow step's first real look at a vanishing alpha.
        look=deployment.step_looks + 1,
    )
    if verdict.kind != judge.VerdictKind.INSUFFICIENT_DATA:
        if bake_elapsed_s >= deployment.bake_seconds and deployment.step_looks < planned:
            deployment.step_looks = planned  # it spent what the plan had left (judge.decide)
        else:
            deployment.step_looks += 1
    verdict.figures["window"] = {"start": start.isoformat(), "end": now.isoformat()}
    if deployment.strategy == Deployment.Strategy.SHADOW:
        compared, matched = canary.num_shadow_compared, canary.num_shadow_matched
        verdict.figures["output_match"] = {
            "compared": compared,
            "matched": matched,
            "rate": round(matched / compared, 4) if compared else None,
        }
    if deployment.strategy == Deployment.Strategy.CANARY:
        verdict.figures["step"] = deployment.current_step
        verdict.figures["pct"] = deployment.current_pct
    return verdict


def _advance(deployment: Deployment, *, verdict: judge.Verdict, now: dt.datetime) -> None:
    if deployment.strategy == Deployment.Strategy.SHADOW:
        _park_canary_alias(deployment, actor=JUDGE_ACTOR, outcome="completed")
        deployment.finished_at = now
        _transition(
            deployment,
            State.COMPLETED,
            actor=JUDGE_ACTOR,
            reason=f"judge: shadow healthy: {verdict.reason}; traffic unchanged",
            figures=verdict.figures,
            at=now,
        )
        return
    next_step = deployment.current_step + 1
    # A step list validated before single-step canaries were refused may end at the current step.
    pct = int(deployment.steps[next_step]["pct"]) if next_step < len(deployment.steps) else 100
    if pct >= 100:
        _promote(
            deployment, actor=JUDGE_ACTOR, reason=f"judge: {verdict.reason}", figures=verdict.figures, now=now
        )
        return
    edit = _route(deployment, _split(deployment, pct))
    previous_pct = deployment.current_pct
    deployment.current_step = next_step
    deployment.step_started_at = now
    deployment.step_looks = 0
    _transition(
        deployment,
        State.RAMPING,
        actor=JUDGE_ACTOR,
        reason=f"judge: {verdict.reason}; step {next_step + 1}/{len(deployment.steps)}: "
        f"{previous_pct}% -> {pct}%",
        figures={**verdict.figures, **edit},
        at=now,
    )


# --- rollback and promote -----------------------------------------------------------------------------


def _stop_mirroring(deployment: Deployment) -> None:
    if RoutingTable.objects.filter(model=deployment.model, mirror_version=deployment.candidate).exists():
        routing_mirror_set(model=deployment.model, version=None)


def _park_canary_alias(deployment: Deployment, *, actor: str, outcome: str) -> None:
    """Point `canary` back at the incumbent (logged), so the candidate keeps no alias and, with no
    traffic either, its replicas drain. (Deleting the alias would delete its logged history.) A shadow
    deployment's mirroring stops with it."""
    _stop_mirroring(deployment)
    alias = Alias.objects.filter(model=deployment.model, name=CANARY_ALIAS).first()
    if alias is not None and alias.version_id == deployment.candidate_id:
        alias_set(
            model=deployment.model,
            name=CANARY_ALIAS,
            version=deployment.incumbent,
            actor=actor,
            reason=f"deployment {deployment.pk} {outcome}; candidate released",
        )


def _rollback(
    deployment: Deployment, *, actor: str, reason: str, figures: dict[str, Any], now: dt.datetime
) -> None:
    decided_at = now
    # Before its first step the table is still the operator's (a split between older versions, say):
    # routing it all to the incumbent would drop the rest. Only a share the candidate was given by hand
    # moves, to the incumbent, since the candidate is being rolled back.
    ramped = deployment.state not in (State.PENDING, State.PROVISIONING)
    _transition(deployment, State.ROLLING_BACK, actor=actor, reason=reason, figures=figures, at=decided_at)
    # Aliases first, the routing edit last: all of it commits at once, and the revision recorded is then
    # the one gateways will see.
    _park_canary_alias(deployment, actor=actor, outcome="rolled back")
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
            edit = _route(deployment, weights)
            what = (
                f"the candidate's {moved}% (not the deployment's) to {incumbent}, the rest as it was "
                + _noted(edit)
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
        edit = _route(deployment, {deployment.incumbent.version: 100})
        what = f"traffic 100% to {deployment.incumbent.version} {_noted(edit)}"
    deployment.rollback_decided_at = decided_at
    deployment.rollback_edit_ms = edit.get("edit_ms")
    deployment.finished_at = timezone.now()
    _transition(deployment, State.ROLLED_BACK, actor=actor, reason=what, figures=edit)
    deployment_id = deployment.pk
    transaction.on_commit(
        lambda: Deployment.objects.filter(pk=deployment_id).update(rollback_committed_at=timezone.now())
    )


def _promote(
    deployment: Deployment, *, actor: str, reason: str, figures: dict[str, Any], now: dt.datetime
) -> None:
    _stop_mirroring(deployment)
    alias_set(
        model=deployment.model,
        name=STABLE_ALIAS,
        version=deployment.candidate,
        actor=actor,
        reason=f"deployment {deployment.pk} promoted",
    )
    edit = _route(deployment, {deployment.candidate.version: 100})
    if deployment.steps:
        deployment.current_step = len(deployment.steps) - 1
    deployment.finished_at = now
    _transition(
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
    deployment = _locked(deployment)
    _refuse_unless_in_flight(deployment, "roll back")
    _rollback(
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
    deployment = _locked(deployment)
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
        _promote(
            deployment,
            actor=actor,
            reason=reason or "promotion requested",  # as a rollback's: the actor says who
            figures={},
            now=timezone.now(),
        )
    except RegistryError as exc:
        raise DeploymentConflict(str(exc)) from exc
    return deployment
