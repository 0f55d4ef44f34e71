"""Metrics per service tier (docs/architecture.md, "Service tiers"): the samples a replica builds carry
their tier; recorder -> flush -> rows -> merged windows count requests and keep TTFT, TPOT and queue-wait
histograms per tier, over replicas and roll-ups, only for the tiers that had requests; rows written
before tiers were counted still read; /metrics has the series labelled `service_tier`; and a real
request's tier reaches the store."""

import json
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient
from prometheus_client.parser import text_string_to_metric_families

from registry.models import Model, ModelVersion
from serving.engine.sequence import TIER_NAMES
from serving.models import MetricWindow
from serving.replica.step_result import Route, error_sample, request_sample
from serving.telemetry.metric_window import SERVICE_TIERS, MetricsWindow, window_start
from serving.telemetry.metrics_reads import version_series, version_window
from serving.telemetry.metrics_store import metrics_rollup
from serving.telemetry.recorder import (
    MetricsRecorder,
    RequestSample,
    register_recorder,
    unregister_recorder,
)
from serving.transport.protocol import QUEUE_TIMEOUT

MINUTE = 60


@pytest.fixture
def version(db: None) -> ModelVersion:
    model = Model.objects.create(name="chat")
    return ModelVersion.objects.create(
        model=model, version="v1", artifact_uri="/nowhere", sha256="0" * 64, size_bytes=0, files={}
    )


def recorder_for(version: ModelVersion, replica_id: str = "r1") -> MetricsRecorder:
    return MetricsRecorder(
        model_name=version.model.name, version=version.version, version_id=version.pk, replica_id=replica_id
    )


def minute_ago(minutes: float) -> float:
    return (time.time() // MINUTE - minutes) * MINUTE


def at(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=UTC)


def tiered(tier: str | None, ttft: float, *, reason: str = "stop") -> RequestSample:
    return RequestSample(
        reason,
        num_prompt_tokens=7,
        num_output_tokens=10,
        ttft_s=ttft,
        tpot_s=ttft / 10,
        e2e_s=ttft * 2,
        queue_wait_s=ttft / 2,
        service_tier=tier,
    )


def test_telemetry_names_the_engines_tiers_in_its_order() -> None:
    # A route holds the engine's tier index; the metrics name it by SERVICE_TIERS.
    assert SERVICE_TIERS == TIER_NAMES


def test_windows_count_each_tier_over_replicas_and_store_only_the_tiers_served(version) -> None:
    t0 = minute_ago(10)
    first = recorder_for(version, "r1")
    first.record(
        requests=[
            *(tiered("priority", 0.05) for _ in range(3)),
            tiered("flex", 2.0),
            tiered("flex", 2.0, reason="length"),
            RequestSample("error", error_type="internal_error", service_tier="flex"),
            tiered(None, 0.1),  # a tier not known (a gateway's own failure, an older replica's)
            # Neither is a request (as `requests` counts them), in any tier.
            RequestSample("error", error_type="invalid_request_error", service_tier="priority"),
            RequestSample("abort", service_tier="default"),
        ],
        now=t0,
    )
    second = recorder_for(version, "r2")
    second.record(requests=[tiered("priority", 0.5)], now=t0 + 1)
    assert first.flush() == 1 and second.flush() == 1

    row = MetricWindow.objects.get(replica_id="r1")
    assert {name for name in row.counters if name.startswith("tier.")} == {
        "tier.priority.requests",
        "tier.flex.requests",
        "tier.flex.errors",
    }
    assert {name for name in row.histograms if name.startswith("tier.")} == {
        f"tier.{tier}.{name}"
        for tier in ("priority", "flex")
        for name in ("ttft_s", "tpot_s", "queue_wait_s")
    }

    window = version_window(model_name="chat", version="v1", start=at(t0), end=at(t0 + 5))
    assert window.num_requests == 8 and window.num_errors == 1
    assert list(window.tiers) == ["priority", "flex"]  # best first; default had none
    priority, flex = window.tiers["priority"], window.tiers["flex"]
    assert (priority.num_requests, priority.num_errors, priority.ttft.count) == (4, 0, 4)
    assert priority.p99_ttft_s == pytest.approx(0.5, rel=0.01)  # r2's, merged with r1's
    assert priority.ttft.quantile(0.5) == pytest.approx(0.05, rel=0.01)
    assert priority.p99_tpot_s == pytest.approx(0.05, rel=0.01)
    assert (flex.num_requests, flex.num_errors, flex.error_rate) == (3, 1, pytest.approx(1 / 3))
    assert flex.ttft.count == 2 and flex.p99_ttft_s == pytest.approx(2.0, rel=0.01)
    assert flex.queue_wait.quantile(0.99) == pytest.approx(1.0, rel=0.01)
    # The version's own figures are as before: every request, a tier known or not.
    assert window.ttft.count == 7


def test_tiers_survive_the_roll_up_into_minutes(version) -> None:
    old = minute_ago(2 * 24 * 60)  # read from 60 s rows
    for replica_id in ("a", "b"):
        recorder = recorder_for(version, replica_id)
        for second in range(0, 120, 5):
            recorder.record(requests=[tiered("default", 0.1), tiered("flex", 1.0)], now=old + second)
        recorder.flush()
    assert metrics_rollup() == 2
    coarse = MetricWindow.objects.get(resolution_s=60, start=at(old))
    assert coarse.counters["tier.flex.requests"] == 24

    (first, second) = version_series(
        model_name="chat", version="v1", start=at(old), end=at(old + 120), step_s=60
    )
    for minute in (first, second):
        assert list(minute.tiers) == ["default", "flex"]
        assert minute.tiers["default"].num_requests == minute.tiers["flex"].num_requests == 24
        assert minute.tiers["flex"].p99_ttft_s == pytest.approx(1.0, rel=0.01)
        assert minute.tiers["default"].p99_ttft_s == pytest.approx(0.1, rel=0.01)


def test_rows_written_before_tiers_were_counted_still_read(version) -> None:
    t0 = minute_ago(5)
    before = MetricsWindow()
    before.count("requests", 3)
    before.histogram("ttft_s").observe(0.2)
    histograms, counters, gauges = before.to_json()
    MetricWindow.objects.create(
        version=version,
        replica_id="old",
        start=window_start(t0),
        resolution_s=5,
        histograms=histograms,
        counters=counters,
        gauges=gauges,
    )
    old_only = version_window(model_name="chat", version="v1", start=at(t0), end=at(t0 + 5))
    assert old_only.num_requests == 3 and old_only.tiers == {}

    recorder = recorder_for(version, "new")
    recorder.record(requests=[tiered("priority", 0.3)], now=t0 + 1)
    recorder.flush()
    both = version_window(model_name="chat", version="v1", start=at(t0), end=at(t0 + 5))
    assert both.num_requests == 4 and both.ttft.count == 2
    assert list(both.tiers) == ["priority"] and both.tiers["priority"].num_requests == 1


def _families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_prometheus_has_series_labelled_by_service_tier(version, admin_client) -> None:
    recorder = recorder_for(version, "rx")
    recorder.record(
        requests=[
            tiered("priority", 0.004),
            tiered("priority", 0.3),
            RequestSample("error", error_type="queue_timeout", service_tier="flex"),
            tiered(None, 0.02),
        ]
    )
    register_recorder(recorder)
    try:
        families = _families(admin_client.get("/metrics").content.decode())
    finally:
        unregister_recorder(recorder)
    labels = {"model": "chat", "version": "v1", "replica": "rx"}

    requests = families["switchyard_tier_requests"]
    assert requests.type == "counter"
    assert {s.labels["service_tier"]: s.value for s in requests.samples} == {"priority": 2, "flex": 1}
    assert all({k: s.labels[k] for k in labels} == labels for s in requests.samples)
    errors = families["switchyard_tier_errors"].samples
    # Every tier served has each series, at 0 where it had none of that: rate() needs it from the start.
    assert [(s.labels["service_tier"], s.value) for s in errors] == [("priority", 0), ("flex", 1)]

    ttft = families["switchyard_tier_ttft_seconds"]
    assert ttft.type == "histogram"
    by_tier = {(s.name, s.labels["service_tier"], s.labels.get("le")): s.value for s in ttft.samples}
    assert by_tier[("switchyard_tier_ttft_seconds_bucket", "priority", "0.005")] == 1
    assert by_tier[("switchyard_tier_ttft_seconds_bucket", "priority", "+Inf")] == 2
    assert by_tier[("switchyard_tier_ttft_seconds_count", "priority", None)] == 2
    assert by_tier[("switchyard_tier_ttft_seconds_count", "flex", None)] == 0  # errors have no TTFT
    assert {s.labels["service_tier"] for s in ttft.samples} == {"priority", "flex"}  # no default: no traffic
    assert "switchyard_tier_tpot_seconds" in families and "switchyard_tier_queue_wait_seconds" in families

    # The families without tiers are as they were: every request, no service_tier label.
    assert sum(s.value for s in families["switchyard_requests"].samples) == 4
    assert all("service_tier" not in s.labels for s in families["switchyard_ttft_seconds"].samples)


def test_the_replicas_samples_carry_the_tier_its_route_holds() -> None:
    output = SimpleNamespace(
        arrival_time=10.0,
        first_token_time=10.25,
        finished_time=11.0,
        num_output_tokens=4,
        num_prompt_tokens=3,
        finish_reason="stop",
    )
    priority = Route("inbox", 0.0, tier=TIER_NAMES.index("priority"))
    sample = request_sample(output, priority)
    assert (sample.service_tier, sample.ttft_s) == ("priority", pytest.approx(0.25))
    assert request_sample(output, Route("inbox", 0.0)).service_tier is None  # not taken by the model thread

    flex = Route("inbox", 0.0, tier=TIER_NAMES.index("flex"))
    timed_out = error_sample(QUEUE_TIMEOUT, flex)
    assert (timed_out.finish_reason, timed_out.error_type, timed_out.service_tier) == (
        "error",
        QUEUE_TIMEOUT,
        "flex",
    )
    recorder = MetricsRecorder(model_name="chat", version="v1", version_id=0, replica_id="r")
    recorder.record(requests=[sample, timed_out])
    window = recorder.snapshot().totals
    assert window.service_tiers() == ["priority", "flex"]
    assert window.counters["tier.flex.errors"] == 1


@pytest.mark.django_db(transaction=True)
async def test_a_requests_tier_reaches_the_store_through_a_real_replica(make_tenant, runtime) -> None:
    acme = await sync_to_async(make_tenant)("acme", max_service_tier="priority")
    started = datetime.now(tz=UTC) - timedelta(seconds=5)
    client = AsyncClient()
    for tier in ("priority", "flex", "flex"):
        response = await client.post(
            "/v1/models/demo-chat/infer",
            data=json.dumps({"input": "hello", "max_tokens": 2, "service_tier": tier}),
            content_type="application/json",
            headers=acme.auth,
        )
        assert response.status_code == 200, response.content

    assert await runtime.replicas[("demo-chat", "v1")].flush_metrics() >= 1
    window = await sync_to_async(version_window)(
        model_name="demo-chat", version="v1", start=started, end=datetime.now(tz=UTC) + timedelta(seconds=5)
    )
    assert {tier: figures.num_requests for tier, figures in window.tiers.items()} == {
        "priority": 1,
        "flex": 2,
    }
    assert window.tiers["flex"].ttft.count == 2 and window.tiers["flex"].queue_wait.count == 2
