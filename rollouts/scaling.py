"""Writes for scaling: the autoscaler's tick, which turns the fleet's heartbeats and the gateways' demand
into each version's target replicas (rollouts.fleet.autoscaler's policy), and a model's scaling bounds.
The provisioners (rollouts/fleet/) carry the targets out."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from audit import actors
from audit.log import Action, record
from registry.models import Model, ModelVersion, RoutingTable
from registry.selectors import versions_to_serve
from registry.services import routing_changed
from rollouts import snapshots
from rollouts.fleet.autoscaler import ReplicaSignals, ScalingPolicy, next_target, recommend
from rollouts.models import Deployment, ScaleTarget, ScalingBounds
from rollouts.selectors import scaling_bounds
from serving.selectors import fleet_demand, fleet_heartbeats, publish_pin_declines

logger = logging.getLogger(__name__)


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
    declines: dict[tuple[str, str], str] = {}
    with transaction.atomic():
        changed = _write_targets(signals, idle_s, reported, policy, now, demand, declines)
    # Once the targets are stored: a gateway told "none" is never told so before the tick's word holds.
    publish_pin_declines(declines)
    return changed


@transaction.atomic
def scaling_bounds_set(
    *, model: Model, min_replicas: int | None, max_replicas: int | None, actor: str = actors.SYSTEM
) -> ScalingBounds:
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
    before = snapshots.scaling_bounds(current) if current is not None else None
    action = Action.CREATE if current is None else Action.UPDATE
    record(actor=actor, action=action, before=before, after=snapshots.scaling_bounds(bounds))
    return bounds


@transaction.atomic
def scaling_bounds_clear(*, model: Model, actor: str = actors.SYSTEM) -> None:
    """Back to the settings' bounds (which never scale to zero)."""
    current = ScalingBounds.objects.select_for_update().filter(model=model).first()
    if current is None:
        return
    before = snapshots.scaling_bounds(current)
    current.delete()
    routing_changed(model=model)
    record(actor=actor, action=Action.DELETE, before=before, after=None)


def _on_demand(
    idle_s: dict[tuple[str, str], float],
    reported: set[tuple[str, str]],
    serving: dict[tuple[str, str], int],
    policy: ScalingPolicy,
    demand: dict[tuple[str, str], float],
    declines: dict[tuple[str, str], str],
) -> dict[tuple[str, str], int]:
    """Versions without traffic, an alias or shadow copies whose replicas still served a request within
    the idle time: the version a promotion (or a traffic edit) just took traffic from, while requests
    pinned to it (X-Version-Pin) keep coming. They keep one replica until idle, so going back to them
    meanwhile is a routing edit. A version with no replica gets one for pinned requests as well: a
    gateway where one waits says so (`demand`: seconds since a request last waited), and only tenants
    allowed to pin, and to use the model, get that far. At most PROVISIONER_MAX_PINNED versions without
    traffic hold a replica so (each holds a device, and pins may name any old version): past it a new
    one gets none, the most recently asked for first; those that have one keep it. Not a candidate its
    deployment just rolled back. (model, version) -> id (docs/architecture.md, "Replicas kept warm").
    Into `declines`, the versions a gateway asked for that get none, with why
    (serving.selectors.publish_pin_declines)."""
    window = policy.idle_before_zero_s
    kept = [key for key in reported if key not in serving and idle_s.get(key, math.inf) < window]
    asked = sorted(
        (age, key)
        for key, age in demand.items()
        if key not in serving and key not in reported and age < window
    )
    room = max(0, settings.PROVISIONER_MAX_PINNED - len(kept))
    kept += [key for _, key in asked[:room]]
    limit = settings.PROVISIONER_MAX_PINNED
    why = (
        f"the fleet keeps at most {limit} versions without traffic warm for pinned requests, and has as "
        "many; send it again later, or pin a version that takes traffic"
        if limit
        else "this fleet starts no replica for a version without traffic; pin a version that takes traffic"
    )
    declines.update((key, why) for _, key in asked[room:])
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
    declines.update(
        (key, "its deployment rolled back: no replica is started for it")
        for _, key in asked
        if key in rolled_back
    )
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
    demand: dict[tuple[str, str], float],
    declines: dict[tuple[str, str], str],
) -> dict[tuple[str, str], int]:
    """autoscale's writes, in one transaction; the pinned versions declined into `declines`."""
    # An adapter version stands for its base: replicas run bases only (registry/selectors.py)
    serving = {(ref.model_name, ref.version): ref.version_id for ref in versions_to_serve()}
    on_demand = _on_demand(idle_s, reported, serving, policy, demand, declines)
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
