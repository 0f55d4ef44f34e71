"""Writes for rollouts: create a deployment, run one judge tick on it, roll it back, promote it.

Every state change writes a DeploymentEvent with its reason and figures, in the same transaction as the
routing or alias edit it describes. Traffic moves only through registry.services (routing_table_set,
alias_set), so the data plane sees a rollout exactly as it sees any routing edit: a new revision, picked
up by every gateway within its revalidation interval (serving.gateway.router.REVALIDATE_S)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import time
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.module_loading import import_string

from registry.models import Alias, Model, ModelVersion, RoutingEntry, RoutingTable, is_valid_name
from registry.selectors import versions_with_traffic
from registry.services import (
    STABLE_ALIAS,
    RegistryError,
    alias_set,
    routing_changed,
    routing_mirror_set,
    routing_table_set,
)
from rollouts import judge
from rollouts.fleet.autoscaler import ReplicaSignals, ScalingPolicy, next_target, recommend
from rollouts.models import Deployment, DeploymentEvent, ScaleTarget, ScalingBounds
from rollouts.selectors import (
    MetricsUnavailable,
    WindowReader,
    fleet_demand,
    fleet_heartbeats,
    fleet_redis,
    scaling_bounds,
    window_reader,
)

logger = logging.getLogger(__name__)

JUDGE_ACTOR = "rollout-judge"
CANARY_ALIAS = "canary"
MAX_STEPS = 20
MAX_BAKE_SECONDS = 7 * 24 * 3600

State = Deployment.State


class DeploymentError(Exception):
    """A request the rollouts refuse; `status` is the HTTP status the API answers with."""

    status = 400


class DeploymentConflict(DeploymentError):
    status = 409


# --- validation (pure: nothing is written before all of it passes) ----------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if not (_is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except OverflowError:  # an integer of hundreds of digits, which JSON allows
        return False


def validate_steps(steps: object) -> list[dict[str, int]]:
    if not isinstance(steps, list) or not steps:
        raise DeploymentError('steps must be a non-empty list like [{"pct": 5}, {"pct": 100}]')
    if len(steps) > MAX_STEPS:
        raise DeploymentError(f"at most {MAX_STEPS} steps")
    pcts: list[int] = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or set(step) != {"pct"}:
            raise DeploymentError(f'step {i} must be an object with exactly one key, "pct"')
        pct = step["pct"]
        if not _is_int(pct) or not 1 <= pct <= 100:
            raise DeploymentError(f"step {i}: pct must be an integer from 1 to 100, got {pct!r}")
        if pcts and pct <= pcts[-1]:
            raise DeploymentError(f"steps must be strictly increasing; step {i} ({pct}%) follows {pcts[-1]}%")
        pcts.append(pct)
    if pcts[-1] != 100:
        raise DeploymentError(f"the last step must be 100%, got {pcts[-1]}%")
    if len(pcts) == 1:
        # At 100% the incumbent takes no traffic, so the judge has nothing to compare the canary with.
        raise DeploymentError(
            "a canary needs at least one step below 100% before the last, e.g. "
            '[{"pct": 5}, {"pct": 100}]: at 100% the incumbent gets nothing for the judge to compare with'
        )
    return [{"pct": p} for p in pcts]


_INT_THRESHOLDS = {"min_samples"}
_PROBABILITY_THRESHOLDS = {"alpha", "min_rate_increase", "min_truncation_increase"}
# A finite number can still overflow the judge: 1e308 x an incumbent's p99 is inf, which neither SQLite's
# nor Postgres's JSON accepts, so every tick that saved its figures failed and the deployment never moved.
# The bounds are far past any sensible setting. (min_samples is an integer, only ever compared: a huge
# one holds a canary for good, which is how a benchmark keeps the judge from deciding.)
_UPPER_BOUNDS: dict[str, float] = {
    "ttft_sla_ms": 3_600_000.0,  # an hour
    "tpot_sla_ms": 600_000.0,
    "latency_ratio": 1000.0,
    "min_output_length_ratio": 1.0,  # the canary's mean output may be held to the incumbent's, not above
}


def resolve_thresholds(overrides: object) -> dict[str, Any]:
    """settings.ROLLOUT_THRESHOLDS with the deployment's overrides, checked name by name."""
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise DeploymentError("thresholds must be an object")
    known = judge.Thresholds.names()
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise DeploymentError(
            f"unknown threshold(s): {', '.join(map(str, unknown))}; known: {', '.join(sorted(known))}"
        )
    for name, value in overrides.items():
        if name in _INT_THRESHOLDS:
            if not _is_int(value) or value < 1:
                raise DeploymentError(f"threshold {name} must be a positive integer, got {value!r}")
        elif not _is_number(value):
            raise DeploymentError(f"threshold {name} must be a number, got {value!r}")
        elif name in _PROBABILITY_THRESHOLDS and not 0 <= value < 1:
            raise DeploymentError(f"threshold {name} must be in [0, 1), got {value!r}")
        elif name not in _PROBABILITY_THRESHOLDS and value <= 0:
            raise DeploymentError(f"threshold {name} must be positive, got {value!r}")
        if name in _UPPER_BOUNDS and value > _UPPER_BOUNDS[name]:
            raise DeploymentError(f"threshold {name} may be at most {_UPPER_BOUNDS[name]:g}, got {value!r}")
    if overrides.get("alpha") == 0:
        raise DeploymentError("threshold alpha must be above 0")
    resolved = {**settings.ROLLOUT_THRESHOLDS, **overrides}
    return judge.Thresholds.from_dict(resolved).as_dict()


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
        for answer in (_embedded_replica_ready(model_name, version), _fleet_replica_ready(deployment))
        if answer is not None
    ]
    if answers:
        return any(answers)
    return Alias.objects.filter(
        model_id=deployment.model_id, name=CANARY_ALIAS, version_id=deployment.candidate_id
    ).exists()


def _embedded_replica_ready(model_name: str, version: str) -> bool | None:
    """Is a replica of (model, version) that this process hosts ready? None when this process hosts no
    replicas (no live runtime, or replicas run as processes). Called from the judge's thread: it only
    reads the runtimes' state, never touches their loops."""
    if not settings.EMBEDDED_REPLICAS:
        return None
    from serving import runtime as data_plane  # rollouts may import serving; imported late, only here

    runtimes = data_plane.live_runtimes()
    if not runtimes:
        return None
    for rt in runtimes:
        replica = rt.replicas.get((model_name, version))
        if replica is not None and replica.is_ready:
            return True
    return False


def _fleet_replica_ready(deployment: Deployment) -> bool | None:
    """Does a replica process of the candidate publish a fresh `ready` heartbeat (the hash the gateways
    read: serving.transport.replica_directory)? None without Redis, when it cannot be read, or when it has no
    fresh
    heartbeat of the candidate nor of the incumbent (then this model is not served by processes that
    publish heartbeats, and their absence says nothing)."""
    if not settings.REDIS_URL:
        return None
    import redis

    from serving.transport.replica_directory import Heartbeat, read_beats, version_key

    model_name = deployment.model.name

    def beats(version: str) -> list[Heartbeat]:
        return read_beats(client, [version_key(model_name, version)])

    client = fleet_redis()
    try:
        candidate = [beat for beat in beats(deployment.candidate.version) if beat.is_fresh]
        if candidate:
            return any(beat.is_ready for beat in candidate)
        if any(beat.is_fresh for beat in beats(deployment.incumbent.version)):
            return False
        return None
    except (redis.RedisError, ValueError, TypeError) as exc:
        logger.warning("readiness of %s: replica heartbeats unreadable (%s)", deployment.candidate, exc)
        return None
    finally:
        client.close()


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
        if not _is_int(mirror_pct) or not 1 <= mirror_pct <= 100:  # type: ignore[operator]
            raise DeploymentError(f"mirror_pct must be an integer from 1 to 100, got {mirror_pct!r}")
    bake_seconds = settings.ROLLOUT_BAKE_SECONDS if bake_seconds is None else bake_seconds
    if not _is_int(bake_seconds) or not 0 <= bake_seconds <= MAX_BAKE_SECONDS:  # type: ignore[operator]
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


# --- the autoscaler ------------------------------------------------------------------------------------


AUTOSCALER_BEAT_MAX_AGE_S = 10.0


def autoscale(
    *,
    heartbeats: list[Any] | None = None,
    demand: dict[tuple[str, str], float] | None = None,
    policy: ScalingPolicy | None = None,
    now: float | None = None,
) -> dict[tuple[str, str], int]:
    """One autoscaler tick: each version that must serve (traffic, an alias, shadow copies), or that
    lost its traffic and still serves pinned requests, gets a target from its ready replicas' heartbeats
    (rollouts.fleet.autoscaler); every other version that had one gets 0. Returns the targets that changed.
    `heartbeats` (Heartbeat objects) default to the fleet's, `demand` (version -> seconds since a request
    last waited at a gateway for a replica of it) to the gateways'; raises HeartbeatsUnavailable when
    they cannot be read, changing nothing."""
    policy = policy or ScalingPolicy(**settings.AUTOSCALER)
    now = time.time() if now is None else now
    beats = fleet_heartbeats() if heartbeats is None else heartbeats
    demand = fleet_demand() if demand is None else demand
    signals: dict[tuple[str, str], list[ReplicaSignals]] = {}
    idle_s: dict[tuple[str, str], float] = dict(demand)  # the least any replica or gateway says
    reported: set[tuple[str, str]] = set()  # versions that a replica says, fresh, how idle they are
    for beat in beats:
        # A loading or draining replica is neither capacity nor load yet. Freshness is looser than the
        # router's: a busy replica's beat may be late, and this host's clock may differ a little; the
        # scale-down window covers a replica that is missed for a tick.
        if now - beat.sent_at >= AUTOSCALER_BEAT_MAX_AGE_S:
            continue
        key = (beat.model_name, beat.version)
        idle_s[key] = min(idle_s.get(key, math.inf), beat.idle_s)
        reported.add(key)
        if beat.state == "ready":
            signals.setdefault(key, []).append(
                ReplicaSignals(
                    beat.num_waiting,
                    beat.num_running,
                    beat.capacity,
                    beat.kv_cache_usage,
                    beat.is_generative,
                    step_s=beat.step_s,
                    step_rate=beat.step_rate,
                    base_step_s=beat.base_step_s,
                )
            )
    with transaction.atomic():
        return _write_targets(signals, idle_s, reported, policy, now)


@transaction.atomic
def scaling_bounds_set(*, model: Model, min_replicas: int | None, max_replicas: int | None) -> ScalingBounds:
    """A model's own replica bounds; a bound not given keeps its current value (or the settings').
    min_replicas 0 scales its idle versions to zero: every gateway learns it within a second, and holds a
    request that finds no replica while one starts. Raises ValueError unless 0 <= min <= max, 1 <= max."""
    current = ScalingBounds.objects.select_for_update().filter(model=model).first()
    low, high = (
        (current.min_replicas, current.max_replicas)
        if current is not None
        else (settings.AUTOSCALER["min_replicas"], settings.AUTOSCALER["max_replicas"])
    )
    low = low if min_replicas is None else min_replicas
    high = high if max_replicas is None else max_replicas
    if not 0 <= low <= high or high < 1:
        raise ValueError(f"need 0 <= min <= max and max >= 1, got min {low}, max {high}")
    bounds, _ = ScalingBounds.objects.update_or_create(
        model=model, defaults={"min_replicas": low, "max_replicas": high}
    )
    routing_changed(model=model)
    return bounds


@transaction.atomic
def scaling_bounds_clear(*, model: Model) -> None:
    """Back to the settings' bounds (which never scale to zero)."""
    if ScalingBounds.objects.filter(model=model).delete()[0]:
        routing_changed(model=model)


def _on_demand(
    idle_s: dict[tuple[str, str], float],
    reported: set[tuple[str, str]],
    serving: dict[tuple[str, str], int],
    policy: ScalingPolicy,
) -> dict[tuple[str, str], int]:
    """Versions without traffic, an alias or shadow copies whose replicas still served a request within
    the idle time: the version a promotion (or a traffic edit) just took traffic from, while requests
    pinned to it (X-Version-Pin) keep coming. They keep one replica until idle, so going back to them
    meanwhile is a routing edit. Only a version that still has a replica qualifies: a pin cannot bring
    back one that has none; nor a candidate its deployment just rolled back. (model, version) -> id."""
    kept = [
        key
        for key in reported
        if key not in serving and idle_s.get(key, math.inf) < policy.idle_before_zero_s
    ]
    if not kept:
        return {}
    # Not a candidate just rolled back: it was busy until the rollback, but nobody is to go back to it,
    # and its replica would hold a device the incumbent, with all the traffic now, could use.
    latest: dict[str, tuple[str, str]] = {}
    for model_name, state, candidate in (
        Deployment.objects.filter(model__name__in={m for m, _ in kept})
        .order_by("model__name", "-created_at", "-pk")
        .values_list("model__name", "state", "candidate__version")
    ):
        latest.setdefault(model_name, (state, candidate))
    rolled_back = {(m, c) for m, (state, c) in latest.items() if state == Deployment.State.ROLLED_BACK}
    kept = [key for key in kept if key not in rolled_back]
    if not kept:
        return {}
    match = Q()
    for model_name, version in kept:
        match |= Q(model__name=model_name, version=version)
    rows = ModelVersion.objects.filter(match).select_related("model")
    return {(row.model.name, row.version): row.pk for row in rows}


def _kept_warm() -> dict[tuple[str, str], str]:
    """Versions that keep a replica however long they have been idle, with why: both versions of a
    deployment in flight (it waits for its candidate's replica and judges both) and a version that shadow
    copies go to (they never wait for a cold start)."""
    kept: dict[tuple[str, str], str] = {}
    for model_name, candidate, incumbent in Deployment.objects.filter(
        state__in=Deployment.IN_FLIGHT_STATES
    ).values_list("model__name", "candidate__version", "incumbent__version"):
        kept[(model_name, candidate)] = kept[(model_name, incumbent)] = "a deployment in flight"
    for model_name, version in RoutingTable.objects.filter(
        mirror_version__isnull=False, mirror_pct__gt=0
    ).values_list("model__name", "mirror_version__version"):
        kept.setdefault((model_name, version), "shadow copies go to it")
    return kept


def _bounded_policy(policy: ScalingPolicy, bounds: tuple[int, int] | None) -> ScalingPolicy:
    """The policy with a model's own bounds (ScalingBounds) over the defaults."""
    if bounds is None:
        return policy
    return dataclasses.replace(policy, min_replicas=bounds[0], max_replicas=bounds[1])


def _write_targets(
    signals: dict[tuple[str, str], list[ReplicaSignals]],
    idle_s: dict[tuple[str, str], float],
    reported: set[tuple[str, str]],
    policy: ScalingPolicy,
    now: float,
) -> dict[tuple[str, str], int]:
    """autoscale's writes, in one transaction."""
    serving = {(ref.model_name, ref.version): ref.version_id for ref in versions_with_traffic()}
    on_demand = _on_demand(idle_s, reported, serving, policy)
    serving |= on_demand
    bounds = scaling_bounds()
    kept_warm = _kept_warm()
    existing = {  # locked: a second tick running meanwhile (two workers) waits, then reads these rows
        (t.version.model.name, t.version.version): t
        # of=self: the registry's rows stay unlocked (a deployment locks its Model row)
        for t in ScaleTarget.objects.select_for_update(of=("self",)).select_related("version__model")
    }
    changed: dict[tuple[str, str], int] = {}
    for key, version_id in serving.items():
        model_policy = _bounded_policy(policy, bounds.get(key[0]))
        if key in on_demand:  # one replica while pinned requests keep coming, none once idle
            model_policy = dataclasses.replace(model_policy, min_replicas=0, max_replicas=1, warm_buffer=0)
        target = existing.get(key) or ScaleTarget(version_id=version_id, replicas=0)
        why = kept_warm.get(key)
        if why is None and key not in reported and target.replicas:
            # Only a replica's word takes a version to zero: missed heartbeats, or a replica still loading
            # (it beats once ready) however long ago its request left, are no evidence of idleness.
            why = "no replica has said how long it has been idle"
        advice = recommend(
            signals.get(key, []), model_policy, idle_s=idle_s.get(key, math.inf), kept_warm_by=why
        )
        held = min(target.replicas, model_policy.max_replicas)
        if not signals.get(key) and advice.replicas < held:
            # None of its replicas is ready: they are starting (a restart, a lost node) and say nothing of
            # the load yet. A lower target would stop the newest while they load, and the survivor would
            # come up to the backlog and ask for them again.
            advice = dataclasses.replace(
                advice, replicas=held, reason=f"no ready replica: {held} kept while they start"
            )
        history = [
            (float(t), int(n)) for t, n in target.recommendations if now - t <= policy.scale_down_window_s
        ]
        history.append((now, advice.replicas))
        replicas_before = target.replicas
        target.replicas = next_target(history, now=now, current=replicas_before, policy=model_policy)
        target.recommendations = [list(entry) for entry in history]
        target.reason = advice.reason
        if target.replicas > advice.replicas:
            target.reason = f"held by the scale-down window; now {advice.reason} asks for {advice.replicas}"
        target.signals = {**advice.figures, "recommended": advice.replicas}
        if target.replicas != replicas_before or target.pk is None:
            target.changed_at = timezone.now()
            changed[key] = target.replicas
            logger.info(
                "autoscaler: %s:%s %d -> %d replicas (%s)",
                *key,
                replicas_before,
                target.replicas,
                advice.reason,
            )
        target.save()
    for key, target in existing.items():
        if key not in serving and target.replicas:
            logger.info(
                "autoscaler: %s:%s %d -> 0 replicas (no traffic, alias or shadow copies)",
                *key,
                target.replicas,
            )
            target.replicas, target.reason, target.recommendations = (
                0,
                "no traffic, alias or shadow copies",
                [],
            )
            target.changed_at = timezone.now()
            target.save()
            changed[key] = 0
    return changed
