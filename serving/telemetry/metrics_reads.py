"""Reads from the metrics store: a model version's window, merged over its replicas and rows.

Times are wall-clock UTC (aware datetimes). A window holds the rows whose start is in [start, end);
rows are 5 s aligned for the last MetricWindow.FINE_RETENTION and 60 s aligned before that. Every
percentile comes from merged histogram buckets, never from averaging percentiles."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q, QuerySet
from django.utils import timezone

from serving.models import MetricWindow
from serving.telemetry import metric_window as m
from serving.telemetry.histogram import Histogram
from serving.telemetry.metric_window import GaugeStat, MetricsWindow, floor_time

MAX_SERIES_POINTS = 10_000


@dataclass(frozen=True, slots=True)
class TierWindow:
    """One service tier's share of a VersionWindow (docs/architecture.md, "Service tiers"): its
    requests, as `num_requests` counts them, their errors and latencies."""

    tier: str
    num_requests: int
    num_errors: int
    ttft: Histogram
    tpot: Histogram
    queue_wait: Histogram

    @property
    def error_rate(self) -> float:
        return self.num_errors / self.num_requests if self.num_requests else 0.0

    @property
    def p99_ttft_s(self) -> float | None:
        return self.ttft.quantile(0.99)

    @property
    def p99_tpot_s(self) -> float | None:
        return self.tpot.quantile(0.99)


@dataclass(frozen=True, slots=True)
class VersionWindow:
    """A version's traffic over [start, end). Rates are over requests that ended with stop, length or
    error (client aborts and refusals before any model work are not requests here)."""

    model_name: str
    version: str
    start: datetime
    end: datetime
    num_requests: int
    num_errors: int  # finish_reason "error", injected faults included
    num_empty_outputs: int  # non-error requests with 0 output tokens
    num_truncated: int  # finish_reason "length"
    output_tokens: int
    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    queue_wait: Histogram
    model_time: Histogram  # one sample per engine step
    # Beyond the judge's needs, for the dashboard and the autoscaler:
    itl: Histogram = field(default_factory=Histogram)
    batch_size: Histogram = field(default_factory=Histogram)  # one sample per engine step
    prompt_tokens: int = 0
    num_aborted: int = 0
    num_rejected: int = 0
    errors_by_type: dict[str, int] = field(default_factory=dict)
    num_shadow_compared: int = 0  # shadow copies whose text was compared with the primary's
    num_shadow_matched: int = 0
    # Of the compared copies: each one's share of agreeing token events, and where those that differ first
    # differ (serving/gateway/shadow_diff.py).
    shadow_agreement: Histogram = field(default_factory=Histogram)
    shadow_first_divergence: Histogram = field(default_factory=Histogram)
    gauges: dict[str, GaugeStat] = field(default_factory=dict)  # queue_depth, running, kv_cache_usage, …
    # By service tier, best first, only the tiers that had requests in the window (none in rows written
    # before tiers were counted): the same requests as above, of replicas that knew their tier.
    tiers: dict[str, TierWindow] = field(default_factory=dict)

    @property
    def num_completed(self) -> int:
        """Requests that did not error."""
        return self.num_requests - self.num_errors

    @property
    def error_rate(self) -> float:
        """num_errors / num_requests; 0.0 with no requests."""
        return self.num_errors / self.num_requests if self.num_requests else 0.0

    @property
    def empty_output_rate(self) -> float:
        """Empty outputs among requests that did not error; 0.0 with none."""
        return self.num_empty_outputs / self.num_completed if self.num_completed else 0.0

    @property
    def truncated_rate(self) -> float:
        return self.num_truncated / self.num_completed if self.num_completed else 0.0

    @property
    def mean_output_tokens(self) -> float:
        """Mean output length of requests that did not error (errors have their own rate); 0.0 with none."""
        return self.output_tokens / self.num_completed if self.num_completed else 0.0

    @property
    def p50_ttft_s(self) -> float | None:
        return self.ttft.quantile(0.50)

    @property
    def p95_ttft_s(self) -> float | None:
        return self.ttft.quantile(0.95)

    @property
    def p99_ttft_s(self) -> float | None:
        return self.ttft.quantile(0.99)

    @property
    def p50_tpot_s(self) -> float | None:
        return self.tpot.quantile(0.50)

    @property
    def p95_tpot_s(self) -> float | None:
        return self.tpot.quantile(0.95)

    @property
    def p99_tpot_s(self) -> float | None:
        return self.tpot.quantile(0.99)

    @property
    def p99_e2e_s(self) -> float | None:
        return self.e2e.quantile(0.99)


def _version_window(
    model_name: str, version: str, start: datetime, end: datetime, window: MetricsWindow
) -> VersionWindow:
    counters = window.counters
    histograms = window.histograms

    def histogram(name: str) -> Histogram:
        return histograms.get(name) or Histogram()

    return VersionWindow(
        model_name=model_name,
        version=version,
        start=start,
        end=end,
        num_requests=counters.get(m.REQUESTS, 0),
        num_errors=counters.get(m.ERRORS, 0),
        num_empty_outputs=counters.get(m.EMPTY_OUTPUTS, 0),
        num_truncated=counters.get(m.FINISH_PREFIX + "length", 0),
        output_tokens=counters.get(m.OUTPUT_TOKENS, 0),
        ttft=histogram("ttft_s"),
        tpot=histogram("tpot_s"),
        e2e=histogram("e2e_s"),
        queue_wait=histogram("queue_wait_s"),
        model_time=histogram("model_time_s"),
        itl=histogram("itl_s"),
        batch_size=histogram("batch_size"),
        prompt_tokens=counters.get(m.PROMPT_TOKENS, 0),
        num_aborted=counters.get(m.ABORTED, 0),
        num_rejected=counters.get(m.REJECTED, 0),
        num_shadow_compared=counters.get(m.SHADOW_COMPARED, 0),
        num_shadow_matched=counters.get(m.SHADOW_MATCHED, 0),
        shadow_agreement=histogram(m.SHADOW_AGREEMENT),
        shadow_first_divergence=histogram(m.SHADOW_FIRST_DIVERGENCE),
        errors_by_type={
            name.removeprefix(m.ERROR_PREFIX): n
            for name, n in counters.items()
            if name.startswith(m.ERROR_PREFIX)
        },
        gauges=window.gauges,
        tiers={tier: _tier_window(tier, window) for tier in window.service_tiers()},
    )


def _tier_window(tier: str, window: MetricsWindow) -> TierWindow:
    def histogram(name: str) -> Histogram:
        return window.histograms.get(m.tier_metric(tier, name)) or Histogram()

    return TierWindow(
        tier=tier,
        num_requests=window.counters.get(m.tier_metric(tier, m.REQUESTS), 0),
        num_errors=window.counters.get(m.tier_metric(tier, m.ERRORS), 0),
        ttft=histogram("ttft_s"),
        tpot=histogram("tpot_s"),
        queue_wait=histogram("queue_wait_s"),
    )


def _check_range(start: datetime, end: datetime) -> None:
    if timezone.is_naive(start) or timezone.is_naive(end):
        raise ValueError("metrics windows take timezone-aware datetimes (UTC)")
    if end < start:
        raise ValueError(f"the window ends ({end}) before it starts ({start})")


def _rows(
    model_name: str, version: str, start: datetime, end: datetime, now: datetime
) -> Iterable[tuple[datetime, dict[str, Any], dict[str, int], dict[str, Any]]]:
    """(start, histograms, counters, gauges) of the rows in [start, end), oldest first: 60 s rows
    before the fine-retention cutoff, 5 s rows after it, so nothing is counted twice."""
    base = MetricWindow.objects.filter(version__model__name=model_name, version__version=version)
    for query in _by_resolution(base, start, end, now):
        yield from query.order_by("start", "replica_id").values_list(
            "start", "histograms", "counters", "gauges"
        )


def _by_resolution(
    base: QuerySet[MetricWindow], start: datetime, end: datetime, now: datetime
) -> list[QuerySet[MetricWindow]]:
    """`base`'s rows in [start, end) as _rows reads them: one query per resolution the range needs."""
    cutoff = floor_time(now - MetricWindow.FINE_RETENTION, MetricWindow.COARSE_RESOLUTION_S) + timedelta(
        seconds=MetricWindow.COARSE_RESOLUTION_S
    )
    parts = []
    if start < cutoff:
        parts.append(
            base.filter(
                resolution_s=MetricWindow.COARSE_RESOLUTION_S, start__gte=start, start__lt=min(end, cutoff)
            )
        )
    if end > cutoff:
        parts.append(
            base.filter(
                resolution_s=MetricWindow.FINE_RESOLUTION_S, start__gte=max(start, cutoff), start__lt=end
            )
        )
    return parts


def _minute_rows(
    model_name: str, version: str, start: datetime, end: datetime
) -> Iterable[tuple[datetime, dict[str, Any], dict[str, int], dict[str, Any]]]:
    """As _rows, for a minute-aligned [start, end), reading each rolled-up minute's one 60 s row rather
    than its 5 s rows (one per replica every 5 s: a day of them is 17,280 a replica). A minute whose 5 s
    rows are not all rolled up yet (the last one or two, or one a late flush changed) is read from them;
    only those 5 s rows are read. (A minute whose 5 s rows are all rolled up has its 60 s row: the roll-up
    writes it in the transaction that marks them, and keeps it longer than they are kept.)"""
    if start >= end:
        return
    base = MetricWindow.objects.filter(version__model__name=model_name, version__version=version)
    fine = base.filter(resolution_s=MetricWindow.FINE_RESOLUTION_S, start__gte=start, start__lt=end)
    coarse_s = MetricWindow.COARSE_RESOLUTION_S
    dirty = {floor_time(t, coarse_s) for t in fine.filter(is_rolled_up=False).values_list("start", flat=True)}
    rolled = {
        row[0]: row
        for row in base.filter(resolution_s=coarse_s, start__gte=start, start__lt=end)
        .exclude(start__in=dirty)
        .values_list("start", "histograms", "counters", "gauges")
    }
    minute = timedelta(seconds=coarse_s)
    rows: list[tuple[datetime, dict[str, Any], dict[str, int], dict[str, Any]]] = []
    # A query per so many minutes: SQLite refuses an expression over 1,000 deep, which a roll-up stalled
    # for 17 hours reached, and the 24 h chart was a 500.
    ordered = sorted(dirty)
    for first in range(0, len(ordered), _DIRTY_MINUTES_PER_QUERY):
        in_dirty = Q()
        for dirty_start in ordered[first : first + _DIRTY_MINUTES_PER_QUERY]:
            in_dirty |= Q(start__gte=dirty_start, start__lt=dirty_start + minute)
        rows.extend(
            fine.filter(in_dirty)
            .order_by("start", "replica_id")
            .values_list("start", "histograms", "counters", "gauges")
        )
    yield from sorted([*rolled.values(), *rows], key=lambda row: row[0])


_DIRTY_MINUTES_PER_QUERY = 200


def version_window(*, model_name: str, version: str, start: datetime, end: datetime) -> VersionWindow:
    """A version's metrics over [start, end), merged over replicas. Unknown versions read as empty."""
    return version_windows(versions=[(model_name, version)], start=start, end=end)[(model_name, version)]


def version_windows(
    *, versions: Iterable[tuple[str, str]], start: datetime, end: datetime
) -> dict[tuple[str, str], VersionWindow]:
    """Each (model name, version) pair's metrics over [start, end), merged over replicas, keyed by the
    pair, in one query per resolution however many pairs: the dashboard's overview asks for every
    model's versions each push. Unknown versions read as empty."""
    _check_range(start, end)
    pairs = list(dict.fromkeys(versions))
    merged = {pair: MetricsWindow() for pair in pairs}
    if pairs:
        matches = Q()
        for model_name, version in pairs:
            matches |= Q(version__model__name=model_name, version__version=version)
        for query in _by_resolution(MetricWindow.objects.filter(matches), start, end, timezone.now()):
            # In time order, as a gauge's `last` needs.
            rows = query.order_by("start", "replica_id").values_list(
                "version__model__name", "version__version", "histograms", "counters", "gauges"
            )
            for model_name, version, histograms, counters, gauges in rows:
                merged[(model_name, version)].merge(MetricsWindow.from_json(histograms, counters, gauges))
    return {pair: _version_window(*pair, start, end, window) for pair, window in merged.items()}


def version_series(
    *, model_name: str, version: str, start: datetime, end: datetime, step_s: int
) -> list[VersionWindow]:
    """Consecutive windows of step_s seconds from start (the last one cut at end), for charts. A step
    shorter than the rows' resolution leaves some windows empty."""
    _check_range(start, end)
    if step_s <= 0:
        raise ValueError(f"step_s must be positive, got {step_s}")
    num_points = math.ceil((end - start).total_seconds() / step_s)
    if num_points > MAX_SERIES_POINTS:
        raise ValueError(f"{num_points} points is over the limit of {MAX_SERIES_POINTS}; use a longer step")
    step = timedelta(seconds=step_s)
    windows = [MetricsWindow() for _ in range(num_points)]
    coarse_s = MetricWindow.COARSE_RESOLUTION_S
    now = timezone.now()
    # Steps of whole minutes from a whole minute: the minutes up to the last whole one from their 60 s
    # rows where rolled up, the rest as they are.
    split = start
    if step_s % coarse_s == 0 and start.timestamp() % coarse_s == 0:
        split = max(start, floor_time(end, coarse_s))
    rows = itertools.chain(
        _minute_rows(model_name, version, start, split), _rows(model_name, version, split, end, now)
    )
    for row_start, histograms, counters, gauges in rows:
        index = int((row_start - start).total_seconds() // step_s)
        windows[index].merge(MetricsWindow.from_json(histograms, counters, gauges))
    return [
        _version_window(model_name, version, start + i * step, min(end, start + (i + 1) * step), window)
        for i, window in enumerate(windows)
    ]
