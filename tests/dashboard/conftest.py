"""Fixtures for the dashboard tests: users, a model with two versions and metrics rows, a fake fleet."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from serving.gateway.data_plane import ReplicaHandle

PASSWORD = "correct-horse-battery"


def replica(
    version: str,
    *,
    kv: float = 0.25,
    waiting: int = 1,
    running: int = 2,
    state: str = "ready",
    step_s: float = 0.0,
) -> ReplicaHandle:
    return ReplicaHandle(
        replica_id=f"replica-{version}-0001",
        model_name="chat",
        version=version,
        channel_name=f"switchyard.replica.chat.{version}.x",
        state=state,
        load=waiting + running,
        kv_cache_usage=kv,
        is_ready=state == "ready",
        is_local=True,
        queue_depth=waiting,
        num_running=running,
        step_s=step_s,
    )


# Queue depths differ from loads (waiting + running), so a page showing the load would be caught.
FLEET = [
    replica("v1", kv=0.25, waiting=1, running=2, step_s=0.0125),
    replica("v2", kv=0.5, waiting=4, running=0, state="loading"),
]


@pytest.fixture(autouse=True)
def fake_fleet(monkeypatch: pytest.MonkeyPatch) -> list[ReplicaHandle]:
    """The pages read replicas from the data plane's runtime; here a fixed fleet stands in, so no
    runtime (and no model) is started by a page view."""
    from dashboard import selectors

    fleet = list(FLEET)

    async def fleet_replicas() -> list[ReplicaHandle]:
        return fleet

    monkeypatch.setattr(selectors, "fleet_replicas", fleet_replicas)
    return fleet


@pytest.fixture
def make_user(db: None) -> Callable[..., Any]:
    from django.contrib.auth import get_user_model

    def make(username: str = "admin", *, is_staff: bool = True) -> Any:
        return get_user_model().objects.create_user(
            username=username, password=PASSWORD, is_staff=is_staff, email=f"{username}@example.com"
        )

    return make


@pytest.fixture
def staff_client(client: Any, make_user: Callable[..., Any]) -> Any:
    client.force_login(make_user("admin"))
    return client


@pytest.fixture
def chat(db: None) -> Any:
    """Model `chat`: v1 stable with 100% of traffic, v2 registered at 0% (rows only, no artifacts)."""
    from tests.conftest import model_rows

    return model_rows("chat", ("v1", "v2"))


def record_traffic(
    model: Any,
    version: str,
    *,
    ttft_s: float,
    num_requests: int = 20,
    ago_s: float = 12,
    service_tier: str | None = None,
) -> None:
    """Write `num_requests` requests of one version into the metrics store, `ago_s` seconds ago, through
    the replica's own recorder and flush; of `service_tier`, when given."""
    from serving.telemetry.recorder import MetricsRecorder, RequestSample, StepSample

    mv = model.versions.get(version=version)
    recorder = MetricsRecorder(
        model_name=model.name, version=version, version_id=mv.pk, replica_id=f"replica-{version}-0001"
    )
    now = time.time() - ago_s
    requests = [
        RequestSample(
            finish_reason="error" if i == 0 else "length",
            num_prompt_tokens=5,
            num_output_tokens=8,
            ttft_s=ttft_s,
            tpot_s=ttft_s / 10,
            e2e_s=ttft_s * 2,
            queue_wait_s=ttft_s / 2,
            error_type="model_error" if i == 0 else None,
            service_tier=service_tier,
        )
        for i in range(num_requests)
    ]
    step = StepSample(model_time_s=0.02, batch_size=4, num_waiting=1, num_running=4, kv_cache_usage=0.3)
    recorder.record(step=step, requests=requests, now=now)
    recorder.record(step=step, now=now)
    assert recorder.flush() >= 1


@pytest.fixture
def chat_with_traffic(chat: Any) -> Any:
    """v1 answers in ~100 ms, v2 (the canary) in ~400 ms: series that would show any blending."""
    record_traffic(chat, "v1", ttft_s=0.1)
    record_traffic(chat, "v2", ttft_s=0.4, num_requests=10)
    return chat


@pytest.fixture
def deployment(chat: Any) -> Any:
    """A canary of v2 against v1, in flight (provisioning: the canary alias points at v2)."""
    from rollouts.services import deployment_create

    return deployment_create(
        model=chat, version="v2", created_by="test", steps=[{"pct": 50}, {"pct": 100}], bake_seconds=60
    )
