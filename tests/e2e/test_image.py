"""The container image, built and run for real (opt-in: minutes, and root or user namespaces).

    SWITCHYARD_TEST_IMAGE=1 .venv/bin/python -m pytest tests/e2e/test_image.py -s

builds it with scripts/build-image (its environment passes through: BASE_IMAGE, WHEELS_DIR, CA_BUNDLE,
...; buildah's layer cache makes a rebuild after a code change quick), or SWITCHYARD_TEST_IMAGE=<image>
uses that image as it is. It then runs `make serve`'s embedded default in a container (the image's
`demo` command: migrate, seed_demo, serve) with podman, and talks to it through the published port as
a client would. SWITCHYARD_TEST_PODMAN (default "podman") and SWITCHYARD_TEST_PODMAN_RUN_OPTS are for
hosts whose default OCI runtime cannot start a container (docs/deployment.md gives this sandbox's)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.conftest import REPO_ROOT

IMAGE_SETTING = os.environ.get("SWITCHYARD_TEST_IMAGE", "")
TEST_TAG = "localhost/switchyard:test"
METRICS_TOKEN = "image-test-metrics-token"
# The first start builds the three random-weight demo models inside the container, then loads them.
START_TIMEOUT_S = 300

pytestmark = [
    pytest.mark.live_server_process,
    pytest.mark.skipif(
        not IMAGE_SETTING,
        reason="builds and runs the container image (minutes; buildah and podman, as root or with user "
        "namespaces): set SWITCHYARD_TEST_IMAGE=1 to build it, or to an image to test (docs/deployment.md)",
    ),
]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = [*shlex.split(os.environ.get("SWITCHYARD_TEST_PODMAN", "podman")), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{shlex.join(command)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def run_options() -> list[str]:
    return shlex.split(os.environ.get("SWITCHYARD_TEST_PODMAN_RUN_OPTS", ""))


@pytest.fixture(scope="module")
def image() -> str:
    if IMAGE_SETTING != "1":
        return IMAGE_SETTING
    started = time.monotonic()
    build = subprocess.run(
        [str(REPO_ROOT / "scripts" / "build-image")],
        cwd=REPO_ROOT,
        env={**os.environ, "IMAGE": TEST_TAG},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    size = podman("image", "inspect", TEST_TAG, "--format", "{{.Size}}").stdout.strip()
    # Said, not asserted: docs/deployment.md records what a run saw.
    sys.stderr.write(
        f"\nimage {TEST_TAG}: built in {time.monotonic() - started:.0f} s, {int(size) / 1e9:.2f} GB\n"
    )
    return TEST_TAG


@dataclass
class Container:
    name: str
    url: str

    def logs(self) -> str:
        result = podman("logs", self.name, check=False)
        return result.stdout + result.stderr

    def running(self) -> bool:
        state = podman("inspect", self.name, "--format", "{{.State.Running}}", check=False)
        return state.stdout.strip() == "true"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def demo(image: str) -> Iterator[Container]:
    """`demo` in a container, its port published on localhost, until the module's tests are done."""
    name = f"switchyard-test-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    podman(
        "run", "--detach", "--name", name, "--publish", f"127.0.0.1:{port}:8000",
        "--env", f"SWITCHYARD_METRICS_TOKEN={METRICS_TOKEN}", *run_options(), image, "demo",
    )  # fmt: skip
    container = Container(name, f"http://127.0.0.1:{port}")
    try:
        started = time.monotonic()
        while not _ready(container.url):
            assert container.running(), f"the container exited:\n{container.logs()[-4000:]}"
            assert time.monotonic() - started < START_TIMEOUT_S, (
                f"not ready in time:\n{container.logs()[-4000:]}"
            )
            time.sleep(1)
        sys.stderr.write(f"\ncontainer {name}: ready {time.monotonic() - started:.0f} s after its start\n")
        yield container
    finally:
        podman("stop", "--time", "15", name, check=False, timeout=60)  # SIGTERM: the server drains
        if os.environ.get("CI"):
            sys.stderr.write(container.logs()[-4000:])
        podman("rm", "--force", name, check=False)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _demo_key(logs: str) -> str:
    """The line after seed_demo's announcement, as `make serve` shows it."""
    lines = logs.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("demo API key")]
    return lines[at + 1].strip()


def test_the_image_says_how_it_runs(image: str) -> None:
    (inspected,) = json.loads(podman("image", "inspect", image).stdout)
    config = inspected["Config"]
    assert config["User"] == "10001:10001"
    assert "8000/tcp" in config["ExposedPorts"]
    assert config["Entrypoint"] == ["/app/scripts/image-entrypoint"] and config["Cmd"] == ["serve"]
    # Beside Config in podman's answer; only the docker format keeps it (scripts/build-image).
    assert inspected["Healthcheck"]["Test"] == ["CMD", "/app/scripts/image-entrypoint", "healthcheck"]


def test_health_readiness_and_the_demo_replicas(demo: Container) -> None:
    assert httpx.get(f"{demo.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{demo.url}/readyz", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).json()
    assert ready["ready"] is True and ready["database"] is True
    served = {(r["model"], r["state"]) for r in ready["replicas"]}
    assert served == {("demo-chat", "ready"), ("demo-embed", "ready"), ("demo-classify", "ready")}


def test_a_streamed_completion_from_the_container(demo: Container) -> None:
    events = []
    with httpx.stream(
        "POST",
        f"{demo.url}/v1/models/demo-chat/infer",
        headers={"Authorization": f"Bearer {_demo_key(demo.logs())}"},
        json={"input": "hello", "max_tokens": 16, "stream": True},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    tokens, final = events[:-1], events[-1]
    assert [e["index"] for e in tokens] == list(range(16))
    assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 16


def test_it_runs_as_its_own_user_and_its_healthcheck_passes(demo: Container) -> None:
    assert podman("exec", demo.name, "id", "-u").stdout.strip() == "10001"
    # Run by hand: podman schedules HEALTHCHECKs with systemd timers, which a host without systemd lacks.
    assert podman("healthcheck", "run", demo.name, check=False).returncode == 0


def test_migrate_is_a_command_of_its_own(image: str) -> None:
    result = podman("run", "--rm", *run_options(), image, "migrate", timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Applying registry" in result.stdout


def test_a_placeholder_setting_stops_it_before_it_starts(image: str) -> None:
    result = podman(
        "run", "--rm", "--env", "SECRET_KEY=REPLACE-ME", *run_options(), image, "serve", check=False
    )  # fmt: skip
    assert result.returncode == 78
    assert "SECRET_KEY" in result.stderr
