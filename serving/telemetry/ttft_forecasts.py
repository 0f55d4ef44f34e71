"""How far this gateway process's TTFT forecasts (serving/gateway/ttft_forecast.py) were from the TTFT its
requests got, and how many requests it refused because no replica was forecast to meet their tenant's
TTFT objective. Per model and version, since the process started; /metrics exposes them
(prometheus.py). Kept here, not in the gateway, so that telemetry imports no gateway module
(docs/architecture.md, "Import rules")."""

from __future__ import annotations

import threading
from collections import Counter

from serving.telemetry.histogram import Histogram

LATE = "late"  # the first token came after the forecast: it was optimistic
EARLY = "early"  # it came before, or at, the forecast

_errors: dict[tuple[str, str, str], Histogram] = {}  # (model, version, LATE | EARLY) -> |actual - forecast|
_refusals: Counter[tuple[str, str]] = Counter()
_lock = threading.Lock()


def record_ttft_forecast(model_name: str, version: str, *, forecast_s: float, actual_s: float) -> None:
    """A request's first token arrived `actual_s` after it was routed on a forecast of `forecast_s`."""
    error_s = actual_s - forecast_s
    key = (model_name, version, LATE if error_s > 0 else EARLY)
    with _lock:
        _errors.setdefault(key, Histogram()).observe(abs(error_s))


def count_slo_refusal(model_name: str, version: str) -> None:
    with _lock:
        _refusals[(model_name, version)] += 1


def ttft_forecast_errors() -> dict[tuple[str, str, str], Histogram]:
    with _lock:
        return {key: histogram.copy() for key, histogram in _errors.items()}


def slo_refusal_counts() -> dict[tuple[str, str], int]:
    with _lock:
        return dict(_refusals)


def clear() -> None:
    """Forget everything (tests)."""
    with _lock:
        _errors.clear()
        _refusals.clear()
