"""How many requests this process copied to a shadow version, or skipped (too many copies in flight).

Kept here, not in the gateway's shadow.py, so that /metrics (prometheus.py) reads it without telemetry
importing the gateway (docs/architecture.md, "Import rules")."""

from __future__ import annotations

import threading
from collections import Counter

_counts: Counter[tuple[str, str, str]] = Counter()  # (model, version, started | skipped)
_lock = threading.Lock()


def count_shadow_copy(model_name: str, version: str, outcome: str) -> None:
    with _lock:
        _counts[(model_name, version, outcome)] += 1


def shadow_copy_counts() -> dict[tuple[str, str, str], int]:
    with _lock:
        return dict(_counts)
