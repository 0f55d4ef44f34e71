"""Production mode: a gateway process and replica processes on the Redis channel layer and Postgres
(tests/e2e/redis_fleet.py starts them). Failures under load, on a fleet of their own, are in
tests/e2e/test_fleet_faults.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from serving.gateway.router import REVALIDATE_S
from tests.conftest import REPO_ROOT
from tests.e2e.redis_fleet import Fleet, autoscaling, running_fleet, stream

pytestmark = [pytest.mark.live_server_process, pytest.mark.redis]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from running_fleet(tmp_path_factory)


def test_openai_client_streams_through_the_redis_layer(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=f"{fleet.server.url}/v1", api_key=fleet.server.key, max_retries=0)
    chunks = list(
        client.completions.create(
            model="demo-chat", prompt="hello", max_tokens=12, stream=True, temperature=0
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model="demo-chat", prompt="hello", max_tokens=12, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_embeddings_through_the_redis_layer_from_a_replica_process(fleet: Fleet) -> None:
    _, process = fleet.launch_replica("demo-embed")
    try:
        client = openai.OpenAI(base_url=f"{fleet.server.url}/v1", api_key=fleet.server.key, max_retries=0)
        texts = ["hello world", "the quick brown fox", "hello world"]
        result = client.embeddings.create(model="demo-embed", input=texts, encoding_format="float")
        first, second, again = ([*d.embedding] for d in result.data)
        assert first == pytest.approx(again, abs=1e-5)  # the same text, in another row of the batch
        assert first != pytest.approx(second, abs=1e-3)
        assert sum(x * x for x in second) == pytest.approx(1.0, abs=1e-5)  # mean-pooled and normalized
        with pytest.raises(openai.BadRequestError, match="takes at most 512"):
            client.embeddings.create(model="demo-embed", input="word " * 600)
    finally:
        process.kill()
        process.wait()


def test_a_classifier_through_the_redis_layer_from_a_replica_process(fleet: Fleet) -> None:
    _, process = fleet.launch_replica("demo-classify")
    try:
        response = httpx.post(
            f"{fleet.server.url}/v1/models/demo-classify/infer",
            headers={"Authorization": f"Bearer {fleet.server.key}"},
            json={"input": ["hello world", "the quick brown fox", "hello world"]},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert response.headers["X-Served-Version"] == "v1"
        first, second, again = (
            {p["label"]: p["score"] for p in labels} for labels in response.json()["predictions"]
        )
        assert set(first) == {"negative", "positive"}
        assert first == pytest.approx(again, abs=1e-5)  # the same text, in another row of the batch
        assert first != pytest.approx(second, abs=1e-6)
        assert sum(second.values()) == pytest.approx(1.0, abs=1e-5)
    finally:
        process.kill()
        process.wait()


def _set_target(fleet: Fleet, model: str, replicas: int) -> None:
    code = (
        "from registry.models import ModelVersion; from rollouts.models import ScaleTarget; "
        f"v = ModelVersion.objects.get(model__name={model!r}, version='v1'); "
        f"ScaleTarget.objects.update_or_create(version=v, defaults={{'replicas': {replicas}}})"
    )
    result = fleet.server.manage("shell", "-c", code)
    assert result.returncode == 0, result.stderr


def test_the_provisioner_runs_as_many_replica_processes_as_the_target_and_drains_the_extra(
    fleet: Fleet,
) -> None:
    def ready_replicas() -> int:
        beats = fleet.server.replicas()
        return sum(1 for r in beats if r["model"] == "demo-classify" and r["state"] == "ready")

    _set_target(fleet, "demo-classify", 2)
    log_path = fleet.state / "provisioner.log"
    with log_path.open("wb") as log:
        provisioner = subprocess.Popen(
            [
                *(sys.executable, "manage.py", "run_provisioner", "--model", "demo-classify"),
                *("--devices", "cpu", "--interval", "0.5"),
            ],
            cwd=REPO_ROOT,
            env=fleet.server.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        fleet.server.wait_until(lambda: ready_replicas() == 2, timeout_s=120)
        _set_target(fleet, "demo-classify", 1)
        fleet.server.wait_until(lambda: ready_replicas() == 1, timeout_s=60)
        response = httpx.post(
            f"{fleet.server.url}/v1/models/demo-classify/infer",
            headers={"Authorization": f"Bearer {fleet.server.key}"},
            json={"input": "hello"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        provisioner.send_signal(signal.SIGTERM)  # drains what it runs, then exits
        assert provisioner.wait(60) == 0, log_path.read_text()
        fleet.server.wait_until(lambda: ready_replicas() == 0, timeout_s=30)
    finally:
        if provisioner.poll() is None:
            provisioner.kill()
            provisioner.wait()
    text = log_path.read_text()
    assert text.count("started a replica of demo-classify:v1") == 2, text
    assert text.count("draining the replica of demo-classify:v1") == 2, text


def test_a_model_scaled_to_zero_gets_a_replica_for_a_request_and_loses_it_when_idle(fleet: Fleet) -> None:
    """The whole loop, every part real: Celery beat runs the autoscaler, the provisioner starts and drains
    replica processes, and the gateway holds the request that finds no replica until one is ready."""

    def ready_replicas() -> int:
        beats = fleet.server.replicas()
        return sum(1 for r in beats if r["model"] == "demo-classify" and r["state"] == "ready")

    assert ready_replicas() == 0
    _set_target(fleet, "demo-classify", 0)
    scaled = fleet.server.manage("set_scaling", "demo-classify", "--min", "0", "--max", "1")
    assert scaled.returncode == 0, scaled.stderr
    # The gateway learns it at its routing cache's next check (the last test's requests left an entry up
    # to REVALIDATE_S old); a request before then finds no replica and no leave to wait for one. The
    # gateway is another process, with nothing to await: the bound itself is the wait.
    time.sleep(2 * REVALIDATE_S)
    try:
        with autoscaling(fleet, "zero") as logs:
            response = httpx.post(
                f"{fleet.server.url}/v1/models/demo-classify/infer",
                headers={"Authorization": f"Bearer {fleet.server.key}"},
                json={"input": "hello"},
                timeout=150,  # the gateway holds it for up to SWITCHYARD_COLD_START_TIMEOUT_S (120 s)
            )
            assert response.status_code == 200, response.text
            assert response.json()["predictions"][0][0]["label"] in {"negative", "positive"}
            assert "started a replica of demo-classify:v1" in logs["provisioner"].read_text()
            # five seconds without a request: the autoscaler scales it to zero and the provisioner drains it
            fleet.server.wait_until(lambda: ready_replicas() == 0, timeout_s=60)
            fleet.server.wait_until(
                lambda: "draining the replica of demo-classify:v1" in logs["provisioner"].read_text(),
                timeout_s=30,
            )
    finally:
        fleet.server.manage("set_scaling", "demo-classify", "--clear")
    provisioner_log = logs["provisioner"].read_text()
    assert provisioner_log.count("started a replica of demo-classify:v1") == 1, provisioner_log
    assert "autoscaler: demo-classify:v1 0 -> 1 replicas (kept warm" in logs["celery"].read_text()


def test_both_replicas_take_traffic(fleet: Fleet) -> None:
    served: set[str] = set()
    for _ in range(40):  # both within a few requests; more only if a heartbeat runs late under load
        served.add(stream(fleet.server, 4)["replica"])
        if served == set(fleet.replicas):
            break
    assert served == set(fleet.replicas)


def test_sigterm_drains_a_replica_before_it_exits(fleet: Fleet) -> None:
    fleet.start_replica()
    first_token = threading.Event()
    results: list[dict] = []
    streams = [threading.Thread(target=lambda: results.append(stream(fleet.server, 150, first_token)))]
    streams[0].start()
    assert first_token.wait(60)
    for rid, process in list(fleet.replicas.items()):
        process.send_signal(signal.SIGTERM)  # every replica drains; in-flight work must still finish
        assert fleet.wait_for_exit(rid) == 0
    streams[0].join(60)
    assert results[0]["events"][-1]["finish_reason"] == "length"
