"""Traffic moved to a version that has no replica yet, on the embedded platform (`make serve`'s): the
supervisor starts its replica only once the version has traffic, so the moved requests find it loading.
They wait for it and are served, none refused (docs/reliability.md, "Soak": the soak's replica restart
cost 227 refusals, 503s with Retry-After, before they did)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import LiveServer, embedded_env, seeded, serving

pytestmark = pytest.mark.live_server_process

NUM_CLIENTS = 4
# The demo chat model's artifact directory, for a second version of the same weights.
_ARTIFACT_OF_V1 = (
    "import json; from registry.models import ModelVersion; "
    "v = ModelVersion.objects.get(model__name='demo-chat', version='v1'); "
    "print(json.dumps({'path': v.artifact_uri}))"
)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    state = tmp_path_factory.mktemp("move")
    env = embedded_env(state)
    with serving(state, env, seeded(env)) as server:
        yield server
        log = Path(state / "server.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


def test_requests_moved_to_a_version_without_a_replica_wait_for_its_load_and_none_is_refused(
    embedded: LiveServer,
) -> None:
    key = embedded.tenant_key("mover", max_concurrent=NUM_CLIENTS * 2)
    shown = embedded.manage("shell", "-c", _ARTIFACT_OF_V1)
    artifact = json.loads(shown.stdout.strip().splitlines()[-1])["path"]
    registered = embedded.manage("register_model", "demo-chat", "v1b", "--from", artifact)
    assert registered.returncode == 0, registered.stderr

    answers: list[tuple[float, float, int, str | None]] = []  # (sent, latency, status, served version)
    landed = threading.Condition()
    stopping = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=embedded.url, headers={"Authorization": f"Bearer {key}"}) as http:
            while not stopping.is_set():
                sent = time.monotonic()
                response = http.post(
                    "/v1/models/demo-chat/infer", json={"input": "hello", "max_tokens": 4}, timeout=120
                )
                with landed:
                    answers.append(
                        (
                            sent,
                            time.monotonic() - sent,
                            response.status_code,
                            response.headers.get("X-Served-Version"),
                        )
                    )
                    landed.notify_all()

    def served_by(version: str, *, after: float = 0.0) -> int:
        return sum(1 for sent, _, status, v in answers if status == 200 and v == version and sent > after)

    clients = [threading.Thread(target=client) for _ in range(NUM_CLIENTS)]
    for thread in clients:
        thread.start()
    try:
        with landed:
            assert landed.wait_for(lambda: served_by("v1") >= NUM_CLIENTS, 60)
        moved = embedded.manage("set_traffic", "demo-chat", "v1b=100")
        assert moved.returncode == 0, moved.stderr
        moved_at = time.monotonic()
        with landed:  # v1b loads, and then serves for a moment
            assert landed.wait_for(lambda: served_by("v1b", after=moved_at) >= 4 * NUM_CLIENTS, 120)
    finally:
        stopping.set()
        for thread in clients:
            thread.join(130)
    refused = [(status, version) for _, _, status, version in answers if status != 200]
    waited = max(latency for sent, latency, _, v in answers if v == "v1b")
    print(
        f"\n{len(answers)} requests, {served_by('v1')} served by v1 and {served_by('v1b')} by v1b, "
        f"{len(refused)} refused; the longest wait for v1b's replica to load {waited:.2f} s"
    )
    assert refused == []
