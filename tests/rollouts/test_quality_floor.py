"""A canary's quality floor: a candidate whose recorded evaluation against its parent misses the floor, or
a quantized one with none recorded, is held at its step (and says why); above the floor it advances."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from registry.models import ModelVersion
from registry.services import RegistryError
from registry.version_quality import model_version_quality_set
from rollouts import judge_tick, selectors, services
from rollouts.judge import VerdictKind
from rollouts.models import Deployment
from rollouts.quality_floor import QualityFloor, QualityFloorError, check
from tests.rollouts.conftest import FakeMetrics, window

State = Deployment.State
T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
FLOOR = {"min_greedy_agreement": 0.95, "max_perplexity_increase": 0.05}


def quality(agreement: float, increase: float) -> dict[str, Any]:
    return {
        "parent_perplexity": 4.0,
        "perplexity": 4.0 * (1 + increase),
        "perplexity_delta": 4.0 * increase,
        "perplexity_increase": increase,
        "greedy_agreement": agreement,
        "num_tokens": 1000,
        "num_predictions": 998,
        "text_sha256": "ab" * 32,
    }


def tick(deployment: Deployment, seconds: float, metrics: FakeMetrics) -> Any:
    now = T0 + dt.timedelta(seconds=seconds)
    verdict = judge_tick.deployment_judge(deployment=deployment, now=now, read_window=metrics)
    deployment.refresh_from_db()
    return verdict


def ramping(model: Any, *, quality_floor: object = None) -> Deployment:
    deployment = services.deployment_create(
        model=model,
        version="v2",
        created_by="staff:alice",
        steps=[{"pct": 5}, {"pct": 50}, {"pct": 100}],
        bake_seconds=60,
        quality_floor=quality_floor,
    )
    tick(deployment, 0, FakeMetrics())
    assert deployment.state == State.RAMPING and deployment.current_step == 0
    return deployment


def healthy() -> FakeMetrics:
    return FakeMetrics(windows={"v1": window(), "v2": window()})


def quantize_v2(model: Any) -> None:
    # The rows of a quantized sibling, without its artifact (the control plane never opens one).
    v1 = ModelVersion.objects.get(model=model, version="v1")
    ModelVersion.objects.filter(model=model, version="v2").update(quantization="int8-weight", parent=v1)


# --- the rules, pure -------------------------------------------------------------------------------


def test_the_floor_is_checked_field_by_field() -> None:
    assert QualityFloor.from_dict(None).as_dict() == {} and not QualityFloor.from_dict({}).is_set
    assert QualityFloor.from_dict({"min_greedy_agreement": 1, "max_perplexity_increase": None}).as_dict() == {
        "min_greedy_agreement": 1.0
    }
    for bad, message in (
        ([], "must be an object"),
        ({"min_agreement": 0.9}, "unknown quality_floor field"),
        ({"min_greedy_agreement": 1.5}, r"in \[0, 1\]"),
        ({"min_greedy_agreement": True}, "a number or null"),
        ({"max_perplexity_increase": -0.1}, r"in \[0, 1000\]"),
        ({"max_perplexity_increase": "5%"}, "a number or null"),
    ):
        with pytest.raises(QualityFloorError, match=message):
            QualityFloor.from_dict(bad)


def test_the_check_holds_what_is_unmeasured_or_under_the_floor() -> None:
    floor = QualityFloor.from_dict(FLOOR)
    none = QualityFloor()
    assert not check(none, candidate="m:v2", quantization="", quality={}).held  # nothing asked, nothing held
    unmeasured = check(none, candidate="m:v2", quantization="int8-weight", quality={})
    assert unmeasured.held and "int8-weight quantized and has no recorded evaluation" in unmeasured.reason
    assert unmeasured.waiting_on is not None and "m:v2" in unmeasured.waiting_on
    assert check(floor, candidate="m:v2", quantization="", quality={}).held  # a floor asks for a measurement
    under = check(floor, candidate="m:v2", quantization="int8-weight", quality=quality(0.9, 0.08))
    assert under.held and under.waiting_on is None
    assert "greedy agreement 90.00% < the floor's 95.00%" in under.reason
    assert "perplexity increase +8.00% > the floor's 5.00%" in under.reason
    assert not check(floor, candidate="m:v2", quantization="int8-weight", quality=quality(0.97, 0.01)).held
    assert not check(none, candidate="m:v2", quantization="int8-weight", quality=quality(0.5, 3.0)).held


# --- the judge -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_judge_holds_a_canary_under_its_floor_and_advances_it_above(make_model) -> None:
    model = make_model()
    quantize_v2(model)
    candidate = ModelVersion.objects.get(model=model, version="v2")
    model_version_quality_set(model_version=candidate, quality=quality(0.90, 0.01), actor="test")
    deployment = ramping(model, quality_floor=FLOOR)

    verdict = tick(deployment, 61, healthy())  # healthy windows, bake window over: would advance
    assert verdict.kind == VerdictKind.HOLD
    assert (
        "chat:v2 is under its quality floor: greedy agreement 90.00% < the floor's 95.00%" in verdict.reason
    )
    assert deployment.state == State.RAMPING and deployment.current_step == 0
    assert deployment.last_verdict["figures"]["quality"]["floor"] == FLOOR
    held = deployment.events.filter(reason__contains="held past").get()
    assert "under its quality floor" in held.reason  # the step's history says why
    assert (
        selectors.deployment_detail(deployment=deployment)["waiting_on"] is None
    )  # measured: nothing to wait on

    model_version_quality_set(
        model_version=candidate, quality=quality(0.97, 0.01), actor="test"
    )  # re-measured
    assert tick(deployment, 66, healthy()).kind == VerdictKind.ADVANCE
    assert deployment.current_step == 1 and deployment.current_pct == 50


@pytest.mark.django_db
def test_a_quantized_canary_without_an_evaluation_waits_for_one_whatever_the_floor(make_model) -> None:
    model = make_model()
    quantize_v2(model)
    deployment = ramping(model)  # no floor
    verdict = tick(deployment, 61, healthy())
    assert verdict.kind == VerdictKind.HOLD
    assert (
        verdict.reason == "chat:v2 is int8-weight quantized and has no recorded evaluation against its parent"
    )
    detail = selectors.deployment_detail(deployment=deployment)
    assert "an evaluation of chat:v2 against its parent" in detail["waiting_on"]
    assert detail["quality_floor"] == {}

    candidate = ModelVersion.objects.get(model=model, version="v2")
    model_version_quality_set(model_version=candidate, quality=quality(0.5, 2.0), actor="test")  # no floor
    assert tick(deployment, 66, healthy()).kind == VerdictKind.ADVANCE


@pytest.mark.django_db
def test_a_floor_never_rolls_back_and_leaves_a_float_candidates_rules_alone(make_model) -> None:
    model = make_model()
    deployment = ramping(model)  # v2 is a float version, no floor: as before
    assert tick(deployment, 61, healthy()).kind == VerdictKind.ADVANCE
    bad = FakeMetrics(windows={"v1": window(), "v2": window(num_errors=100)})
    assert tick(deployment, 62, bad).kind == VerdictKind.ROLLBACK  # the windows' own rules still act


@pytest.mark.django_db
def test_a_quality_record_needs_its_figures(make_model) -> None:
    candidate = ModelVersion.objects.get(model=make_model(), version="v2")
    with pytest.raises(RegistryError, match="a quality record needs"):
        model_version_quality_set(model_version=candidate, quality={"perplexity": 3.0}, actor="test")
    with pytest.raises(RegistryError, match=r"greedy_agreement must be in \[0, 1\]"):
        model_version_quality_set(model_version=candidate, quality=quality(1.5, 0.0), actor="test")


# --- the API ---------------------------------------------------------------------------------------


def _post(client: Any, body: dict[str, Any]) -> Any:
    return client.post("/v1/deployments", data=json.dumps(body), content_type="application/json")


@pytest.mark.django_db
def test_the_api_takes_the_floor_and_shows_it(staff_client, make_model) -> None:
    make_model()
    refused = _post(
        staff_client, {"model": "chat", "version": "v2", "quality_floor": {"min_greedy_agreement": 2}}
    )
    assert (
        refused.status_code == 400
        and "min_greedy_agreement must be in [0, 1]" in refused.json()["error"]["message"]
    )
    shadow = _post(
        staff_client, {"model": "chat", "version": "v2", "strategy": "shadow", "quality_floor": FLOOR}
    )
    assert (
        shadow.status_code == 400 and "quality_floor is for the canary" in shadow.json()["error"]["message"]
    )
    created = _post(staff_client, {"model": "chat", "version": "v2", "quality_floor": FLOOR})
    assert created.status_code == 202
    detail = staff_client.get(created.headers["Location"]).json()
    assert detail["quality_floor"] == FLOOR
