"""A model version's metrics over one time window: counters, gauges and mergeable histograms.

Counters (names used by the store and the selectors):
    requests            requests that ended with a finish reason of stop, length or error
    errors, errors.<type>   of those, the ones that ended in an error (injected faults included)
    finish.<reason>     stop / length / error / abort
    empty_outputs       non-error requests with 0 output tokens
    prompt_tokens, output_tokens
    aborted             client went away (not in `requests`)
    rejected, rejected.<type>   refused before any model work: invalid input, replica not ready
    shadow.compared, shadow.matched   shadow copies whose text could be compared with the primary's
                        (serving/gateway/shadow.py), and of those, the ones that matched; with the
                        histograms shadow_agreement (each compared copy's share of agreeing positions)
                        and shadow_first_divergence (the first differing token's index, of those that
                        differ)
    batches_closed.<reason>   a non-generative model's batches, by why the dynamic batcher closed them
                        (full, timeout); their time to fill is the batch_fill_s histogram
    tier.<tier>.requests, tier.<tier>.errors   `requests` and `errors` of one service tier (priority,
                        default, flex); with histograms tier.<tier>.ttft_s, .tpot_s, .queue_wait_s

Per-tier names exist only for the tiers a window had requests of, so a window of one tier stores one
tier's few entries, and windows written before tiers were counted read as having none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from serving.telemetry.histogram import Histogram

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
    "shadow_agreement",
    "shadow_first_divergence",
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
SHADOW_AGREEMENT = "shadow_agreement"
SHADOW_FIRST_DIVERGENCE = "shadow_first_divergence"
FORGED = "forged"  # submission-layer messages dropped for an HMAC that did not match
FINISH_PREFIX = "finish."
ERROR_PREFIX = "errors."
REJECTED_PREFIX = "rejected."
BATCH_CLOSED_PREFIX = "batches_closed."
# Refusals before any model work: they say nothing about the version's health.
REJECTION_TYPES = frozenset({"invalid_request_error", "replica_unavailable"})

# A request's service tier (docs/architecture.md, "Service tiers"), best first: the order reads list
# them in. The engine's TIER_NAMES, whose indexes a replica's routes hold; telemetry imports no side, so
# a test holds the two equal. Only these are counted: each is a label value and a set of stored names.
SERVICE_TIERS = ("priority", "default", "flex")
TIER_PREFIX = "tier."
TIER_HISTOGRAM_NAMES = ("ttft_s", "tpot_s", "queue_wait_s")


def tier_metric(tier: str, name: str) -> str:
    """The counter or histogram `name` (REQUESTS, ERRORS, one of TIER_HISTOGRAM_NAMES) of one tier."""
    return f"{TIER_PREFIX}{tier}.{name}"


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

    def service_tiers(self) -> list[str]:
        """The tiers this window counted requests of, best first (SERVICE_TIERS' order)."""
        return [t for t in SERVICE_TIERS if self.counters.get(tier_metric(t, REQUESTS), 0)]

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


def window_start(timestamp: float, window_s: int = WINDOW_S) -> datetime:
    """The aware UTC start of the window a wall-clock timestamp falls in."""
    return datetime.fromtimestamp(math.floor(timestamp / window_s) * window_s, tz=UTC)


def floor_time(moment: datetime, seconds: int) -> datetime:
    return window_start(moment.timestamp(), seconds)
