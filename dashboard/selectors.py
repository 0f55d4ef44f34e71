"""Reads for the dashboard: the other apps' selectors, shaped for pages and charts. Nothing here writes.

Every figure comes from an existing reader: versions and traffic from the registry, deployment states
and verdicts from rollouts, latency, rates and batch sizes from the metrics store
(serving.selectors.version_series / version_windows: percentiles of merged histograms),
replicas from
the data plane's runtime (in-process replicas and, with Redis, heartbeats of replica processes).

Chart points are per version, always: a canary's series is never merged with the incumbent's."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Prefetch
from django.utils import timezone

from dashboard import charts, verdicts
from registry.models import ApiKey, Model, Quota, Tenant, is_valid_name
from registry.selectors import model_versions_overview
from rollouts import selectors as rollout_selectors
from rollouts.judge_tick import JUDGE_ACTOR
from rollouts.models import Deployment
from serving import selectors as serving
from serving.selectors import QuotaUsage, ReplicaHandle, version_series, version_windows
from serving.throttle import Throttle

logger = logging.getLogger(__name__)

LIVE_INTERVAL_S = 1.5  # how often the live feed pushes
RATE_WINDOW = timedelta(minutes=1)  # "now" figures (overview, the model page's table)
MAX_VERSIONS_CHARTED = 12


class ModelGone(Exception):
    """The model a live feed follows was deleted."""


# --- versions --------------------------------------------------------------------------------------------


def _models() -> Any:
    return Model.objects.select_related("routing_table").prefetch_related(
        "routing_table__entries", "versions", "aliases"
    )


def model_get(*, name: str) -> Model | None:
    return _models().filter(name=name).first() if is_valid_name(name) else None


def model_versions(*, model: Model) -> list[dict[str, Any]]:
    """The registry's version rows (traffic %, aliases) with the deployment state merged in, as
    GET /v1/models/{model}/versions reports them."""
    return _with_states(
        model_versions_overview(model=model),
        rollout_selectors.version_states(model=model),
        rollout_selectors.scale_targets_of(model=model),
    )


def _with_states(
    rows: list[dict[str, Any]], states: dict[str, str], targets: dict[str, tuple[int, str]]
) -> list[dict[str, Any]]:
    for row in rows:
        row["state"] = states.get(row["version"], row["state"])
        # The autoscaler's target and why (None: it has not decided on this version)
        row["target_replicas"], row["target_reason"] = targets.get(row["version"], (None, ""))
    return rows


def _is_active(row: dict[str, Any]) -> bool:
    """Worth a chart even without data yet: it has traffic, an alias, or a deployment in flight."""
    return row["traffic_pct"] > 0 or bool(row["aliases"]) or row["state"] in Deployment.IN_FLIGHT_STATES


def _version_points(
    *, model_name: str, versions: Iterable[str], start: datetime, end: datetime, step_s: int
) -> dict[str, list[dict[str, Any]]]:
    """Chart points of each version over [start, end), one per step (start aligned to the step)."""
    if end <= start:
        return {version: [] for version in versions}
    return {
        version: [
            charts.chart_point(window)
            for window in version_series(
                model_name=model_name, version=version, start=start, end=end, step_s=step_s
            )
        ]
        for version in versions
    }


def _charted_versions(rows: Sequence[dict[str, Any]], points: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Active versions and those with requests in the range, newest registrations last."""
    charted = [
        row["version"]
        for row in rows
        if _is_active(row) or any(p["n"] for p in points.get(row["version"], ()))
    ]
    return charted[-MAX_VERSIONS_CHARTED:]


def _last_minute(*, model_name: str, versions: Iterable[str], now: datetime) -> dict[str, dict[str, Any]]:
    figures = _last_minute_of(versions=[(model_name, v) for v in versions], now=now)
    return {version: summary for (_, version), summary in figures.items()}


def _last_minute_of(
    *, versions: Iterable[tuple[str, str]], now: datetime
) -> dict[tuple[str, str], dict[str, Any]]:
    """The "now" figures of (model name, version) pairs, of as many models as asked, in one read."""
    end = charts.data_end(now)
    windows = version_windows(versions=versions, start=end - RATE_WINDOW, end=end)
    return {pair: charts.window_summary(window) for pair, window in windows.items()}


# --- replicas (the data plane's runtime) -----------------------------------------------------------------


async def fleet_replicas() -> list[ReplicaHandle]:
    """Every replica this process knows: its own (embedded mode) and, with Redis, fresh heartbeats."""
    return await serving.fleet_replicas()


_directory_unreadable = Throttle()


async def page_replicas() -> tuple[list[ReplicaHandle], bool]:
    """fleet_replicas for a page, and whether that is all of them. With the replica directory unreadable
    (Redis down) the page still loads, with this process's replicas and a note: an outage is when staff
    most need the dashboard. (A live feed skips that push instead, and keeps what it showed.)"""
    try:
        return await fleet_replicas(), True
    except Exception:
        if _directory_unreadable.is_due():
            logger.warning("dashboard: the replica directory cannot be read", exc_info=True)
    return serving.local_replicas(), False


def _replica_row(handle: ReplicaHandle) -> dict[str, Any]:
    return {
        "replica_id": handle.replica_id,
        "model": handle.model_name,
        "version": handle.version,
        "state": handle.state,
        "load": handle.load,
        "queue_depth": handle.queue_depth,
        "running": handle.num_running,
        "kv_pct": round(handle.kv_cache_usage * 100.0, 2),
        "adapters": handle.num_adapters,
        "step_ms": round(handle.step_s * 1000.0, 1) if handle.step_s else None,
        "is_local": handle.is_local,
    }


def _replica_rows(
    replicas: Iterable[ReplicaHandle], *, model_name: str | None = None
) -> list[dict[str, Any]]:
    rows = [_replica_row(h) for h in replicas if model_name is None or h.model_name == model_name]
    return sorted(rows, key=lambda r: (r["model"], r["version"], r["replica_id"]))


def _fleet_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    serving_rows = [r for r in rows if r["state"] in ("ready", "draining")]
    kv = [r["kv_pct"] for r in serving_rows]
    states: dict[str, int] = {}
    for row in rows:
        states[row["state"]] = states.get(row["state"], 0) + 1
    return {
        "num_replicas": len(rows),
        "states": dict(sorted(states.items())),
        "kv_mean_pct": round(sum(kv) / len(kv), 2) if kv else None,
        "kv_max_pct": max(kv) if kv else None,
        "load": sum(r["load"] for r in rows),
        "queue_depth": sum(r["queue_depth"] for r in rows),
    }


# --- pages -----------------------------------------------------------------------------------------------


def overview(*, replicas: Sequence[ReplicaHandle], now: datetime | None = None) -> dict[str, Any]:
    """Every model's shown versions with their last minute, its deployment in flight and its replicas.
    A fixed number of queries however many models there are: the live feed reads this for every open
    page every LIVE_INTERVAL_S."""
    now = now or timezone.now()
    rows = _replica_rows(replicas)
    all_models = list(_models())
    states = rollout_selectors.version_states_of(all_models)
    targets = rollout_selectors.scale_targets_by_model(all_models)
    in_flight = rollout_selectors.deployments_in_flight(all_models)
    shown_of: dict[int, list[dict[str, Any]]] = {}
    num_versions: dict[int, int] = {}
    for model in all_models:
        versions = _with_states(
            model_versions_overview(model=model), states.get(model.pk, {}), targets.get(model.pk, {})
        )
        shown_of[model.pk] = [v for v in versions if _is_active(v)] or versions[-1:]
        num_versions[model.pk] = len(versions)
    figures = _last_minute_of(
        versions=[(m.name, v["version"]) for m in all_models for v in shown_of[m.pk]], now=now
    )
    models = []
    for model in all_models:
        for row in shown_of[model.pk]:
            row.update(figures[(model.name, row["version"])])
        deployment = in_flight.get(model.pk)
        models.append(
            {
                "name": model.name,
                "kind": model.get_kind_display(),
                "versions": shown_of[model.pk],
                "num_versions": num_versions[model.pk],
                "deployment": _deployment_brief(deployment) if deployment else None,
                "replicas": [r for r in rows if r["model"] == model.name],
            }
        )
    return {"models": models, "replicas": rows, "fleet": _fleet_summary(rows), "now": now}


def overview_update(*, replicas: Sequence[ReplicaHandle], now: datetime | None = None) -> dict[str, Any]:
    """One push of the overview's live feed: the page's own figures (overview), read afresh."""
    page = overview(replicas=replicas, now=now)
    return {
        "type": "update",
        "at": charts.chart_time(page["now"]),
        "fleet": page["fleet"],
        "models": [
            {
                "name": model["name"],
                "versions": [
                    {
                        key: row.get(key)
                        for key in (
                            "version",
                            "traffic_pct",
                            "state",
                            "aliases",
                            "req_s",
                            "err_pct",
                            "ttft_p99_ms",
                            "tpot_p99_ms",
                        )
                    }
                    for row in model["versions"]
                ],
                "deployment": model["deployment"],
            }
            for model in page["models"]
        ],
        "replicas": page["replicas"],
    }


def model_page(
    *, model: Model, chart: charts.ChartRange, replicas: Sequence[ReplicaHandle], now: datetime | None = None
) -> dict[str, Any]:
    """Everything the model page draws at load; the live feed sends the same shapes afterwards."""
    now = now or timezone.now()
    versions = model_versions(model=model)
    end = charts.data_end(now)
    # The newest versions, and whichever older ones are active (stable, traffic, a rollout): those are
    # charted however many were registered after them.
    newest = {v["version"] for v in versions[-MAX_VERSIONS_CHARTED * 2 :]}
    points = _version_points(
        model_name=model.name,
        versions=[v["version"] for v in versions if v["version"] in newest or _is_active(v)],
        start=charts.series_start(chart, now),
        end=end,
        step_s=chart.step_s,
    )
    charted = _charted_versions(versions, points)
    return {
        "model": model.name,
        "range": {"key": chart.key, "label": chart.label, "span_s": chart.span_s, "step_s": chart.step_s},
        "versions": versions,
        "charted": charted,
        "points": {v: points[v] for v in charted},
        "last_minute": _last_minute(model_name=model.name, versions=charted, now=now),
        "replicas": _replica_rows(replicas, model_name=model.name),
        "deployment": _latest_deployment_brief(model),
        "at": charts.chart_time(now),
    }


def live_update(
    *,
    model_name: str,
    chart: charts.ChartRange,
    charted: Sequence[str],
    replicas: Sequence[ReplicaHandle],
    with_points: bool = True,
    whole_range: bool = False,
    now: datetime | None = None,
) -> dict[str, Any]:
    """One push of the live feed: the last few steps of each charted version (the client replaces
    points it has), traffic and states, the last minute's figures and the replicas' gauges now.
    `whole_range`: every step of the chart's range instead, for a feed's first push, since the page may
    have missed minutes (a laptop asleep, a reconnect) that the few steps would leave as a straight line.
    Without points (the rollout page) only traffic, states, replicas and the deployment. The model is
    read afresh on every push: its traffic and aliases are what changes."""
    now = now or timezone.now()
    model = model_get(name=model_name)
    if model is None:
        raise ModelGone(f"model {model_name!r} no longer exists")
    versions = model_versions(model=model)
    known = {v["version"] for v in versions}
    active = [v["version"] for v in versions if _is_active(v)]
    charted = list(dict.fromkeys([*(v for v in charted if v in known), *active]))[-MAX_VERSIONS_CHARTED:]
    points, figures = {}, {}
    if with_points:
        points = _version_points(
            model_name=model.name,
            versions=charted,
            start=charts.series_start(chart, now) if whole_range else charts.live_start(chart, now),
            end=charts.data_end(now),
            step_s=chart.step_s,
        )
        figures = _last_minute(model_name=model.name, versions=charted, now=now)
    return {
        "type": "update",
        "at": charts.chart_time(now),
        "versions": versions,
        "charted": charted,
        "points": points,
        "last_minute": figures,
        "replicas": _replica_rows(replicas, model_name=model.name),
        "deployment": _latest_deployment_brief(model),
    }


# --- rollouts --------------------------------------------------------------------------------------------


def _deployment_brief(deployment: Deployment) -> dict[str, Any]:
    return {
        "id": deployment.pk,
        "candidate": deployment.candidate.version,
        "incumbent": deployment.incumbent.version,
        "strategy": deployment.strategy,
        "state": deployment.state,
        "current_pct": deployment.current_pct,
        "is_in_flight": deployment.is_in_flight,
        "created_at": deployment.created_at,
    }


def latest_deployment(*, model: Model) -> Deployment | None:
    """The one in flight, else the newest."""
    deployments = Deployment.objects.filter(model=model).select_related("model", "candidate", "incumbent")
    return rollout_selectors.deployment_in_flight(model=model) or deployments.first()


def _latest_deployment_brief(model: Model) -> dict[str, Any] | None:
    deployment = latest_deployment(model=model)
    return _deployment_brief(deployment) if deployment else None


def deployments_list(*, limit: int = 50) -> list[dict[str, Any]]:
    deployments = Deployment.objects.select_related("model", "candidate", "incumbent")[:limit]
    return [{**_deployment_brief(d), "model": d.model.name} for d in deployments]


def deployment_page(*, deployment_id: int) -> dict[str, Any] | None:
    deployment = rollout_selectors.deployment_get(deployment_id=deployment_id)
    if deployment is None:
        return None
    model = _models().filter(pk=deployment.model_id).first()
    assert model is not None  # a deployment's model is protected from deletion
    detail = rollout_selectors.deployment_detail(deployment=deployment)
    events = [
        {
            **event,
            "is_verdict": event["actor"] == JUDGE_ACTOR,
            "table": verdicts.figures_table(event["figures"]),
        }
        for event in detail["events"]
    ]
    last_verdict = detail["last_verdict"]
    rollback = detail["rollback"]
    if rollback is not None and rollback["committed_at"] is not None:
        took_ms = (rollback["committed_at"] - rollback["decided_at"]).total_seconds() * 1000.0
        rollback = {**rollback, "took_ms": round(took_ms, 1)}
    versions = {row["version"]: row for row in model_versions(model=model)}
    return {
        "deployment": detail,
        "model": model.name,
        "steps": verdicts.step_rows(deployment),
        "events": list(reversed(events)),  # newest first
        "last_verdict": last_verdict,
        "last_verdict_table": verdicts.figures_table(last_verdict["figures"]) if last_verdict else None,
        "shadow": verdicts.shadow_panel(
            last_verdict["figures"] if last_verdict else None,
            serving.shadow_diff_pairs(
                model_name=model.name, version=deployment.candidate.version, since=deployment.created_at
            ),
        )
        if deployment.strategy == Deployment.Strategy.SHADOW
        else None,
        "rollback": rollback,
        "traffic": [
            {**versions[v], "role": role}
            for v, role in (
                (deployment.candidate.version, "candidate"),
                (deployment.incumbent.version, "incumbent"),
            )
            if v in versions
        ],
        "can_rollback": deployment.is_in_flight,
        # Not before the candidate takes traffic (pending, provisioning): it may have no replica yet, and
        # the service would refuse the click.
        "can_promote": deployment.state in (Deployment.State.RAMPING, Deployment.State.SHADOWING),
    }


# --- tenants ---------------------------------------------------------------------------------------------


def _pct(part: float, whole: float) -> float:
    return round(min(100.0, max(0.0, 100.0 * part / whole)), 1) if whole > 0 else 0.0


def _usage_row(usage: QuotaUsage) -> dict[str, Any]:
    """Each limit's use now, with a bar's width (clamped to 0-100 %)."""
    return {
        "in_flight": {
            "used": usage.num_in_flight,
            "size": usage.max_concurrent_requests,
            "pct": _pct(usage.num_in_flight, usage.max_concurrent_requests),
        },
        "requests": {
            "used": round(usage.requests_drawn, 2),
            "size": round(usage.request_bucket_size, 2),
            "pct": _pct(usage.requests_drawn, usage.request_bucket_size),
        },
        "tokens": {
            "used": round(usage.tokens_drawn),
            "size": usage.token_bucket_size,
            "pct": _pct(usage.tokens_drawn, usage.token_bucket_size),
        },
    }


def tenants_page() -> dict[str, Any]:
    """Tenants with their quotas, usage now and keys (prefixes only: keys are stored as hashes).

    Usage and 429 counts come from the gateway's quota store: this process's counters in memory, or
    every gateway's in Redis. A store that cannot be read leaves them out (the page says so)."""
    refusals = serving.quota_refusals()
    tenants = list(
        Tenant.objects.select_related("quota").prefetch_related(
            "quota__allowed_models",
            Prefetch("api_keys", queryset=ApiKey.objects.order_by("-created_at")),
        )
    )
    quotas: dict[int, Quota | None] = {t.pk: getattr(t, "quota", None) for t in tenants}
    usage = serving.quota_usage([q for q in quotas.values() if q is not None])
    rows = []
    for tenant in tenants:
        quota = quotas[tenant.pk]
        rows.append(
            {
                "tenant": tenant,
                "quota": quota,
                "allowed_models": [m.name for m in quota.allowed_models.all()] if quota else [],
                "keys": list(tenant.api_keys.all()),
                "num_active_keys": sum(1 for k in tenant.api_keys.all() if k.revoked_at is None),
                "usage": _usage_row(usage[tenant.pk]) if tenant.pk in usage else None,
                "num_refused_429": None if refusals is None else refusals.get(tenant.pk, 0),
            }
        )
    return {"tenants": rows, "counted_by": serving.quota_counted_by()}


def tenant_get(*, tenant_id: int) -> Tenant | None:
    return Tenant.objects.filter(pk=tenant_id).first()
