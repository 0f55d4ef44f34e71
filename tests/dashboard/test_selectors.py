"""The overview's reads: one page for every model, read again for every open page every 1.5 s."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dashboard import selectors
from rollouts.models import ScaleTarget
from tests.dashboard.conftest import FLEET, record_traffic

pytestmark = pytest.mark.django_db


def _model_with_a_canary(name: str, *, ttft_s: float) -> Any:
    from rollouts.services import deployment_create
    from tests.conftest import model_rows

    model = model_rows(name, ("v1", "v2"))
    record_traffic(model, "v1", ttft_s=ttft_s)
    record_traffic(model, "v2", ttft_s=ttft_s * 4, num_requests=10)
    deployment_create(
        model=model, version="v2", created_by="test", steps=[{"pct": 50}, {"pct": 100}], bake_seconds=60
    )
    ScaleTarget.objects.create(version=model.versions.get(version="v1"), replicas=2, reason=f"{name} busy")
    return model


def _queries(read: Any) -> tuple[int, Any]:
    with CaptureQueriesContext(connection) as queries:
        page = read()
    return len(queries), page


def test_the_overview_reads_a_fixed_number_of_queries_however_many_models() -> None:
    _model_with_a_canary("chat", ttft_s=0.1)
    one, _ = _queries(lambda: selectors.overview(replicas=FLEET))
    for i in range(4):
        _model_with_a_canary(f"model-{i}", ttft_s=0.2 * (i + 1))
    five, page = _queries(lambda: selectors.overview(replicas=FLEET))
    assert len(page["models"]) == 5
    assert five == one

    # Each model's rows carry its own figures, not another's from the batched reads.
    for i, model in enumerate(m for m in page["models"] if m["name"].startswith("model-")):
        by_version = {v["version"]: v for v in model["versions"]}
        assert by_version["v1"]["ttft_p99_ms"] == pytest.approx(200 * (i + 1), rel=0.1)
        assert by_version["v2"]["ttft_p99_ms"] == pytest.approx(800 * (i + 1), rel=0.1)
        assert by_version["v1"]["state"] == "incumbent"
        assert by_version["v2"]["state"] == "provisioning"
        assert by_version["v1"]["target_reason"] == f"{model['name']} busy"
        assert model["deployment"]["candidate"] == "v2"


def test_the_overviews_live_feed_reads_a_fixed_number_of_queries_however_many_models() -> None:
    _model_with_a_canary("chat", ttft_s=0.1)
    one, _ = _queries(lambda: selectors.overview_update(replicas=FLEET))
    for i in range(3):
        _model_with_a_canary(f"model-{i}", ttft_s=0.1)
    four, update = _queries(lambda: selectors.overview_update(replicas=FLEET))
    assert [m["name"] for m in update["models"]] == ["chat", "model-0", "model-1", "model-2"]
    assert four == one
