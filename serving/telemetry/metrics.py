"""What a replica records about its model version, and how it reaches the metrics store.

The model thread hands over one StepSample per engine step and a RequestSample per request that ended,
in one `record` call (one lock round per step). Samples land in the 5 s wall-clock window they were
recorded in; `flush()` drains the finished and current windows into the store
(serving.telemetry.metrics_store), where
the rows of all replicas are merged on read. Totals since the replica started stay in memory for
`GET /metrics` (serving.telemetry.prometheus).

Counters (names used by the store and the selectors):
    requests            requests that ended with a finish reason of stop, length or error
    errors, errors.<type>   of those, the ones that ended in an error (injected faults included)
    finish.<reason>     stop / length / error / abort
    empty_outputs       non-error requests with 0 output tokens
    prompt_tokens, output_tokens
    aborted             client went away (not in `requests`)
    rejected, rejected.<type>   refused before any model work: invalid input, replica not ready
    shadow.compared, shadow.matched   shadow copies whose text could be compared with the primary's
                        (serving.gateway.shadow), and of those, the ones that matched
    batches_closed.<reason>   a non-generative model's batches, by why the dynamic batcher closed them
                        (full, timeout); their time to fill is the batch_fill_s histogram
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from serving.telemetry.histogram import Histogram

logger = logging.getLogger(__name__)

WINDOW_S = 5
MAX_PENDING_WINDOWS = 720  # an hour of 5 s windows kept while the store is unreachable

HISTOGRAM_NAMES = (
    "ttft_s",
    "tpot_s",
    "itl_s",
    "queue_wait_s",
    "model_time_s",
    "e2e_s",
    "batch_size",
    "batch_fill_s",
)
GAUGE_NAMES = ("queue_depth", "running", "kv_cache_usage", "batch_size")

REQUESTS = "requests"
ERRORS = "errors"
EMPTY_OUTPUTS = "empty_outputs"
PROMPT_TOKENS = "prompt_tokens"
OUTPUT_TOKENS = "output_tokens"
ABORTED = "aborted"
REJECTED = "rejected"
SHADOW_COMPARED = "shadow.compared"
SHADOW_MATCHED = "shadow.matched"
FINISH_PREFIX = "finish."
ERROR_PREFIX = "errors."
REJECTED_PREFIX = "rejected."
BATCH_CLOSED_PREFIX = "batches_closed."
# Refusals before any model work: they say nothing about the version's health.
REJECTION_TYPES = frozenset({"invalid_request_error", "replica_unavailable"})


@dataclass(slots=True)
class GaugeStat:
    """A gauge over a window: how many times it was sampled, their sum, min, max and the latest value."""

    count: int = 0
    sum: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    last: float = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        self.last = value

    def merge(self, other: GaugeStat) -> GaugeStat:
        """In place; `last` becomes other's, so merge in time order where `last` matters."""
        if other.count:
            self.count += other.count
            self.sum += other.sum
            self.min = min(self.min, other.min)
            self.max = max(self.max, other.max)
            self.last = other.last
        return self

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def to_json(self) -> dict[str, float]:
        return {"n": self.count, "s": self.sum, "lo": self.min, "hi": self.max, "last": self.last}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GaugeStat:
        return cls(
            int(data["n"]), float(data["s"]), float(data["lo"]), float(data["hi"]), float(data["last"])
        )


@dataclass(slots=True)
class MetricsWindow:
    """Histograms, counters and gauges of one window (or of any merge of windows and replicas)."""

    histograms: dict[str, Histogram] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, GaugeStat] = field(default_factory=dict)

    def histogram(self, name: str) -> Histogram:
        histogram = self.histograms.get(name)
        if histogram is None:
            histogram = self.histograms[name] = Histogram()
        return histogram

    def gauge(self, name: str) -> GaugeStat:
        stat = self.gauges.get(name)
        if stat is None:
            stat = self.gauges[name] = GaugeStat()
        return stat

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def merge(self, other: MetricsWindow) -> MetricsWindow:
        for name, histogram in other.histograms.items():
            self.histogram(name).merge(histogram)
        for name, n in other.counters.items():
            self.count(name, n)
        for name, stat in other.gauges.items():
            self.gauge(name).merge(stat)
        return self

    def copy(self) -> MetricsWindow:
        return MetricsWindow().merge(self)

    @property
    def is_empty(self) -> bool:
        return not (self.counters or self.gauges or any(h.count for h in self.histograms.values()))

    def to_json(self) -> tuple[dict[str, Any], dict[str, int], dict[str, Any]]:
        """(histograms, counters, gauges) as stored in a MetricWindow row."""
        return (
            {name: h.to_json() for name, h in sorted(self.histograms.items()) if h.count},
            dict(sorted(self.counters.items())),
            {name: g.to_json() for name, g in sorted(self.gauges.items()) if g.count},
        )

    @classmethod
    def from_json(
        cls, histograms: dict[str, Any], counters: dict[str, int], gauges: dict[str, Any]
    ) -> MetricsWindow:
        return cls(
            {name: Histogram.from_json(data) for name, data in histograms.items()},
            {name: int(n) for name, n in counters.items()},
            {name: GaugeStat.from_json(data) for name, data in gauges.items()},
        )


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


def window_start(timestamp: float, window_s: int = WINDOW_S) -> datetime:
    """The aware UTC start of the window a wall-clock timestamp falls in."""
    return datetime.fromtimestamp(math.floor(timestamp / window_s) * window_s, tz=UTC)


def floor_time(moment: datetime, seconds: int) -> datetime:
    return window_start(moment.timestamp(), seconds)


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
    ):
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

    def record(
        self,
        *,
        step: StepSample | None = None,
        requests: Iterable[RequestSample] = (),
        now: float | None = None,
    ) -> None:
        with self._lock:
            window = self._pending_window(now)
            for sample in requests:
                _add_request(window, sample)
            if step is not None:
                _add_step(window, step)
                self._gauges.update(
                    queue_depth=step.num_waiting,
                    running=step.num_running,
                    kv_cache_usage=step.kv_cache_usage,
                    batch_size=step.batch_size,
                )

    def count(self, counts: dict[str, int], *, now: float | None = None) -> None:
        """Add to counters that are not about one step or request (shadow comparisons)."""
        with self._lock:
            window = self._pending_window(now)
            for name, n in counts.items():
                window.count(name, n)

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
        """Write the pending windows to the store (blocking: call from a worker thread). Returns how
        many windows were written. On failure they go back to pending, for the next flush, and the
        error propagates. While a write is in flight its windows still count in `snapshot()`."""
        from serving.telemetry.metrics_store import metrics_flush

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
    with _live_lock:
        return list(_live.values())
