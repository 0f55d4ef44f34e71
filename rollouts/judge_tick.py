"""The judge's tick: one look at one deployment in flight. It finishes provisioning once the candidate
is ready (settings.ROLLOUT_READINESS_CHECK); while ramping or shadowing it reads both versions' windows
over [step start, now), asks rollouts.judge for the verdict and acts on it: hold, advance a step (or
promote at 100%), or roll back.

Apart from rollouts.services because it is the scheduler's write (rollouts.tasks runs it every tick),
not a request's: it calls the services' ends of a rollout (provision, roll back, promote, release the
candidate), which never call back. The verdict's rules themselves are rollouts.judge, which touches no
database."""

from __future__ import annotations

import datetime as dt
import logging
import math
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from registry.services import routing_mirror_set
from rollouts import judge
from rollouts.models import Deployment
from rollouts.selectors import (
    MetricsUnavailable,
    WindowReader,
    candidate_quality,
    window_reader,
)
from rollouts.services import park_canary_alias, promote, provision, roll_back
from rollouts.transitions import locked, log_event, route, split_for, transition

logger = logging.getLogger(__name__)

JUDGE_ACTOR = "rollout-judge"

State = Deployment.State


# --- the judge's tick ---------------------------------------------------------------------------------


def _readiness_check() -> Any:
    return import_string(settings.ROLLOUT_READINESS_CHECK)


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
    deployment = locked(deployment)
    if deployment.state == State.PENDING:
        provision(deployment, actor=JUDGE_ACTOR)
        return None
    if deployment.state == State.PROVISIONING:
        _tick_provisioning(deployment, now=now)
        return None
    if deployment.state == State.ROLLING_BACK:  # only if a rollback was interrupted mid-way
        roll_back(
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
        roll_back(
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
    log_event(
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
                model=deployment.model,
                version=deployment.candidate,
                pct=int(deployment.mirror_pct or 0),
                actor=JUDGE_ACTOR,
                reason=f"deployment {deployment.pk}",
            )
            transition(
                deployment,
                State.SHADOWING,
                actor=JUDGE_ACTOR,
                reason=f"candidate ready; mirroring {deployment.mirror_pct}% of traffic to it",
                figures={"mirror_pct": deployment.mirror_pct},
                at=now,
            )
            return
        pct = int(deployment.steps[0]["pct"])
        edit = route(deployment, split_for(deployment, pct), actor=JUDGE_ACTOR)
        deployment.current_step = 0
        deployment.step_started_at = now
        transition(
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
        roll_back(
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
        # Where the copies' tokens first differed and how many agreed (serving/gateway/shadow_diff.py).
        verdict.figures["output_diff"] = canary.shadow_diffs
    if deployment.strategy == Deployment.Strategy.CANARY:
        verdict.figures["step"] = deployment.current_step
        verdict.figures["pct"] = deployment.current_pct
        return _held_by_quality(deployment, verdict)
    return verdict


def _held_by_quality(deployment: Deployment, verdict: judge.Verdict) -> judge.Verdict:
    """A canary the windows would advance holds while its recorded quality is under the deployment's
    floor, or missing where it must be there (rollouts/quality_floor.py). A hold, never a rollback: the
    figures are offline measurements, which waiting does not change; the step's history says why once
    its bake window is over, and the deployment's `waiting_on` names a missing evaluation."""
    if not deployment.quality_floor and not deployment.candidate.quantization:
        return verdict
    check = candidate_quality(deployment)
    verdict.figures["quality"] = check.figures
    if verdict.kind != judge.VerdictKind.ADVANCE or not check.held:
        return verdict
    return judge.Verdict(judge.VerdictKind.HOLD, (check.reason,), verdict.figures)


def _advance(deployment: Deployment, *, verdict: judge.Verdict, now: dt.datetime) -> None:
    if deployment.strategy == Deployment.Strategy.SHADOW:
        park_canary_alias(deployment, actor=JUDGE_ACTOR, outcome="completed")
        deployment.finished_at = now
        transition(
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
        promote(
            deployment, actor=JUDGE_ACTOR, reason=f"judge: {verdict.reason}", figures=verdict.figures, now=now
        )
        return
    edit = route(deployment, split_for(deployment, pct), actor=JUDGE_ACTOR)
    previous_pct = deployment.current_pct
    deployment.current_step = next_step
    deployment.step_started_at = now
    deployment.step_looks = 0
    transition(
        deployment,
        State.RAMPING,
        actor=JUDGE_ACTOR,
        reason=f"judge: {verdict.reason}; step {next_step + 1}/{len(deployment.steps)}: "
        f"{previous_pct}% -> {pct}%",
        figures={**verdict.figures, **edit},
        at=now,
    )
