"""The writes every step of a rollout is made of: an event in the deployment's history, a state change
with its event, a routing edit (and the split it sets), and the lock on the deployment's row.

Apart because both writers of a rollout build on them: rollouts.services (create, rollback, promote)
and rollouts.judge_tick (the judge's tick). The tick imports the services' ends of a rollout, never the
reverse; these primitives sit below both. Callers outside the package go through those two."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from django.utils import timezone

from audit.log import Action, record
from registry.services import routing_table_set
from rollouts import snapshots
from rollouts.models import Deployment, DeploymentEvent

# --- helpers that write -------------------------------------------------------------------------------


def log_event(
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


def transition(
    deployment: Deployment,
    to_state: str,
    *,
    actor: str,
    reason: str,
    figures: dict[str, Any] | None = None,
    at: dt.datetime | None = None,
) -> None:
    """Every change of a deployment's state (and of its step: a step is a transition to RAMPING) goes
    through here: its event, and its entry in the audit log, with the row as stored before."""
    stored = Deployment.objects.select_related("model", "candidate", "incumbent").get(pk=deployment.pk)
    log_event(deployment, to_state=to_state, actor=actor, reason=reason, figures=figures, at=at)
    deployment.state = to_state
    deployment.save()
    record(
        actor=actor,
        action=Action.UPDATE,
        before=snapshots.deployment(stored),
        after=snapshots.deployment(deployment),
        reason=reason,
    )


def route(deployment: Deployment, weights: dict[str, int], *, actor: str) -> dict[str, Any]:
    """One routing edit; returns the revision and how long the edit took."""
    started = time.perf_counter()
    table = routing_table_set(
        model=deployment.model, weights=weights, actor=actor, reason=f"deployment {deployment.pk}"
    )
    return {
        "routing": weights,
        "routing_revision": table.revision,
        "edit_ms": round((time.perf_counter() - started) * 1000.0, 3),
    }


def noted(edit: dict[str, Any]) -> str:
    """A routing edit as an event's reason names it."""
    return f"(routing revision {edit['routing_revision']}, edit {edit['edit_ms']:.1f} ms)"


def split_for(deployment: Deployment, pct: int) -> dict[str, int]:
    if pct >= 100:
        return {deployment.candidate.version: 100}
    return {deployment.candidate.version: pct, deployment.incumbent.version: 100 - pct}


def locked(deployment: Deployment) -> Deployment:
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
