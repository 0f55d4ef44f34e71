"""Reads for rollouts: deployments for the API and the judge, version states for /versions, the
metrics windows the judge compares (through the metrics store's selector, never its tables), the
replicas' heartbeats the autoscaler reads and the targets the provisioners carry out."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from django.conf import settings
from django.db.models import OuterRef, Prefetch, Q, Subquery
from django.utils.module_loading import import_string

from registry.models import Model, ModelVersion
from registry.selectors import TenantContext, versions_to_serve
from rollouts import judge_lease, quality_floor
from rollouts.judge import VersionWindow
from rollouts.models import Deployment, DeploymentEvent, ScaleTarget, ScalingBounds

logger = logging.getLogger(__name__)


class WindowReader(Protocol):
    def __call__(
        self, *, model_name: str, version: str, start: dt.datetime, end: dt.datetime
    ) -> VersionWindow: ...


class MetricsUnavailable(Exception):
    """The metrics store could not be read; the judge holds (never advances or rolls back blind)."""


def deployment_get(*, deployment_id: int, with_events: bool = True) -> Deployment | None:
    deployments = Deployment.objects.filter(pk=deployment_id).select_related(
        "model", "candidate", "incumbent"
    )
    if with_events:
        deployments = deployments.prefetch_related(
            Prefetch("events", queryset=DeploymentEvent.objects.order_by("at", "id"))
        )
    return deployments.first()


def deployment_ids_to_judge() -> list[int]:
    """Deployments the judge has work on: everything in flight, oldest first."""
    return list(
        Deployment.objects.filter(state__in=Deployment.IN_FLIGHT_STATES)
        .order_by("created_at", "id")
        .values_list("pk", flat=True)
    )


def deployment_in_flight(*, model: Model) -> Deployment | None:
    return deployments_in_flight([model]).get(model.pk)


def _actor_as_seen_by(actor: str, viewer: str | None) -> str:
    """Who did it, as `viewer` (a tenant's actor name; None: staff) may know it: itself by name, staff and
    other tenants only as such (several tenants may deploy one platform model)."""
    if viewer is None or actor == viewer:
        return actor
    if actor.startswith("staff:"):
        return "staff"
    if actor.startswith("tenant:"):
        return "another tenant"
    return actor  # the judge, the system


def deployment_page(
    *, context: TenantContext | None, after: int | None, limit: int
) -> tuple[list[Deployment], bool]:
    """Deployments newest first, up to `limit` of them older than deployment `after` (a cursor), and
    whether there are more. `context`: a tenant, which sees those of the models it may deploy now (its
    own, and the platform's granted it: TenantContext.may_deploy_to); None: staff, every one."""
    query = Deployment.objects.select_related("model", "candidate", "incumbent").order_by("-pk")
    if context is not None:
        query = query.filter(
            Q(model__owner_id=context.tenant_id)
            | Q(model__owner__isnull=True, model__name__in=context.deployable_model_names)
        )
    if after is not None:
        query = query.filter(pk__lt=after)
    rows = list(query[: limit + 1])
    return rows[:limit], len(rows) > limit


def deployment_summary(*, deployment: Deployment, viewer: str | None = None) -> dict[str, Any]:
    """A deployment in a list: where it stands, not its history (deployment_detail has that)."""
    return {
        "deployment_id": deployment.pk,
        "model": deployment.model.name,
        "version": deployment.candidate.version,
        "incumbent": deployment.incumbent.version,
        "strategy": deployment.strategy,
        "state": deployment.state,
        "current_pct": deployment.current_pct,
        "created_by": _actor_as_seen_by(deployment.created_by, viewer),
        "created_at": deployment.created_at,
        "finished_at": deployment.finished_at,
    }


def candidate_quality(deployment: Deployment) -> quality_floor.QualityCheck:
    """Whether the deployment's candidate may advance as far as its recorded quality goes (a shadow's,
    which moves no traffic, always may)."""
    floor = quality_floor.QualityFloor.from_dict(deployment.quality_floor or {})
    candidate = deployment.candidate
    if deployment.strategy != Deployment.Strategy.CANARY:
        return quality_floor.QualityCheck(held=False, reason="", waiting_on=None, figures={})
    return quality_floor.check(
        floor,
        candidate=f"{deployment.model.name}:{candidate.version}",
        quantization=candidate.quantization,
        quality=candidate.quality or {},
    )


def deployment_detail(*, deployment: Deployment, viewer: str | None = None) -> dict[str, Any]:
    """The API's view of one deployment, events included. `viewer`: the tenant asking (its actor name,
    "tenant:NAME"), which sees neither other tenants' names nor staff logins; None: staff."""
    steps = deployment.steps or []
    return {
        **deployment_summary(deployment=deployment, viewer=viewer),
        "current_step": deployment.current_step if steps else None,
        "steps": steps,
        "mirror_pct": deployment.mirror_pct,
        "bake_seconds": deployment.bake_seconds,
        "thresholds": deployment.thresholds,
        "step_started_at": deployment.step_started_at,
        "last_judged_at": deployment.last_judged_at,
        "last_verdict": deployment.last_verdict or None,
        "quality_floor": deployment.quality_floor or {},
        # What it waits on that is not its own to do: a judge that no process runs, or a quantized
        # candidate's evaluation that nobody recorded.
        "waiting_on": (
            judge_lease.missing_judge(since=deployment.created_at) or candidate_quality(deployment).waiting_on
        )
        if deployment.is_in_flight
        else None,
        "rollback": {
            "decided_at": deployment.rollback_decided_at,
            "edit_ms": deployment.rollback_edit_ms,
            "committed_at": deployment.rollback_committed_at,
        }
        if deployment.rollback_decided_at
        else None,
        "events": [
            {
                "at": e.at,
                "from_state": e.from_state or None,
                "to_state": e.to_state,
                "actor": _actor_as_seen_by(e.actor, viewer),
                "reason": e.reason,
                "figures": e.figures,
            }
            for e in deployment.events.all()
        ],
    }


def version_states(*, model: Model) -> dict[str, str]:
    """What deployments say about a model's versions, for GET /v1/models/{model}/versions.

    A candidate reports the state of the latest deployment it was the candidate of, when that
    deployment is the model's latest one (so an old `promoted` does not outlive a newer rollout) or when
    it ended `rolled_back` (that stays true of the version until it is deployed again). The incumbent of
    an in-flight canary reports `incumbent`. Versions not mentioned keep the registry's own state
    (serving / idle)."""
    return version_states_of([model]).get(model.pk, {})


def version_states_of(models: Iterable[Model]) -> dict[int, dict[str, str]]:
    """version_states of several models (model pk -> its states), in one query however many models and
    however long their deployment history: the dashboard asks for every model each push."""
    model_ids = [m.pk for m in models]
    latest_of_version = Subquery(
        Deployment.objects.filter(candidate=OuterRef("pk")).order_by("-created_at", "-id").values("id")[:1]
    )
    latest_ids = (
        ModelVersion.objects.filter(model_id__in=model_ids)
        .annotate(latest=latest_of_version)
        .filter(latest__isnull=False)
        .values_list("latest", flat=True)
    )
    newest_first: dict[int, list[Deployment]] = {}
    for deployment in (
        Deployment.objects.filter(id__in=latest_ids)
        .select_related("candidate", "incumbent")
        .order_by("-created_at", "-id")
    ):
        newest_first.setdefault(deployment.model_id, []).append(deployment)
    # The model's latest deployment is its candidate's latest, so it leads its model's list.
    states: dict[int, dict[str, str]] = {}
    for model_id, deployments in newest_first.items():
        of_model = states.setdefault(model_id, {})
        for index, deployment in enumerate(deployments):
            if index == 0 or deployment.state == Deployment.State.ROLLED_BACK:
                of_model[deployment.candidate.version] = deployment.state
        if deployments[0].is_in_flight:
            of_model.setdefault(deployments[0].incumbent.version, "incumbent")
    return states


def deployments_in_flight(models: Iterable[Model]) -> dict[int, Deployment]:
    """model pk -> its deployment in flight, for the models that have one, in one query."""
    rows = Deployment.objects.filter(
        model_id__in=[m.pk for m in models], state__in=Deployment.IN_FLIGHT_STATES
    ).select_related("candidate", "incumbent")
    return {d.model_id: d for d in rows}


# --- metrics -----------------------------------------------------------------------------------------


def window_reader() -> WindowReader:
    """The metrics store's selector named by settings.ROLLOUT_WINDOW_READER."""
    try:
        reader: Callable[..., Any] = import_string(settings.ROLLOUT_WINDOW_READER)
    except ImportError as exc:
        raise MetricsUnavailable(f"metrics reader {settings.ROLLOUT_WINDOW_READER!r}: {exc}") from exc

    def read(*, model_name: str, version: str, start: dt.datetime, end: dt.datetime) -> VersionWindow:
        return as_version_window(reader(model_name=model_name, version=version, start=start, end=end))

    return read


class _TailInMs:
    """The judge's LatencyTail over a metrics-store histogram, which holds seconds."""

    __slots__ = ("_histogram",)

    def __init__(self, histogram: Any) -> None:
        self._histogram = histogram

    @property
    def count(self) -> int:
        return int(self._histogram.count)

    def count_above(self, value_ms: float) -> int:
        return int(self._histogram.count_above(value_ms / 1000.0))


# A shadow copy's share of agreeing tokens and the index of its first differing token, binned for a
# deployment's figures. The metrics store's histograms place a value within 1% of itself, so a bin's edge
# is that sharp; the token indexes are whole numbers, binned between them.
AGREEMENT_BINS = (
    (0.25, "0-0.25"),
    (0.5, "0.25-0.5"),
    (0.75, "0.5-0.75"),
    (0.9, "0.75-0.9"),
    (0.99, "0.9-0.99"),
)
DIVERGENCE_BINS = (
    (0.5, "0"),
    (1.5, "1"),
    (3.5, "2-3"),
    (7.5, "4-7"),
    (15.5, "8-15"),
    (31.5, "16-31"),
    (63.5, "32-63"),
    (127.5, "64-127"),
)


def _binned(histogram: Any, bins: tuple[tuple[float, str], ...], last: str) -> dict[str, int]:
    cumulative = histogram.cumulative_counts([bound for bound, _ in bins])
    counts, below = {}, 0
    for (_, label), up_to in zip(bins, cumulative, strict=True):
        counts[label], below = up_to - below, up_to
    counts[last] = int(histogram.count) - below
    return counts


def shadow_diff_figures(window: Any) -> dict[str, Any] | None:
    """How a version's compared shadow copies differed from their primaries: the mean share of agreeing
    tokens and its histogram; of those that differed, how many, the mean index of the first differing
    token and its histogram. None when no copy was compared token by token."""
    agreement, divergence = (
        getattr(window, "shadow_agreement", None),
        getattr(window, "shadow_first_divergence", None),
    )
    if agreement is None or not agreement.count:
        return None
    mean_divergence = divergence.mean if divergence is not None and divergence.count else None
    return {
        "compared": int(agreement.count),
        "mean_agreement": round(float(agreement.mean), 4),
        "agreement_histogram": _binned(agreement, AGREEMENT_BINS, "0.99-1"),
        "diverged": int(divergence.count) if divergence is not None else 0,
        "mean_first_divergence": None if mean_divergence is None else round(float(mean_divergence), 2),
        "first_divergence_histogram": (
            _binned(divergence, DIVERGENCE_BINS, "128+") if mean_divergence is not None else {}
        ),
    }


def _mean_of(histogram: Any) -> float | None:
    mean = getattr(histogram, "mean", None)
    return None if mean is None else float(mean)


def as_version_window(window: Any) -> VersionWindow:
    """The judge's view of serving.selectors.VersionWindow: counts as they are, p99s in ms (the store reports
    seconds, from merged histogram buckets), no mean output length when nothing completed."""
    if isinstance(window, VersionWindow):
        return window
    try:
        ttft_p99_s, tpot_p99_s = window.p99_ttft_s, window.p99_tpot_s
        num_ok = int(window.num_requests) - int(window.num_errors)
        return VersionWindow(
            num_requests=int(window.num_requests),
            num_errors=int(window.num_errors),
            num_empty_outputs=int(window.num_empty_outputs),
            ttft_p99_ms=None if ttft_p99_s is None else float(ttft_p99_s) * 1000.0,
            tpot_p99_ms=None if tpot_p99_s is None else float(tpot_p99_s) * 1000.0,
            mean_output_tokens=float(window.mean_output_tokens) if num_ok > 0 else None,
            ttft_tail=_TailInMs(window.ttft),
            tpot_tail=_TailInMs(window.tpot),
            num_shadow_compared=int(getattr(window, "num_shadow_compared", 0)),
            num_shadow_matched=int(getattr(window, "num_shadow_matched", 0)),
            num_truncated=int(getattr(window, "num_truncated", 0)),
            mean_shadow_agreement=_mean_of(getattr(window, "shadow_agreement", None)),
            shadow_diffs=shadow_diff_figures(window),
        )
    except AttributeError as exc:
        raise MetricsUnavailable(f"the metrics window lacks a field the judge needs: {exc}") from exc


def scale_targets() -> dict[tuple[str, str], int]:
    """(model, version) -> the replicas the autoscaler wants; versions it has not decided on are absent."""
    rows = ScaleTarget.objects.select_related("version__model")
    return {(t.version.model.name, t.version.version): t.replicas for t in rows}


def scale_targets_of(*, model: Model) -> dict[str, tuple[int, str]]:
    """version -> (the autoscaler's target, its reason), for the model's versions it has decided on."""
    return scale_targets_by_model([model]).get(model.pk, {})


def scale_targets_by_model(models: Iterable[Model]) -> dict[int, dict[str, tuple[int, str]]]:
    """scale_targets_of several models (model pk -> its targets), in one query."""
    rows = ScaleTarget.objects.filter(version__model_id__in=[m.pk for m in models]).select_related("version")
    targets: dict[int, dict[str, tuple[int, str]]] = {}
    for t in rows:
        targets.setdefault(t.version.model_id, {})[t.version.version] = (t.replicas, t.reason)
    return targets


def scaling_bounds() -> dict[str, tuple[int, int]]:
    """model name -> its own (min, max) replicas, for the models that have them."""
    rows = ScalingBounds.objects.select_related("model")
    return {b.model.name: (b.min_replicas, b.max_replicas) for b in rows}


def wanted_replicas() -> dict[tuple[str, str], int]:
    """What the provisioners carry out: the autoscaler's targets, and for a version that must serve but
    has none yet (the autoscaler has not ticked since it got traffic) its model's minimum, so a new
    canary's replica starts without waiting for the autoscaler (none for a model that scales to zero:
    its first request asks for one)."""
    wanted = scale_targets()
    floor = max(1, int(settings.AUTOSCALER["min_replicas"]))
    bounds = scaling_bounds()
    for ref in versions_to_serve():  # an adapter version runs on its base's replicas
        wanted.setdefault((ref.model_name, ref.version), bounds.get(ref.model_name, (floor, 0))[0])
    return wanted
