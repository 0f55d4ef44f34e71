"""Writes to the metrics store: replicas' flushes, the 1-minute roll-up and retention.

Schedule `metrics_maintain` every minute or so (Celery beat, or the embedded scheduler); flushes come
from the replicas themselves (serving.telemetry.recorder.MetricsRecorder.flush)."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from serving.models import MetricWindow
from serving.telemetry.metric_window import MetricsWindow, floor_time

logger = logging.getLogger(__name__)

FINE = MetricWindow.FINE_RESOLUTION_S
COARSE = MetricWindow.COARSE_RESOLUTION_S
# A minute is rolled up once it ended this long ago, so the last flushes of its replicas are in (a
# flush that comes later marks its row changed, and the minute is rolled up again).
ROLLUP_LAG = timedelta(seconds=15)


def row_window(row: MetricWindow) -> MetricsWindow:
    return MetricsWindow.from_json(row.histograms, row.counters, row.gauges)


def _set_window(row: MetricWindow, window: MetricsWindow) -> None:
    row.histograms, row.counters, row.gauges = window.to_json()


@transaction.atomic
def metrics_flush(
    *, version_id: int, replica_id: str, windows: Sequence[tuple[datetime, MetricsWindow]]
) -> int:
    """Add a replica's 5 s windows to the store, merging into rows it wrote earlier for the same
    window (a window is usually flushed in two parts). Returns the number of rows written."""
    windows = [(start, window) for start, window in windows if not window.is_empty]
    if not windows:
        return 0
    for start, _ in windows:
        if start.tzinfo is None or start.timestamp() % FINE:
            raise ValueError(f"window starts must be aware and {FINE} s aligned, got {start!r}")
    existing = {
        row.start: row
        for row in MetricWindow.objects.select_for_update().filter(
            version_id=version_id,
            replica_id=replica_id,
            resolution_s=FINE,
            start__in=[start for start, _ in windows],
        )
    }
    to_create: list[MetricWindow] = []
    to_update: list[MetricWindow] = []
    for start, window in windows:
        row = existing.get(start)
        if row is None:
            row = MetricWindow(version_id=version_id, replica_id=replica_id, start=start, resolution_s=FINE)
            _set_window(row, window)
            to_create.append(row)
        else:
            _set_window(row, row_window(row).merge(window))
            row.is_rolled_up = False
            to_update.append(row)
    MetricWindow.objects.bulk_create(to_create)
    MetricWindow.objects.bulk_update(to_update, ["histograms", "counters", "gauges", "is_rolled_up"])
    return len(to_create) + len(to_update)


@transaction.atomic
def metrics_rollup(*, now: datetime | None = None) -> int:
    """(Re)compute the 60 s row of every minute that has 5 s rows written since its last roll-up,
    merged over replicas. Idempotent. Returns the number of 60 s rows written."""
    now = now or timezone.now()
    horizon = floor_time(now - ROLLUP_LAG, COARSE)  # minutes before this one have ended, with margin
    dirty = (
        MetricWindow.objects.filter(resolution_s=FINE, is_rolled_up=False, start__lt=horizon)
        .values_list("version_id", "start")
        .distinct()
    )
    minutes: set[tuple[int, datetime]] = {
        (version_id, floor_time(start, COARSE)) for version_id, start in dirty
    }
    if not minutes:
        return 0
    merged: dict[tuple[int, datetime], MetricsWindow] = defaultdict(MetricsWindow)
    rolled_ids: list[int] = []
    for version_id, minute in sorted(minutes):  # normally one minute per version: the one just ended
        rows = (
            MetricWindow.objects.select_for_update()
            .filter(
                resolution_s=FINE,
                version_id=version_id,
                start__gte=minute,
                start__lt=minute + timedelta(seconds=COARSE),
            )
            .order_by("start", "replica_id")
        )
        for row in rows:
            merged[(version_id, minute)].merge(row_window(row))  # in time order: gauges' `last` is latest
            rolled_ids.append(row.pk)
    existing = {
        (row.version_id, row.start): row
        for row in MetricWindow.objects.select_for_update().filter(
            resolution_s=COARSE,
            replica_id="",
            version_id__in={version_id for version_id, _ in minutes},
            start__in={minute for _, minute in minutes},
        )
    }
    to_create: list[MetricWindow] = []
    to_update: list[MetricWindow] = []
    for (version_id, minute), window in merged.items():
        row = existing.get((version_id, minute))
        if row is None:
            row = MetricWindow(version_id=version_id, replica_id="", start=minute, resolution_s=COARSE)
            to_create.append(row)
        else:
            to_update.append(row)
        _set_window(row, window)
    MetricWindow.objects.bulk_create(to_create)
    MetricWindow.objects.bulk_update(to_update, ["histograms", "counters", "gauges"])
    MetricWindow.objects.filter(pk__in=rolled_ids).update(is_rolled_up=True)
    return len(merged)


@dataclass(frozen=True, slots=True)
class PruneResult:
    num_fine_deleted: int
    num_coarse_deleted: int


def metrics_prune(*, now: datetime | None = None) -> PruneResult:
    """Retention: 5 s rows older than FINE_RETENTION (once rolled up), 60 s rows older than
    COARSE_RETENTION."""
    now = now or timezone.now()
    num_fine, _ = MetricWindow.objects.filter(
        resolution_s=FINE, is_rolled_up=True, start__lt=now - MetricWindow.FINE_RETENTION
    ).delete()
    num_coarse, _ = MetricWindow.objects.filter(
        resolution_s=COARSE, start__lt=now - MetricWindow.COARSE_RETENTION
    ).delete()
    return PruneResult(num_fine, num_coarse)


def metrics_maintain(*, now: datetime | None = None) -> PruneResult:
    """Roll up, then apply retention: the one function to schedule (every minute is plenty)."""
    now = now or timezone.now()
    num_rolled = metrics_rollup(now=now)
    result = metrics_prune(now=now)
    logger.debug("metrics: %d minutes rolled up, pruned %s", num_rolled, result)
    return result
