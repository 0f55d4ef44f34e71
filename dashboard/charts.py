"""Chart shapes: the time ranges the model page offers, and one version's metrics window as a chart point.

Pure functions of serving.selectors.VersionWindow (no database): latency percentiles in ms from merged
histograms, rates per second over the window's own length, batch sizes and queue waits binned. The live feed
and the page's first load share them, so a pushed point replaces a drawn one exactly."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings

from serving.selectors import WINDOW_S, VersionWindow, floor_time


@dataclass(frozen=True, slots=True)
class ChartRange:
    key: str
    label: str
    span_s: int
    step_s: int  # one chart point per step; at least the store's 5 s resolution


RANGES = {
    r.key: r
    for r in (
        ChartRange("5m", "5 min", 300, 5),
        ChartRange("15m", "15 min", 900, 15),
        ChartRange("1h", "1 h", 3600, 60),
        ChartRange("24h", "24 h", 86400, 900),
    )
}
DEFAULT_RANGE = "15m"

# Batch sizes are integers: exact bins for small batches, doubling ranges above. Bounds sit halfway
# between integers so that a bucket's reported value (within 1% of the sample) lands in the right bin.
BATCH_BINS: tuple[tuple[str, float], ...] = (
    ("1", 1.5),
    ("2", 2.5),
    ("3", 3.5),
    ("4", 4.5),
    ("5-8", 8.5),
    ("9-16", 16.5),
    ("17-32", 32.5),
    ("33-64", 64.5),
    ("65-128", 128.5),
    ("129+", math.inf),
)

# Time to fill a batch slot. Generative models are batched continuously: a slot freed in the running batch
# is filled at the next step by a waiting request, so the time to fill it is that request's queue wait
# (arrival -> admitted to the running batch). Upper bounds in seconds; the histogram's buckets put a
# sample within 1% of a bound on either side of it.
QUEUE_WAIT_BINS: tuple[tuple[str, float], ...] = (
    ("≤1 ms", 0.001),
    ("1-5 ms", 0.005),
    ("5-10 ms", 0.010),
    ("10-25 ms", 0.025),
    ("25-50 ms", 0.050),
    ("50-100 ms", 0.100),
    ("0.1-0.25 s", 0.250),
    ("0.25-0.5 s", 0.500),
    ("0.5-1 s", 1.0),
    ("1-2.5 s", 2.5),
    ("2.5-5 s", 5.0),
    (">5 s", math.inf),
)

# What the model page charts; the JavaScript draws one trace per (version, stat).
LATENCY_STATS = ("p50", "p95", "p99")
CHARTS: tuple[dict[str, Any], ...] = (
    {"id": "ttft", "title": "Time to first token", "unit": "ms", "stats": LATENCY_STATS},
    {"id": "tpot", "title": "Time per output token", "unit": "ms", "stats": LATENCY_STATS},
    {
        "id": "queue_wait",
        "title": "Queue wait (arrival to admission into the running batch)",
        "unit": "ms",
        "stats": LATENCY_STATS,
    },
    {"id": "model_time", "title": "Model time per engine step", "unit": "ms", "stats": LATENCY_STATS},
    {"id": "req_s", "title": "Requests per second", "unit": "req/s", "stats": ()},
    {"id": "err_pct", "title": "Error rate", "unit": "%", "stats": ()},
)


# The per-tier p99 charts (docs/architecture.md, "Service tiers"): one line per (version, tier), in the
# version's colour and the tier's dash. Charts of their own, not stats of the latency charts above, whose
# p50 / p95 / p99 dashes these would be mistaken for. Each id is its chart point's field.
TIER_CHARTS = (
    {"id": "tier_ttft", "title": "p99 time to first token by service tier", "unit": "ms"},
    {"id": "tier_tpot", "title": "p99 time per output token by service tier", "unit": "ms"},
    {"id": "tier_queue_wait", "title": "p99 queue wait by service tier", "unit": "ms"},
)
TIER_DASH = {"priority": "solid", "default": "dash", "flex": "dot"}


def chart_range(key: str | None) -> ChartRange:
    return RANGES.get(key or "", RANGES[DEFAULT_RANGE])


# --- small helpers -------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _quantiles_ms(histogram: Any) -> list[float | None]:
    return [_ms(histogram.quantile(q)) for q in (0.50, 0.95, 0.99)]


def chart_time(moment: datetime) -> str:
    """plotly.js ignores time zones in date strings: send naive UTC (the axes say UTC)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _binned(histogram: Any, bins: tuple[tuple[str, float], ...]) -> list[int]:
    cumulative = histogram.cumulative_counts([bound for _, bound in bins])
    return [n - previous for n, previous in zip(cumulative, [0, *cumulative[:-1]], strict=True)]


def batch_bins(histogram: Any) -> list[int]:
    """Engine steps per batch-size bin (BATCH_BINS), from the merged batch-size histogram."""
    return _binned(histogram, BATCH_BINS)


def queue_wait_bins(histogram: Any) -> list[int]:
    """Requests per queue-wait bin (QUEUE_WAIT_BINS), from the merged queue-wait histogram."""
    return _binned(histogram, QUEUE_WAIT_BINS)


def _rate(window: VersionWindow) -> float | None:
    seconds = (window.end - window.start).total_seconds()
    return round(window.num_requests / seconds, 3) if seconds > 0 else None


def _error_pct(window: VersionWindow) -> float | None:
    return round(window.error_rate * 100.0, 3) if window.num_requests else None


def chart_point(window: VersionWindow) -> dict[str, Any]:
    """One version's chart point for one step window."""
    return {
        "t": chart_time(window.start),
        "n": window.num_requests,
        "req_s": _rate(window),
        "err_pct": _error_pct(window),
        "ttft": _quantiles_ms(window.ttft),
        "tpot": _quantiles_ms(window.tpot),
        "queue_wait": _quantiles_ms(window.queue_wait),
        "model_time": _quantiles_ms(window.model_time),
        "batch": batch_bins(window.batch_size),
        "fill": queue_wait_bins(window.queue_wait),
        # Only the tiers with requests in this step: a tier's line has points where it had traffic.
        "tier_ttft": {tier: _ms(figures.p99_ttft_s) for tier, figures in window.tiers.items()},
        "tier_tpot": {tier: _ms(figures.p99_tpot_s) for tier, figures in window.tiers.items()},
        "tier_queue_wait": {
            tier: _ms(figures.queue_wait.quantile(0.99)) for tier, figures in window.tiers.items()
        },
    }


def window_summary(window: VersionWindow) -> dict[str, Any]:
    """A version's figures over one window (the last minute, on the overview and the model page)."""
    return {
        "num_requests": window.num_requests,
        "req_s": _rate(window),
        "err_pct": _error_pct(window),
        "ttft_p99_ms": _ms(window.p99_ttft_s),
        "tpot_p99_ms": _ms(window.p99_tpot_s),
        "queue_wait_p99_ms": _ms(window.queue_wait.quantile(0.99)),
    }


def data_end(now: datetime) -> datetime:
    """The newest instant the store has (nearly) all rows for: replicas flush every few seconds, so
    the last flush interval is left out rather than drawn as a dip."""
    return floor_time(now - timedelta(seconds=settings.METRICS_FLUSH_INTERVAL_S), WINDOW_S)


def series_start(chart: ChartRange, now: datetime) -> datetime:
    return floor_time(now - timedelta(seconds=chart.span_s), chart.step_s)


def live_start(chart: ChartRange, now: datetime) -> datetime:
    """The live feed re-sends the last few steps: rows of a window keep arriving for a flush interval
    after it ends, and the client replaces the points it already has."""
    lookback_s = settings.METRICS_FLUSH_INTERVAL_S + 2 * WINDOW_S + chart.step_s
    return floor_time(now - timedelta(seconds=lookback_s), chart.step_s)
