"""How a deployment reads on its page: its steps with their status, and a verdict's figures laid out
canary against incumbent (the figures are what rollouts.judge stored with each verdict and event)."""

from __future__ import annotations

from typing import Any

from rollouts.models import Deployment


def step_rows(deployment: Deployment) -> list[dict[str, Any]]:
    rows = []
    for index, step in enumerate(deployment.steps or []):
        if deployment.state == Deployment.State.PROMOTED or index < deployment.current_step:
            status = "done"
        elif index == deployment.current_step and deployment.state == Deployment.State.RAMPING:
            status = "current"
        elif deployment.is_in_flight:
            status = "pending"
        else:
            status = "skipped"
        rows.append({"number": index + 1, "pct": step["pct"], "status": status})
    return rows


def _figure_value(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_figure_value(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(_figure_value(v) for v in value)
    return str(value)


def figures_table(figures: dict[str, Any] | None) -> dict[str, Any]:
    """A verdict's figures for a template: canary vs incumbent side by side, the rest as name/value."""
    figures = dict(figures or {})
    canary, incumbent = figures.pop("canary", None), figures.pop("incumbent", None)
    compare = []
    if isinstance(canary, dict) and isinstance(incumbent, dict):
        for name in dict.fromkeys([*canary, *incumbent]):
            compare.append(
                {
                    "name": name,
                    "canary": _figure_value(canary.get(name)),
                    "incumbent": _figure_value(incumbent.get(name)),
                }
            )
    other = [{"name": name, "value": _figure_value(value)} for name, value in figures.items()]
    return {"compare": compare, "other": other}


def _bars(histogram: dict[str, int] | None) -> list[dict[str, Any]]:
    counts = dict(histogram or {})
    total = sum(counts.values()) or 1
    return [{"label": k, "count": v, "pct": round(100.0 * v / total, 1)} for k, v in counts.items()]


def shadow_panel(figures: dict[str, Any] | None, pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """A shadow deployment's output comparison from the judge's latest figures: the match rate, and
    beside it the copies' mean agreement and first divergence with their histograms
    (rollouts.selectors.shadow_diff_figures); with the differing pairs kept for staff (redacted,
    serving/gateway/shadow_diff.py)."""
    figures = figures or {}
    diff = figures.get("output_diff") or {}
    return {
        "match": figures.get("output_match") or {},
        "diff": diff,
        "agreement_bars": _bars(diff.get("agreement_histogram")),
        "divergence_bars": _bars(diff.get("first_divergence_histogram")),
        "pairs": pairs,
    }
