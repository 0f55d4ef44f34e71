"""The metrics store end to end: recorder -> flush -> rows -> merged windows, roll-up and retention,
/metrics, and a real request through the infer endpoint."""

import asyncio
import json
import math
import random
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.test import AsyncClient
from prometheus_client.parser import text_string_to_metric_families

from serving.models import MetricWindow
from serving.telemetry.histogram import Histogram
from serving.telemetry.recorder import (
    MetricsRecorder,
    RequestSample,
    StepSample,
    register_recorder,
    unregister_recorder,
)

MINUTE = 60


def exact_quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered) - 1e-9))) - 1]


@pytest.fixture
def version(db):
    from registry.models import Model, ModelVersion

    model = Model.objects.create(name="chat")
    return ModelVersion.objects.create(
        model=model, version="v1", artifact_uri="/nowhere", sha256="0" * 64, size_bytes=0, files={}
    )


def recorder_for(version, replica_id: str = "r1") -> MetricsRecorder:
    return MetricsRecorder(
        model_name=version.model.name, version=version.version, version_id=version.pk, replica_id=replica_id
    )


def minute_ago(minutes: float) -> float:
    """A minute-aligned wall-clock timestamp `minutes` back."""
    return (time.time() // MINUTE - minutes) * MINUTE


def at(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=UTC)


def done(ttft: float, *, tokens: int = 10, reason: str = "stop", tpot: float = 0.02) -> RequestSample:
    return RequestSample(
        reason,
        num_prompt_tokens=7,
        num_output_tokens=tokens,
        ttft_s=ttft,
        tpot_s=tpot if tokens > 1 else None,
        e2e_s=ttft + tpot * max(0, tokens - 1),
        queue_wait_s=ttft / 2,
    )


def step(model_time: float = 0.01, batch: int = 4) -> StepSample:
    return StepSample(model_time, batch, num_waiting=2, num_running=batch, kv_cache_usage=0.25, itl_s=[0.02])


def test_round_trip_with_exact_counts(version) -> None:
    from serving.telemetry.metrics_reads import version_window

    t0 = minute_ago(10)
    recorder = recorder_for(version)
    recorder.record(
        requests=[done(0.1), done(0.2, reason="length"), done(0.3, tokens=0)], step=step(), now=t0
    )
    recorder.record(
        requests=[
            RequestSample("error", num_prompt_tokens=7, error_type="injected_fault"),
            RequestSample("error", error_type="internal_error"),
            RequestSample("abort"),
            RequestSample("error", error_type="invalid_request_error"),
        ],
        step=step(0.03),
        now=t0 + 1,
    )
    assert recorder.flush() == 1
    recorder.record(requests=[done(0.4)], now=t0 + 4.9)  # same 5 s window, a second flush merges into it
    recorder.record(requests=[done(0.5)], now=t0 + 5)  # the next window
    assert recorder.flush() == 2
    assert recorder.flush() == 0
    rows = list(MetricWindow.objects.order_by("start"))
    assert [(r.start, r.resolution_s, r.replica_id) for r in rows] == [
        (at(t0), 5, "r1"),
        (at(t0 + 5), 5, "r1"),
    ]

    window = version_window(model_name="chat", version="v1", start=at(t0), end=at(t0 + 10))
    assert (window.num_requests, window.num_errors, window.num_empty_outputs, window.num_truncated) == (
        7,
        2,
        1,
        1,
    )
    assert window.output_tokens == 10 * 4
    assert window.errors_by_type == {"injected_fault": 1, "internal_error": 1}
    assert (window.num_aborted, window.num_rejected) == (1, 1)
    assert window.error_rate == pytest.approx(2 / 7)
    assert window.empty_output_rate == pytest.approx(1 / 5)
    assert window.mean_output_tokens == pytest.approx(40 / 5)
    assert window.ttft.count == 5 and window.tpot.count == 4
    assert window.p50_ttft_s == pytest.approx(0.3, rel=0.01)
    assert window.p99_ttft_s == pytest.approx(0.5, rel=0.01)
    assert window.model_time.count == 2 and window.model_time.max == 0.03
    assert window.batch_size.quantile(1.0) == 4
    assert window.gauges["kv_cache_usage"].mean == pytest.approx(0.25)

    first_only = version_window(model_name="chat", version="v1", start=at(t0), end=at(t0 + 5))
    assert first_only.num_requests == 6  # [start, end): the row starting at t0 + 5 is out
    nothing = version_window(model_name="chat", version="v9", start=at(t0), end=at(t0 + 10))
    assert nothing.num_requests == 0 and nothing.p99_ttft_s is None and nothing.error_rate == 0.0


def test_windows_of_two_replicas_merge_and_p99_comes_from_buckets(version) -> None:
    from serving.telemetry.metrics_reads import version_series, version_window

    rng = random.Random(3)
    t0 = minute_ago(5)
    fast = [rng.uniform(0.02, 0.05) for _ in range(2000)]
    slow = [rng.uniform(0.02, 0.05) for _ in range(150)] + [rng.uniform(2.0, 3.0) for _ in range(50)]
    for replica_id, samples in (("fast", fast), ("slow", slow)):
        recorder = recorder_for(version, replica_id)
        for i, ttft in enumerate(samples):
            recorder.record(requests=[done(ttft)], now=t0 + (i % 60))
        recorder.flush()
    assert MetricWindow.objects.count() == 24  # 12 windows x 2 replicas

    window = version_window(model_name="chat", version="v1", start=at(t0), end=at(t0 + 60))
    assert window.num_requests == 2200
    exact = exact_quantile(fast + slow, 0.99)
    assert window.p99_ttft_s == pytest.approx(exact, rel=0.01)
    averaged = (Histogram.of(fast).quantile(0.99) + Histogram.of(slow).quantile(0.99)) / 2
    assert abs(averaged - exact) / exact > 0.3
    assert window.p95_ttft_s == pytest.approx(exact_quantile(fast + slow, 0.95), rel=0.01)

    series = version_series(model_name="chat", version="v1", start=at(t0), end=at(t0 + 60), step_s=15)
    assert [w.start for w in series] == [at(t0 + 15 * i) for i in range(4)]
    assert sum(w.num_requests for w in series) == 2200
    assert Histogram.merged(w.ttft for w in series) == window.ttft


def test_selectors_refuse_naive_or_reversed_times(version) -> None:
    from serving.telemetry.metrics_reads import version_series, version_window

    with pytest.raises(ValueError, match="timezone-aware"):
        version_window(model_name="chat", version="v1", start=datetime(2026, 1, 1), end=datetime(2026, 1, 2))
    with pytest.raises(ValueError, match="before it starts"):
        version_window(model_name="chat", version="v1", start=at(100), end=at(50))
    with pytest.raises(ValueError, match="step_s"):
        version_series(model_name="chat", version="v1", start=at(0), end=at(50), step_s=0)


def test_rollup_merges_replicas_per_minute_and_retention_prunes(version) -> None:
    from serving.telemetry.metrics_reads import version_window
    from serving.telemetry.metrics_store import PruneResult, metrics_maintain, metrics_rollup

    old = minute_ago(2 * 24 * 60)  # two days back: read from 60 s rows
    for replica_id in ("a", "b"):
        recorder = recorder_for(version, replica_id)
        for second in range(0, 120, 5):
            recorder.record(requests=[done(0.1 + second / 1000)], step=step(), now=old + second)
        recorder.flush()
    assert MetricWindow.objects.filter(resolution_s=5).count() == 48

    assert metrics_rollup() == 2
    coarse = MetricWindow.objects.filter(resolution_s=60).order_by("start")
    assert [(r.start, r.replica_id, r.counters["requests"]) for r in coarse] == [
        (at(old), "", 24),
        (at(old + 60), "", 24),
    ]
    assert metrics_rollup() == 0  # idempotent: nothing changed since

    # A late flush into a rolled-up minute: that minute is rolled up again.
    late = recorder_for(version, "a")
    late.record(requests=[done(9.0)], now=old + 30)
    late.flush()
    assert metrics_rollup() == 1
    assert MetricWindow.objects.get(resolution_s=60, start=at(old)).counters["requests"] == 25

    # Both resolutions are stored for those minutes; a read counts each request once.
    window = version_window(model_name="chat", version="v1", start=at(old), end=at(old + 120))
    assert window.num_requests == 49
    assert window.ttft.max == 9.0 and window.ttft.count == 49

    recent = minute_ago(3)
    fresh = recorder_for(version, "a")
    fresh.record(requests=[done(0.1)], now=recent)
    fresh.flush()
    very_old = recorder_for(version, "a")
    very_old.record(requests=[done(0.1)], now=minute_ago(31 * 24 * 60))
    very_old.flush()

    result = metrics_maintain()  # rolls up first, so no 5 s row goes before its minute is in a 60 s row
    assert result.num_fine_deleted == 48 + 1  # over 24 h old: two days back and 31 days back
    assert result.num_coarse_deleted == 1  # over 30 days old
    assert set(MetricWindow.objects.values_list("resolution_s", "start")) == {
        (60, at(old)),
        (60, at(old + 60)),
        (60, at(recent)),
        (5, at(recent)),
    }
    assert metrics_maintain() == PruneResult(0, 0)
    assert (
        version_window(model_name="chat", version="v1", start=at(old), end=at(old + 120)).num_requests == 49
    )


def test_a_failed_flush_keeps_the_windows_for_the_next_one(version, monkeypatch) -> None:
    import serving.telemetry.recorder

    t0 = minute_ago(2)
    recorder = recorder_for(version)
    recorder.record(requests=[done(0.1), done(0.2)], now=t0)

    def broken(**kwargs: object) -> int:
        raise RuntimeError("database down")

    monkeypatch.setattr(serving.telemetry.recorder, "metrics_flush", broken)
    with pytest.raises(RuntimeError):
        recorder.flush()
    assert recorder.snapshot().totals.counters["requests"] == 2  # /metrics still counts them
    monkeypatch.undo()
    recorder.record(requests=[done(0.3)], now=t0 + 1)
    assert recorder.flush() == 1
    assert MetricWindow.objects.get().counters["requests"] == 3
    assert recorder.snapshot().totals.counters["requests"] == 3


def _families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_prometheus_exposition_parses_and_is_labelled(version, admin_client) -> None:
    client = admin_client
    recorder = recorder_for(version, "rx")
    recorder.record(requests=[done(0.004), done(0.02), done(0.3, reason="length")], step=step(0.012, 3))
    recorder.record(requests=[RequestSample("error", error_type="injected_fault")])
    register_recorder(recorder)
    try:
        response = client.get("/metrics")
    finally:
        unregister_recorder(recorder)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    families = _families(response.content.decode())
    labels = {"model": "chat", "version": "v1", "replica": "rx"}

    ttft = {(s.name, s.labels.get("le")): s.value for s in families["switchyard_ttft_seconds"].samples}
    assert families["switchyard_ttft_seconds"].type == "histogram"
    assert ttft[("switchyard_ttft_seconds_bucket", "0.005")] == 1
    assert ttft[("switchyard_ttft_seconds_bucket", "0.025")] == 2
    assert ttft[("switchyard_ttft_seconds_bucket", "+Inf")] == 3
    assert ttft[("switchyard_ttft_seconds_count", None)] == 3
    assert ttft[("switchyard_ttft_seconds_sum", None)] == pytest.approx(0.324)
    assert all(
        {k: s.labels[k] for k in labels} == labels for s in families["switchyard_ttft_seconds"].samples
    )

    requests = {s.labels["finish_reason"]: s.value for s in families["switchyard_requests"].samples}
    assert requests == {"stop": 2, "length": 1, "error": 1}
    errors = families["switchyard_errors"].samples
    assert [(s.labels["type"], s.value) for s in errors] == [("injected_fault", 1)]
    assert families["switchyard_output_tokens"].samples[0].value == 30
    assert families["switchyard_kv_cache_usage_ratio"].samples[0].value == 0.25
    assert families["switchyard_last_batch_size"].samples[0].labels == labels

    assert client.post("/metrics").status_code == 405
    unregistered = _families(client.get("/metrics").content.decode())
    assert unregistered["switchyard_ttft_seconds"].samples == []


def test_metrics_are_for_staff_and_the_scrape_token_only(
    version, client, django_user_model, settings
) -> None:
    register_recorder(recorder := recorder_for(version, "rx"))
    try:
        anonymous = client.get("/metrics")
        assert anonymous.status_code == 401
        assert anonymous["WWW-Authenticate"].startswith("Bearer")
        assert anonymous.json()["error"]["type"] == "authentication_error"
        assert b"chat" not in anonymous.content  # the model's name is what it must not tell

        settings.METRICS_TOKEN = ""  # none configured: no bearer token opens it, not even an empty one
        assert client.get("/metrics", headers={"Authorization": "Bearer "}).status_code == 401

        settings.METRICS_TOKEN = "s3cret-scrape"
        wrongs = (
            "Bearer s3cret",
            "Bearer s3cret-scrape-x",
            "Basic s3cret-scrape",
            "s3cret-scrape",
            "Bearer é",
        )
        for wrong in wrongs:
            assert client.get("/metrics", headers={"Authorization": wrong}).status_code == 401, wrong
        scraped = client.get("/metrics", headers={"Authorization": "Bearer s3cret-scrape"})
        assert scraped.status_code == 200 and 'model="chat"' in scraped.content.decode()

        tenant_user = django_user_model.objects.create_user("someone", password="pw-someone-1")
        client.force_login(tenant_user)
        assert client.get("/metrics").status_code == 403
    finally:
        unregister_recorder(recorder)


def test_a_replica_process_metrics_port_answers_the_token_only(version, settings) -> None:
    import urllib.error
    import urllib.request

    from serving.telemetry.prometheus import start_metrics_server

    settings.METRICS_TOKEN = "s3cret-scrape"
    register_recorder(recorder := recorder_for(version, "rx"))
    server = start_metrics_server(0, "127.0.0.1")
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=5)
        assert refused.value.code == 401
        assert json.loads(refused.value.read())["error"]["type"] == "authentication_error"
        request = urllib.request.Request(url, headers={"Authorization": "Bearer s3cret-scrape"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert 'replica="rx"' in response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        unregister_recorder(recorder)


def test_run_replica_refuses_a_metrics_port_without_a_token(settings) -> None:
    from django.core.management import CommandError, call_command

    settings.REDIS_URL = "redis://127.0.0.1:6379/0"
    settings.METRICS_TOKEN = ""
    with pytest.raises(CommandError, match="SWITCHYARD_METRICS_TOKEN"):
        call_command("run_replica", "--model", "chat", "--version", "v1", "--metrics-port", "9100")


# --- a real replica ------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_a_request_through_the_infer_endpoint_shows_up_after_a_flush(
    make_tenant, runtime, settings
) -> None:
    from asgiref.sync import sync_to_async

    from serving.telemetry.metrics_reads import version_window

    acme = await sync_to_async(make_tenant)("acme")
    started = datetime.now(tz=UTC) - timedelta(seconds=5)
    client = AsyncClient()
    for max_tokens in (4, 1):
        response = await client.post(
            "/v1/models/demo-chat/infer",
            data=json.dumps({"input": "hello", "max_tokens": max_tokens, "temperature": 0}),
            content_type="application/json",
            headers=acme.auth,
        )
        assert response.status_code == 200, response.content

    replica = runtime.replicas[("demo-chat", "v1")]
    assert await replica.flush_metrics() >= 1
    window = await sync_to_async(version_window)(
        model_name="demo-chat", version="v1", start=started, end=datetime.now(tz=UTC) + timedelta(seconds=5)
    )
    assert (window.num_requests, window.num_errors, window.num_truncated, window.output_tokens) == (
        2,
        0,
        2,
        5,
    )
    assert window.ttft.count == 2 and window.e2e.count == 2 and window.queue_wait.count == 2
    assert window.tpot.count == 1  # a 1-token request has no time per output token
    assert window.itl.count == 3  # the 4-token request's tokens after its first
    assert window.model_time.count >= 4
    assert 0 < window.p99_ttft_s < 10
    assert window.queue_wait.max <= window.ttft.max

    settings.METRICS_TOKEN = "scrape"
    scrape = await client.get("/metrics", headers={"Authorization": "Bearer scrape"})
    families = _families(scrape.content.decode())
    counts = [s for s in families["switchyard_requests"].samples if s.labels["version"] == "v1"]
    assert [(s.labels["model"], s.labels["finish_reason"], s.value) for s in counts] == [
        ("demo-chat", "length", 2)
    ]


@pytest.mark.django_db(transaction=True)
async def test_the_replica_flushes_on_its_own_every_interval(make_tenant, registered_model, settings) -> None:
    from asgiref.sync import sync_to_async

    from serving.runtime import get_runtime

    settings.METRICS_FLUSH_INTERVAL_S = 0.1
    runtime = await get_runtime()
    assert await runtime.wait_ready()
    acme = await sync_to_async(make_tenant)("acme")
    response = await AsyncClient().post(
        "/v1/models/demo-chat/infer",
        data=json.dumps({"input": "hello", "max_tokens": 2}),
        content_type="application/json",
        headers=acme.auth,
    )
    assert response.status_code == 200
    deadline = time.monotonic() + 5
    # The request's steps may straddle two 5-s windows; the one it ended in counts it.
    while not (rows := [w async for w in MetricWindow.objects.filter(version=registered_model)]) or not any(
        w.counters.get("requests") for w in rows
    ):
        assert time.monotonic() < deadline, "no flush within 5 s"
        await asyncio.sleep(0.05)
    assert sum(w.counters.get("requests", 0) for w in rows) == 1
    assert {w.replica_id for w in rows} == {runtime.replicas[("demo-chat", "v1")].replica_id}


def test_a_series_by_the_minute_reads_rolled_up_minutes_and_counts_each_request_once(
    version, django_assert_max_num_queries
) -> None:
    """A day's chart reads a 60 s row a minute where the minute is rolled up (a day of 5 s rows is
    17,280 a replica), the 5 s rows where it is not yet, or where a late flush changed it since."""
    from serving.telemetry.metrics_reads import version_series
    from serving.telemetry.metrics_store import metrics_rollup

    t0 = minute_ago(10)
    for replica_id in ("a", "b"):
        recorder = recorder_for(version, replica_id)
        for second in range(0, 180, 5):
            recorder.record(requests=[done(0.1)], now=t0 + second)
        recorder.flush()
    assert metrics_rollup() == 3
    late = recorder_for(version, "a")
    late.record(requests=[done(9.0)], now=t0 + 70)  # minute 2 changes after its roll-up
    late.flush()
    fresh = recorder_for(version, "b")
    fresh.record(requests=[done(0.1)], now=t0 + 185)  # minute 4: not rolled up yet

    def series():  # type: ignore[no-untyped-def]
        return version_series(model_name="chat", version="v1", start=at(t0), end=at(t0 + 240), step_s=60)

    fresh.flush()
    with django_assert_max_num_queries(4):
        counts = [w.num_requests for w in series()]
    assert counts == [24, 25, 24, 1]
    assert series()[1].ttft.max == 9.0
    # Minute 1 is read from its 60 s row alone: with its 5 s rows gone, it reads the same.
    MetricWindow.objects.filter(resolution_s=5, start__gte=at(t0), start__lt=at(t0 + 60)).delete()
    assert [w.num_requests for w in series()] == [24, 25, 24, 1]


def test_a_days_series_reads_a_thousand_minutes_not_yet_rolled_up(version) -> None:
    """A roll-up that stalled for 17 hours left over a thousand minutes to read from their 5 s rows: one
    expression over all of them was more than SQLite would parse, and the 24 h chart a 500."""
    from serving.telemetry.metrics_reads import version_series

    recorder = recorder_for(version)
    t0 = minute_ago(1100)
    for minute in range(1100):
        recorder.record(requests=[done(0.1)], now=t0 + minute * MINUTE)
        if minute % 100 == 99:
            recorder.flush()  # a recorder holds at most an hour of windows
    recorder.flush()
    assert MetricWindow.objects.filter(resolution_s=5, is_rolled_up=False).count() == 1100
    start = (t0 // 900) * 900
    series = version_series(
        model_name="chat", version="v1", start=at(start), end=at(minute_ago(0)), step_s=900
    )
    assert sum(w.num_requests for w in series) == 1100
