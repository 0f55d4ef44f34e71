"""A pin through the provisioner (issue 43), every part real: a request pinned (X-Version-Pin) to a version
with no traffic and no replica waits at the gateway, whose demand in Redis gets the version a replica
from the autoscaler (Celery beat), which the provisioner starts; once the version has had no request for
the idle time, the provisioner drains it (docs/architecture.md, "Replicas kept warm")."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.redis_fleet import Fleet, autoscaling, running_fleet

pytestmark = [pytest.mark.live_server_process, pytest.mark.redis]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from running_fleet(tmp_path_factory)


def test_a_pin_to_a_version_without_traffic_gets_a_replica_from_the_provisioner_until_idle(
    fleet: Fleet,
) -> None:
    source = fleet.state / "demo-classifier-model"  # seed_demo's build of demo-classify v1
    registered = fleet.server.manage(
        "register_model", "demo-classify", "v2", "--from", str(source), "--kind", "classifier"
    )
    assert registered.returncode == 0, registered.stderr
    with autoscaling(fleet, "pin") as logs:
        response = httpx.post(
            f"{fleet.server.url}/v1/models/demo-classify/infer",
            headers={"Authorization": f"Bearer {fleet.server.key}", "X-Version-Pin": "v2"},  # may pin
            json={"input": "hello"},
            timeout=150,  # the gateway holds it for up to SWITCHYARD_COLD_START_TIMEOUT_S (120 s)
        )
        assert response.status_code == 200, response.text
        assert response.headers["X-Served-Version"] == "v2"
        assert "started a replica of demo-classify:v2" in logs["provisioner"].read_text()
        # five seconds without a pinned request: the autoscaler takes its replica away, the provisioner
        # drains it
        fleet.server.wait_until(
            lambda: "draining the replica of demo-classify:v2" in logs["provisioner"].read_text(),
            timeout_s=60,
        )
    assert "autoscaler: demo-classify:v2 0 -> 1 replicas (kept warm" in logs["celery"].read_text()
