"""`GET /metrics`: the replicas of this process in Prometheus text format, labelled by model, version
and replica. Counters and histograms are totals since each replica started; histograms are our
log-bucket histograms reported at a reduced set of `le` bounds (aggregate them in PromQL with
histogram_quantile over sum by (le, model, version)). In production each `run_replica` process
serves the same text on its own port (`--metrics-port`).

Not public: the text names every model and version the process serves, other tenants' included. A
staff session may read it, and a scraper that sends `Authorization: Bearer` with
settings.METRICS_TOKEN."""

from __future__ import annotations

import hmac
import json
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import (
    CONTENT_TYPE_LATEST,
    ThreadingWSGIServer,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from registry.authentication import bearer_token
from registry.errors import error_body, error_response
from serving.telemetry import metric_window as m
from serving.telemetry.histogram import Histogram
from serving.telemetry.recorder import MetricsRecorder, RecorderSnapshot, live_recorders
from serving.telemetry.shadow_copies import shadow_copy_counts
from serving.telemetry.ttft_forecasts import slo_refusal_counts, ttft_forecast_errors

SECONDS_BOUNDS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
)
BATCH_SIZE_BOUNDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
AGREEMENT_BOUNDS = (0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
TOKEN_INDEX_BOUNDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
LABELS = ("model", "version", "replica")

# (recorder's name, exposed name, help, bounds)
_HISTOGRAMS = (
    (
        "ttft_s",
        "switchyard_ttft_seconds",
        "Time to first token, from arrival at the gateway.",
        SECONDS_BOUNDS,
    ),
    (
        "tpot_s",
        "switchyard_tpot_seconds",
        "Mean time per output token after the first, per request.",
        SECONDS_BOUNDS,
    ),
    (
        "itl_s",
        "switchyard_inter_token_latency_seconds",
        "Time between a request's consecutive tokens.",
        SECONDS_BOUNDS,
    ),
    ("queue_wait_s", "switchyard_queue_wait_seconds", "From arrival to first scheduled.", SECONDS_BOUNDS),
    (
        "model_time_s",
        "switchyard_step_seconds",
        "Time of one engine step (forward pass and sampling).",
        SECONDS_BOUNDS,
    ),
    ("e2e_s", "switchyard_request_duration_seconds", "From arrival to the last token.", SECONDS_BOUNDS),
    ("batch_size", "switchyard_batch_size", "Sequences scheduled per engine step.", BATCH_SIZE_BOUNDS),
    (
        "batch_fill_s",
        "switchyard_batch_fill_seconds",
        "Dynamic batcher: from a batch's oldest input's arrival to the batch's close.",
        SECONDS_BOUNDS,
    ),
    (
        m.SHADOW_AGREEMENT,
        "switchyard_shadow_agreement_ratio",
        "Shadow copies compared with their primary: the share of the shorter output's tokens that agree.",
        AGREEMENT_BOUNDS,
    ),
    (
        m.SHADOW_FIRST_DIVERGENCE,
        "switchyard_shadow_first_divergence_tokens",
        "Shadow copies whose output differed from their primary's: the index of the first differing token.",
        TOKEN_INDEX_BOUNDS,
    ),
)
_TOKEN_COUNTERS = (
    (m.PROMPT_TOKENS, "switchyard_prompt_tokens", "Prompt tokens of ended requests."),
    (m.OUTPUT_TOKENS, "switchyard_output_tokens", "Output tokens of ended requests."),
    (
        m.SHADOW_COMPARED,
        "switchyard_shadow_compared",
        "Shadow copies (of requests with reproducible sampling) compared with their primary's output.",
    ),
    (m.SHADOW_MATCHED, "switchyard_shadow_matched", "Shadow copies whose text matched their primary's."),
)
# (labelled counter prefix, exposed name, label, help)
_LABELLED_COUNTERS = (
    (m.FINISH_PREFIX, "switchyard_requests", "finish_reason", "Requests ended, by finish reason."),
    (m.ERROR_PREFIX, "switchyard_errors", "type", "Requests ended in an error, by type."),
    (m.REJECTED_PREFIX, "switchyard_rejected_requests", "type", "Requests refused before any model work."),
    (
        m.BATCH_CLOSED_PREFIX,
        "switchyard_batches_closed",
        "reason",
        "Dynamic batcher: batches, by why they closed.",
    ),
)
# Per service tier (docs/architecture.md, "Service tiers"), labelled `service_tier` as well, for the tiers
# a replica has served: families of their own rather than a label on the ones above, whose series would
# then be counted twice by a sum over the new label's absence, and which requests of no known tier (an
# older replica's) still fill. (recorder's name of each tier, exposed name, help)
_TIER_COUNTERS = (
    (m.REQUESTS, "switchyard_tier_requests", "Requests ended (stop, length or error), by service tier."),
    (m.ERRORS, "switchyard_tier_errors", "Requests ended in an error, by service tier."),
)
_TIER_HISTOGRAMS = (
    ("ttft_s", "switchyard_tier_ttft_seconds", "Time to first token, by service tier."),
    (
        "tpot_s",
        "switchyard_tier_tpot_seconds",
        "Mean time per output token after the first, by service tier.",
    ),
    (
        "queue_wait_s",
        "switchyard_tier_queue_wait_seconds",
        "From arrival to first scheduled, by service tier.",
    ),
)
TIER_LABELS = (*LABELS, "service_tier")
_GAUGES = (
    ("queue_depth", "switchyard_queue_depth", "Requests waiting in the engine after the last step."),
    ("running", "switchyard_running_requests", "Requests running in the engine after the last step."),
    ("kv_cache_usage", "switchyard_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use."),
    ("batch_size", "switchyard_last_batch_size", "Sequences scheduled in the last engine step."),
    ("adapters", "switchyard_resident_adapters", "LoRA adapters loaded in the replica's engine."),
)


class SwitchyardCollector:
    def __init__(self, source: Callable[[], list[MetricsRecorder]] = live_recorders) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        snapshots = sorted(
            (recorder.snapshot() for recorder in self._source()),
            key=lambda s: (s.model_name, s.version, s.replica_id),
        )
        for key, name, documentation, bounds in _HISTOGRAMS:
            histograms = HistogramMetricFamily(name, documentation, labels=LABELS)
            les = [floatToGoString(bound) for bound in bounds]
            for snapshot in snapshots:
                histogram = snapshot.totals.histograms.get(key) or Histogram()
                counts = histogram.cumulative_counts(bounds, monotonic=True)
                histograms.add_metric(
                    _labels(snapshot),
                    [*zip(les, counts, strict=True), ("+Inf", histogram.count)],
                    sum_value=histogram.sum,
                )
            yield histograms
        for key, name, documentation in _TOKEN_COUNTERS:
            counter = CounterMetricFamily(name, documentation, labels=LABELS)
            for snapshot in snapshots:
                counter.add_metric(_labels(snapshot), snapshot.totals.counters.get(key, 0))
            yield counter
        for prefix, name, label, documentation in _LABELLED_COUNTERS:
            counter = CounterMetricFamily(name, documentation, labels=(*LABELS, label))
            for snapshot in snapshots:
                for counter_name, value in sorted(snapshot.totals.counters.items()):
                    if counter_name.startswith(prefix):
                        counter.add_metric([*_labels(snapshot), counter_name.removeprefix(prefix)], value)
            yield counter
        for key, name, documentation in _GAUGES:
            gauge = GaugeMetricFamily(name, documentation, labels=LABELS)
            for snapshot in snapshots:
                if key in snapshot.gauges:
                    gauge.add_metric(_labels(snapshot), snapshot.gauges[key])
            yield gauge
        yield from _tier_families(snapshots)


def _tier_families(snapshots: list[RecorderSnapshot]) -> Iterator[Metric]:
    tiers = [(snapshot, snapshot.totals.service_tiers()) for snapshot in snapshots]
    for key, name, documentation in _TIER_COUNTERS:
        counter = CounterMetricFamily(name, documentation, labels=TIER_LABELS)
        for snapshot, served in tiers:
            for tier in served:
                counter.add_metric(
                    [*_labels(snapshot), tier], snapshot.totals.counters.get(m.tier_metric(tier, key), 0)
                )
        yield counter
    les = [floatToGoString(bound) for bound in SECONDS_BOUNDS]
    for key, name, documentation in _TIER_HISTOGRAMS:
        histograms = HistogramMetricFamily(name, documentation, labels=TIER_LABELS)
        for snapshot, served in tiers:
            for tier in served:
                histogram = snapshot.totals.histograms.get(m.tier_metric(tier, key)) or Histogram()
                counts = histogram.cumulative_counts(SECONDS_BOUNDS, monotonic=True)
                histograms.add_metric(
                    [*_labels(snapshot), tier],
                    [*zip(les, counts, strict=True), ("+Inf", histogram.count)],
                    sum_value=histogram.sum,
                )
        yield histograms


class ShadowCollector:
    """Shadow copies this gateway process started or skipped (serving/telemetry/shadow_copies.py)."""

    def collect(self) -> Iterator[Metric]:
        counter = CounterMetricFamily(
            "switchyard_shadow_copies",
            "Requests copied to a shadow version by this process, or skipped (too many in flight).",
            labels=("model", "version", "outcome"),
        )
        for (model_name, version, outcome), value in sorted(shadow_copy_counts().items()):
            counter.add_metric([model_name, version, outcome], value)
        yield counter


class TtftForecastCollector:
    """This gateway process's TTFT forecasts against the TTFT its requests got, and its refusals of
    requests no replica was forecast to serve within their objective (serving/telemetry/ttft_forecasts.py)."""

    def collect(self) -> Iterator[Metric]:
        histograms = HistogramMetricFamily(
            "switchyard_ttft_forecast_error_seconds",
            "|actual - forecast| TTFT of requests routed by this gateway process, by whether the first "
            "token came after the forecast (late) or not (early).",
            labels=("model", "version", "direction"),
        )
        les = [floatToGoString(bound) for bound in SECONDS_BOUNDS]
        for (model_name, version, direction), histogram in sorted(ttft_forecast_errors().items()):
            counts = histogram.cumulative_counts(SECONDS_BOUNDS, monotonic=True)
            histograms.add_metric(
                [model_name, version, direction],
                [*zip(les, counts, strict=True), ("+Inf", histogram.count)],
                sum_value=histogram.sum,
            )
        yield histograms
        counter = CounterMetricFamily(
            "switchyard_slo_refusals",
            "Requests this gateway process refused (429) because no replica was forecast to meet their "
            "tenant's TTFT objective.",
            labels=("model", "version"),
        )
        for (model_name, version), value in sorted(slo_refusal_counts().items()):
            counter.add_metric([model_name, version], value)
        yield counter


def _labels(snapshot: RecorderSnapshot) -> list[str]:
    return [snapshot.model_name, snapshot.version, snapshot.replica_id]


registry = CollectorRegistry(auto_describe=False)
registry.register(SwitchyardCollector())
registry.register(ShadowCollector())
registry.register(TtftForecastCollector())


_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="metrics"'}
_UNAUTHORIZED = "/metrics needs a staff session or the metrics bearer token (SWITCHYARD_METRICS_TOKEN)"


def has_metrics_token(authorization: str | None) -> bool:
    """Whether an Authorization header carries the configured token; never, when none is configured."""
    token, credentials = settings.METRICS_TOKEN, bearer_token(authorization)
    if not token or credentials is None:
        return False
    # As bytes: compare_digest refuses str with non-ASCII characters, which a client could send.
    return hmac.compare_digest(credentials.encode(), token.encode())


async def metrics_view(request: HttpRequest) -> HttpResponse:
    if request.method not in ("GET", "HEAD"):
        return HttpResponse(status=405, headers={"Allow": "GET, HEAD"})
    if not has_metrics_token(request.headers.get("Authorization")):
        user = await request.auser()
        if not user.is_authenticated:
            return error_response(401, _UNAUTHORIZED, headers=_CHALLENGE)
        if not (user.is_active and user.is_staff):
            return error_response(403, "/metrics is for staff")
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


class _QuietHandler(WSGIRequestHandler):
    timeout = 10  # a connection that sends nothing is dropped, not kept for ever

    def log_message(self, format: str, *args: Any) -> None:  # a scrape every few seconds is not news
        pass


def start_metrics_server(port: int, addr: str) -> WSGIServer:
    """A replica process's /metrics on a port of its own, for the bearer token only (it has no
    sessions). Served from a daemon thread until the process exits."""
    exposition = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if has_metrics_token(environ.get("HTTP_AUTHORIZATION")):
            return exposition(environ, start_response)  # type: ignore[no-any-return]
        body = json.dumps(error_body(401, _UNAUTHORIZED)).encode()
        start_response("401 Unauthorized", [("Content-Type", "application/json"), *_CHALLENGE.items()])
        return [body]

    family, _, _, _, _ = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    # A thread per connection, so that one slow scraper does not hold up the others.
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    server = make_server(addr, port, app, server_class=server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server
