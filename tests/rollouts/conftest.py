"""Factories for the rollouts tests: registry rows without artifacts (the control plane never opens one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from rollouts.judge import VersionWindow

HEALTHY = VersionWindow(
    num_requests=500,
    num_errors=2,
    num_empty_outputs=1,
    ttft_p99_ms=120.0,
    tpot_p99_ms=20.0,
    mean_output_tokens=60.0,
)


def window(**changes: Any) -> VersionWindow:
    """A healthy window with some fields changed."""
    values = {
        "num_requests": HEALTHY.num_requests,
        "num_errors": HEALTHY.num_errors,
        "num_empty_outputs": HEALTHY.num_empty_outputs,
        "ttft_p99_ms": HEALTHY.ttft_p99_ms,
        "tpot_p99_ms": HEALTHY.tpot_p99_ms,
        "mean_output_tokens": HEALTHY.mean_output_tokens,
    }
    values.update(changes)
    return VersionWindow(**values)


@dataclass
class FakeMetrics:
    """Stands in for the metrics store's selector: a window per version, and the calls it got."""

    windows: dict[str, VersionWindow] = field(default_factory=dict)
    calls: list[tuple[str, str, Any, Any]] = field(default_factory=list)

    def __call__(self, *, model_name: str, version: str, start: Any, end: Any) -> VersionWindow:
        self.calls.append((model_name, version, start, end))
        return self.windows.get(version, window(num_requests=0, num_errors=0, num_empty_outputs=0))


# Set by the fake_metrics fixture; read through settings.ROLLOUT_WINDOW_READER by code that is not
# handed a reader (the Celery task, the embedded scheduler).
CURRENT_METRICS: FakeMetrics | None = None


def read_current_window(**kwargs: Any) -> VersionWindow:
    assert CURRENT_METRICS is not None
    return CURRENT_METRICS(**kwargs)


@pytest.fixture
def fake_metrics(settings: Any) -> Any:
    global CURRENT_METRICS
    CURRENT_METRICS = FakeMetrics()
    settings.ROLLOUT_WINDOW_READER = "tests.rollouts.conftest.read_current_window"
    yield CURRENT_METRICS
    CURRENT_METRICS = None


@pytest.fixture
def make_model(db: None) -> Callable[..., Any]:
    """A model whose first version is stable with 100% of traffic; later versions start at 0%."""
    from tests.conftest import model_rows

    return model_rows


def routing_state(model: Any) -> tuple[int, dict[str, int], dict[str, str]]:
    """(revision, weights > 0, aliases) of a model, read fresh."""
    from registry.selectors import routing_snapshot

    snapshot = routing_snapshot(model_name=model.name)
    assert snapshot is not None
    return snapshot.revision, snapshot.weights, snapshot.aliases


@pytest.fixture
def staff_client(client):  # type: ignore[no-untyped-def]
    """The test client logged in as staff user `alice` (deployments record "staff:alice")."""
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.create_user("alice", is_staff=True))
    return client
