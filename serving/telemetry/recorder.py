"""What a replica records about its model version, and how it reaches the metrics store.

The model thread hands over one StepSample per engine step and a RequestSample per request that ended,
in one `record` call (one lock round per step). Samples land in the 5 s wall-clock window they were
recorded in (metric_window.py); `flush()` drains the finished and current windows into the store
(metrics_store.py), where the rows of all replicas are merged on read. Totals since the replica started
stay in memory for `GET /metrics` (prometheus.py)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from serving.telemetry.metric_window import (
    ABORTED,
    BATCH_CLOSED_PREFIX,
    EMPTY_OUTPUTS,
    ERROR_PREFIX,
    ERRORS,
    FINISH_PREFIX,
    MAX_PENDING_WINDOWS,
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    REJECTED,
    REJECTED_PREFIX,
    REJECTION_TYPES,
    REQUESTS,
    SERVICE_TIERS,
    WINDOW_S,
    MetricsWindow,
    tier_metric,
    window_start,
)
from serving.telemetry.metrics_store import metrics_flush

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """A version served by another's replica: a LoRA adapter on its base (docs/architecture.md, "Adapters
    on a shared base"). Its requests are recorded under it, in windows of its own (its latency, errors
    and the rollout judge's figures), by the base replica's recorder (MetricsRecorder.record)."""

    model_name: str
    version: str
    version_id: int


@dataclass(slots=True)
class RequestSample:
    """A request that ended on the replica. Times in seconds; None where they do not apply."""

    finish_reason: str  # stop, length, error, abort
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    queue_wait_s: float | None = None
    error_type: str | None = None
    is_generative: bool = True  # a non-generative request's result has no output tokens, and is not empty
    # The tier it was served at (SERVICE_TIERS): its requests, errors and latencies are counted per tier
    # as well (docs/architecture.md, "Service tiers"). None: not known (refused before it was read).
    service_tier: str | None = None
    adapter: AdapterVersion | None = None  # the adapter version it was served as; None: the replica's own


@dataclass(slots=True)
class StepSample:
    """One engine step: its forward-pass time, batch and the engine's state after it."""

    model_time_s: float
    batch_size: int
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    itl_s: list[float] = field(default_factory=list)  # one per sequence that got a later token
    # A dynamic batcher's batch (embedding models, classifiers): why it closed, and how long its oldest
    # item waited for it.
    close_reason: str | None = None
    fill_time_s: float | None = None
    num_adapters: int | None = None  # LoRA adapters resident in a generative engine after the step


def _add_request(window: MetricsWindow, sample: RequestSample) -> None:
    reason = sample.finish_reason
    if reason == "error" and sample.error_type in REJECTION_TYPES:
        window.count(REJECTED)
        window.count(REJECTED_PREFIX + str(sample.error_type))
        return
    window.count(FINISH_PREFIX + reason)
    if reason == "abort":
        window.count(ABORTED)
        return
    window.count(REQUESTS)
    window.count(PROMPT_TOKENS, sample.num_prompt_tokens)
    window.count(OUTPUT_TOKENS, sample.num_output_tokens)
    if reason == "error":
        window.count(ERRORS)
        window.count(ERROR_PREFIX + (sample.error_type or "unknown"))
    elif sample.num_output_tokens == 0 and sample.is_generative:
        window.count(EMPTY_OUTPUTS)
    for name, value in (
        ("ttft_s", sample.ttft_s),
        ("tpot_s", sample.tpot_s),
        ("e2e_s", sample.e2e_s),
        ("queue_wait_s", sample.queue_wait_s),
    ):
        if value is not None:
            window.histogram(name).observe(max(0.0, value))
    if sample.service_tier in SERVICE_TIERS:
        _add_tier(window, sample, str(sample.service_tier))


def _add_tier(window: MetricsWindow, sample: RequestSample, tier: str) -> None:
    """A request's own tier's share of `_add_request`: the same requests and errors, the latencies a
    tier's traffic is judged by (TIER_HISTOGRAM_NAMES)."""
    window.count(tier_metric(tier, REQUESTS))
    if sample.finish_reason == "error":
        window.count(tier_metric(tier, ERRORS))
    for name, value in (
        ("ttft_s", sample.ttft_s),
        ("tpot_s", sample.tpot_s),
        ("queue_wait_s", sample.queue_wait_s),
    ):
        if value is not None:
            window.histogram(tier_metric(tier, name)).observe(max(0.0, value))


def _add_step(window: MetricsWindow, step: StepSample) -> None:
    window.histogram("model_time_s").observe(max(0.0, step.model_time_s))
    window.histogram("batch_size").observe(step.batch_size)
    itl = window.histogram("itl_s")
    for value in step.itl_s:
        itl.observe(max(0.0, value))
    if step.close_reason is not None:
        window.count(BATCH_CLOSED_PREFIX + step.close_reason)
    if step.fill_time_s is not None:
        window.histogram("batch_fill_s").observe(max(0.0, step.fill_time_s))
    for name, value in (
        ("queue_depth", step.num_waiting),
        ("running", step.num_running),
        ("kv_cache_usage", step.kv_cache_usage),
        ("batch_size", step.batch_size),
        ("adapters", step.num_adapters),
    ):
        if value is not None:
            window.gauge(name).observe(float(value))


@dataclass(frozen=True, slots=True)
class RecorderSnapshot:
    """What /metrics shows of one recorder: totals since it started and the latest gauge values."""

    model_name: str
    version: str
    replica_id: str
    totals: MetricsWindow
    gauges: dict[str, float]


class MetricsRecorder:
    """One per replica (so per model version). Thread-safe: the model thread records, a worker thread
    flushes, /metrics reads snapshots."""

    def __init__(
        self,
        *,
        model_name: str,
        version: str,
        version_id: int,
        replica_id: str,
        window_s: int = WINDOW_S,
        clock: Any = time.time,
    ) -> None:
        self.model_name = model_name
        self.version = version
        self.version_id = version_id
        self.replica_id = replica_id
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[datetime, MetricsWindow] = {}
        self._in_flight: dict[datetime, MetricsWindow] = {}  # being written by flush()
        self._totals = MetricsWindow()  # everything written so far
        self._flush_lock = threading.Lock()
        self._gauges: dict[str, float] = {}
        self.num_dropped_windows = 0
        self._adapters: dict[AdapterVersion, MetricsRecorder] = {}  # the adapter versions it served

    def record(
        self,
        *,
        step: StepSample | None = None,
        requests: Iterable[RequestSample] = (),
        now: float | None = None,
    ) -> None:
        requests = list(requests)
        for sample in requests:
            if sample.adapter is not None:
                own = dataclasses.replace(sample, adapter=None)  # its recorder's own request
                self.adapter_recorder(sample.adapter).record(requests=[own], now=now)
        with self._lock:
            window = self._pending_window(now)
            for sample in requests:
                if sample.adapter is None:
                    _add_request(window, sample)
            if step is not None:
                _add_step(window, step)
                self._gauges.update(
                    queue_depth=step.num_waiting,
                    running=step.num_running,
                    kv_cache_usage=step.kv_cache_usage,
                    batch_size=step.batch_size,
                )
                if step.num_adapters is not None:
                    self._gauges["adapters"] = step.num_adapters

    def adapter_recorder(self, adapter: AdapterVersion) -> MetricsRecorder:
        """The recorder of an adapter version this replica serves: its own windows, under its version's
        id and this replica's, flushed with this recorder's and shown on /metrics while it is live."""
        with self._lock:
            recorder = self._adapters.get(adapter)
            if recorder is None:
                recorder = self._adapters[adapter] = MetricsRecorder(
                    model_name=adapter.model_name,
                    version=adapter.version,
                    version_id=adapter.version_id,
                    replica_id=self.replica_id,
                    window_s=self.window_s,
                    clock=self._clock,
                )
            return recorder

    def adapter_recorders(self) -> list[MetricsRecorder]:
        with self._lock:
            return list(self._adapters.values())

    def count(self, counts: dict[str, int], *, now: float | None = None) -> None:
        """Add to counters that are not about one step or request (shadow comparisons)."""
        with self._lock:
            window = self._pending_window(now)
            for name, n in counts.items():
                window.count(name, n)

    def observe(self, values: dict[str, float], *, now: float | None = None) -> None:
        """Add a sample to histograms that are not about one step or request (shadow comparisons)."""
        with self._lock:
            window = self._pending_window(now)
            for name, value in values.items():
                window.histogram(name).observe(value)

    def _pending_window(self, now: float | None) -> MetricsWindow:
        """The unflushed window `now` (default: the clock) falls in, opened if new. Under self._lock."""
        start = window_start(self._clock() if now is None else now, self.window_s)
        window = self._pending.get(start)
        if window is None:
            window = self._pending[start] = MetricsWindow()
            self._trim()
        return window

    def _trim(self) -> None:
        while len(self._pending) > MAX_PENDING_WINDOWS:
            # Lost to the store, but /metrics keeps counting it: its counters must never go down.
            self._totals.merge(self._pending.pop(min(self._pending)))
            self.num_dropped_windows += 1

    def flush(self) -> int:
        """Write the pending windows to the store (blocking: call from a worker thread), then its adapter
        versions' (adapter_recorder). Returns how many windows were written. On failure they go back to
        pending, for the next flush, and the error propagates. While a write is in flight its windows
        still count in `snapshot()`."""
        written = self._flush_own()
        for recorder in self.adapter_recorders():
            written += recorder.flush()
        return written

    def _flush_own(self) -> int:
        with self._flush_lock:
            with self._lock:
                self._in_flight, self._pending = self._pending, {}
                windows = sorted(self._in_flight.items(), key=lambda item: item[0])
            if not windows:
                return 0
            try:
                metrics_flush(version_id=self.version_id, replica_id=self.replica_id, windows=windows)
            except BaseException:
                with self._lock:
                    for start, window in windows:
                        self._pending.setdefault(start, MetricsWindow()).merge(window)
                    self._in_flight = {}
                    self._trim()
                raise
            with self._lock:
                for _, window in windows:
                    self._totals.merge(window)
                self._in_flight = {}
            return len(windows)

    def snapshot(self) -> RecorderSnapshot:
        with self._lock:
            totals = self._totals.copy()
            for window in (*self._in_flight.values(), *self._pending.values()):
                totals.merge(window)
            gauges = dict(self._gauges)
        return RecorderSnapshot(self.model_name, self.version, self.replica_id, totals, gauges)


# --- the recorders of this process, for /metrics ---------------------------------------------------

_live_lock = threading.Lock()
_live: dict[int, MetricsRecorder] = {}


def register_recorder(recorder: MetricsRecorder) -> None:
    with _live_lock:
        _live[id(recorder)] = recorder


def unregister_recorder(recorder: MetricsRecorder) -> None:
    with _live_lock:
        _live.pop(id(recorder), None)


def live_recorders() -> list[MetricsRecorder]:
    """Those registered, each followed by its adapter versions' (MetricsRecorder.adapter_recorder)."""
    with _live_lock:
        registered = list(_live.values())
    return [r for recorder in registered for r in (recorder, *recorder.adapter_recorders())]
