"""A routing edit reaches the serving path within a second, without a restart."""

import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.live_server_process


def _served_version(server) -> str:  # type: ignore[no-untyped-def]
    response = httpx.post(
        f"{server.url}/v1/models/demo-chat/infer",
        headers={"Authorization": f"Bearer {server.key}"},
        json={"input": "hi", "max_tokens": 1},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.headers["X-Served-Version"]


def test_a_traffic_change_is_obeyed_within_one_second(platform_server, demo_model_dir: Path) -> None:
    assert (
        platform_server.manage("register_model", "demo-chat", "v2", "--from", str(demo_model_dir)).returncode
        == 0
    )
    assert platform_server.manage("set_traffic", "demo-chat", "v1=99", "v2=1").returncode == 0

    def v2_ready() -> bool:
        replicas = platform_server.replicas()
        return any(r["version"] == "v2" and r["state"] == "ready" for r in replicas)

    platform_server.wait_until(v2_ready, timeout_s=60)
    result = platform_server.manage("set_traffic", "demo-chat", "v1=0", "v2=100")
    changed_at = time.monotonic()
    assert result.returncode == 0, result.stderr
    while True:
        sent_at = time.monotonic()  # by when it was sent: a response slow to come back is no late routing
        if _served_version(platform_server) == "v2":
            break
        assert sent_at - changed_at < 1.0, "the gateway still routes to v1 a second after the change"
    # Once obeyed, it stays obeyed.
    assert {_served_version(platform_server) for _ in range(10)} == {"v2"}
    assert platform_server.manage("set_traffic", "demo-chat", "v1=100").returncode == 0
