"""The model page's p99 TTFT, TPOT and queue wait per service tier (docs/architecture.md, "Service
tiers"): one series per (version, tier) with traffic, never blending versions or tiers, at load and in the
live feed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from dashboard import charts, selectors
from serving.selectors import version_window
from tests.dashboard.conftest import FLEET, record_traffic
from tests.dashboard.test_views import _config

pytestmark = pytest.mark.django_db


@pytest.fixture
def chat_with_tiers(chat: Any) -> Any:
    """v1 serves priority in ~100 ms and flex in ~800 ms; v2 serves default only, in ~400 ms."""
    record_traffic(chat, "v1", ttft_s=0.1, num_requests=10, service_tier="priority")
    record_traffic(chat, "v1", ttft_s=0.8, num_requests=5, service_tier="flex")
    record_traffic(chat, "v2", ttft_s=0.4, num_requests=4, service_tier="default")
    return chat


def _tier_points(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p["tier_ttft"] for p in points if p["n"]]


def test_a_chart_point_has_the_p99_ttft_of_each_tier_with_traffic_only(chat_with_tiers: Any) -> None:
    now = timezone.now()
    window = version_window(model_name="chat", version="v1", start=now - timedelta(minutes=1), end=now)
    point = charts.chart_point(window)
    assert list(point["tier_ttft"]) == ["priority", "flex"]  # best first; no default: no traffic
    assert point["tier_ttft"]["priority"] == pytest.approx(100.0, rel=0.02)
    assert point["tier_ttft"]["flex"] == pytest.approx(800.0, rel=0.02)
    assert point["ttft"][2] == pytest.approx(800.0, rel=0.02)  # the version's own p99, as before
    # The same tiers' p99 TPOT and queue wait (record_traffic: a tenth and a half of the TTFT).
    assert point["tier_tpot"] == pytest.approx({"priority": 10.0, "flex": 80.0}, rel=0.05)
    assert point["tier_queue_wait"] == pytest.approx({"priority": 50.0, "flex": 400.0}, rel=0.05)


def test_model_page_charts_p99_ttft_per_version_and_tier(staff_client: Client, chat_with_tiers: Any) -> None:
    response = staff_client.get("/dashboard/models/chat/")
    for chart in ("tier_ttft", "tier_tpot", "tier_queue_wait"):
        assert f'data-chart="{chart}"' in response.text
    assert "p99 time to first token by service tier" in response.text
    assert "p99 time per output token by service tier" in response.text
    config = _config(response)
    assert [c["id"] for c in config["tier_charts"]] == ["tier_ttft", "tier_tpot", "tier_queue_wait"]
    assert list(config["tier_dash"]) == ["priority", "default", "flex"]

    (v1,) = _tier_points(config["points"]["v1"])
    assert set(v1) == {"priority", "flex"}
    assert v1["priority"] == pytest.approx(100.0, rel=0.02)
    assert v1["flex"] == pytest.approx(800.0, rel=0.02)
    (v2,) = _tier_points(config["points"]["v2"])
    assert set(v2) == {"default"} and v2["default"] == pytest.approx(400.0, rel=0.02)
    # Steps without requests have no tier at all: no line drawn through them at 0.
    assert all(p["tier_ttft"] == {} for p in config["points"]["v1"] if not p["n"])


def test_the_live_feed_sends_the_tiers_too(chat_with_tiers: Any) -> None:
    update = selectors.live_update(
        model_name="chat",
        chart=charts.chart_range("5m"),
        charted=["v1", "v2"],
        replicas=FLEET,
        whole_range=True,
    )
    assert [set(p) for p in _tier_points(update["points"]["v1"])] == [{"priority", "flex"}]
    assert [set(p) for p in _tier_points(update["points"]["v2"])] == [{"default"}]


def test_traffic_without_tiers_charts_no_tier_series(staff_client: Client, chat_with_traffic: Any) -> None:
    config = _config(staff_client.get("/dashboard/models/chat/"))
    assert all(p["tier_ttft"] == {} for points in config["points"].values() for p in points)
