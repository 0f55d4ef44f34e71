"""The judge's minimum agreement for shadow candidates, and the output diffs a shadow deployment's
verdicts carry (the share of agreeing tokens and the first differing one, as histograms and means)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from rollouts.judge import Thresholds, VerdictKind, decide
from rollouts.selectors import as_version_window, shadow_diff_figures
from rollouts.steps import DeploymentError, resolve_thresholds
from serving.telemetry.histogram import Histogram
from tests.rollouts.conftest import window


def _decide(canary: Any, *, bake_elapsed_s: float = 120.0, **limits: Any) -> Any:
    incumbent = window(num_requests=4000, num_errors=20)
    return decide(
        canary, incumbent, thresholds=Thresholds(**limits), bake_elapsed_s=bake_elapsed_s, bake_seconds=60
    )


def test_a_shadow_candidate_that_agrees_too_little_is_rolled_back_once_baked() -> None:
    canary = window(num_requests=200, num_errors=1, num_shadow_compared=40, mean_shadow_agreement=0.6)
    assert _decide(canary).kind == VerdictKind.ADVANCE  # 0, the default: not judged
    during = _decide(canary, bake_elapsed_s=30, min_agreement=0.9)
    assert during.kind == VerdictKind.HOLD  # like the mean output length: judged on the step's most copies
    after = _decide(canary, min_agreement=0.9)
    assert after.kind == VerdictKind.ROLLBACK
    assert "agree 60.00%" in after.reason and "minimum 90.00%" in after.reason
    assert after.figures["min_agreement"] == 0.9
    agreeing = window(num_requests=200, num_errors=1, num_shadow_compared=40, mean_shadow_agreement=0.95)
    assert _decide(agreeing, min_agreement=0.9).kind == VerdictKind.ADVANCE
    no_copies = window(num_requests=200, num_errors=1)  # nothing compared: nothing to judge
    assert _decide(no_copies, min_agreement=1.0).kind == VerdictKind.ADVANCE


def test_min_agreement_is_a_share_and_defaults_to_off(settings: Any) -> None:
    assert resolve_thresholds({})["min_agreement"] == 0.0
    assert resolve_thresholds({"min_agreement": 1})["min_agreement"] == 1
    assert resolve_thresholds({"min_agreement": 0.75})["min_agreement"] == 0.75
    for bad in (1.01, -0.5, "high", True):
        with pytest.raises(DeploymentError):
            resolve_thresholds({"min_agreement": bad})


@dataclass
class _StoreWindow:
    """The fields of serving.selectors.VersionWindow the judge's view reads."""

    num_requests: int = 100
    num_errors: int = 0
    num_empty_outputs: int = 0
    num_truncated: int = 0
    mean_output_tokens: float = 10.0
    num_shadow_compared: int = 0
    num_shadow_matched: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram.of([0.1] * 10))
    tpot: Histogram = field(default_factory=lambda: Histogram.of([0.01] * 10))
    shadow_agreement: Histogram = field(default_factory=Histogram)
    shadow_first_divergence: Histogram = field(default_factory=Histogram)

    @property
    def p99_ttft_s(self) -> float | None:
        return self.ttft.quantile(0.99)

    @property
    def p99_tpot_s(self) -> float | None:
        return self.tpot.quantile(0.99)


def test_the_diffs_are_binned_and_averaged_from_the_store_histograms() -> None:
    agreements = [1.0, 1.0, 1.0, 0.95, 0.8, 0.6, 0.3, 0.1]
    divergences = [0, 2, 5, 40, 300]
    store = _StoreWindow(
        num_shadow_compared=8,
        num_shadow_matched=3,
        shadow_agreement=Histogram.of(agreements),
        shadow_first_divergence=Histogram.of(divergences),
    )
    figures = shadow_diff_figures(store)
    assert figures is not None
    assert figures["compared"] == 8 and figures["diverged"] == 5
    assert figures["mean_agreement"] == pytest.approx(sum(agreements) / 8, abs=1e-4)
    assert figures["mean_first_divergence"] == pytest.approx(sum(divergences) / 5)
    assert figures["agreement_histogram"] == {
        "0-0.25": 1,
        "0.25-0.5": 1,
        "0.5-0.75": 1,
        "0.75-0.9": 1,
        "0.9-0.99": 1,
        "0.99-1": 3,
    }
    assert figures["first_divergence_histogram"] == {
        "0": 1,
        "1": 0,
        "2-3": 1,
        "4-7": 1,
        "8-15": 0,
        "16-31": 0,
        "32-63": 1,
        "64-127": 0,
        "128+": 1,
    }
    view = as_version_window(store)
    assert view.mean_shadow_agreement == pytest.approx(sum(agreements) / 8)
    assert view.shadow_diffs == figures
    assert shadow_diff_figures(_StoreWindow()) is None  # no copy compared token by token
    assert as_version_window(_StoreWindow()).mean_shadow_agreement is None


@pytest.mark.django_db
def test_a_shadow_deployments_verdict_carries_its_output_diffs(make_model) -> None:
    from rollouts import judge_tick, services
    from tests.rollouts.conftest import FakeMetrics

    model = make_model("chat")
    deployment = services.deployment_create(
        model=model, version="v2", created_by="staff:alice", strategy="shadow", steps=None, mirror_pct=50
    )
    diffs = {"compared": 4, "mean_agreement": 0.5, "diverged": 2}
    metrics = FakeMetrics(
        {
            "v1": window(num_requests=400),
            "v2": window(num_requests=400, num_shadow_compared=4, num_shadow_matched=2, shadow_diffs=diffs),
        }
    )
    judge_tick.deployment_judge(deployment=deployment, read_window=metrics)  # provisioned: shadowing
    deployment.refresh_from_db()
    deployment.step_started_at = timezone.now() - timedelta(seconds=5)
    deployment.save()
    verdict = judge_tick.deployment_judge(deployment=deployment, read_window=metrics)
    assert verdict is not None
    assert verdict.figures["output_match"] == {"compared": 4, "matched": 2, "rate": 0.5}
    assert verdict.figures["output_diff"] == diffs
