"""A real platform process: `manage.py serve` on a free port with its own state directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO_ROOT

METRICS_TOKEN = "e2e-metrics-token"  # /metrics and /readyz's replica list, for the tests' platforms


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    url: str
    key: str
    env: dict[str, str]
    process: subprocess.Popen[bytes]

    def manage(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO_ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def tenant_key(self, name: str, *, max_concurrent: int, tokens_per_minute: int = 100_000_000) -> str:
        """A new tenant's key, its rate quota out of the way, its concurrency `max_concurrent` and its
        tokens/min `tokens_per_minute` (by default out of the way too)."""
        created = self.manage(
            "create_tenant", name, "--max-concurrent", str(max_concurrent),
            "--requests-per-second", "10000", "--tokens-per-minute", str(tokens_per_minute),
        )  # fmt: skip
        assert created.returncode == 0, created.stderr
        keyed = self.manage("create_api_key", "--tenant", name)
        assert keyed.returncode == 0, keyed.stderr
        return keyed.stdout.strip().splitlines()[-1]

    def replicas(self) -> list[dict[str, Any]]:
        """/readyz's replica list, which it shows to the metrics token (or staff) only."""
        headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}
        return httpx.get(f"{self.url}/readyz", headers=headers).json()["replicas"]  # type: ignore[no-any-return]

    def wait_until(self, predicate, *, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
        """Poll an HTTP condition of the live server (an external process: there is no event to await)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}")
            try:
                if predicate():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("condition not met in time")


def embedded_env(state: Path, **extra: str) -> dict[str, str]:
    """The environment of an embedded platform in `state`: SQLite, in-memory layer, no secrets but the
    test's metrics token."""
    env = {
        **os.environ,
        "SWITCHYARD_STATE_DIR": str(state),
        "SWITCHYARD_METRICS_TOKEN": METRICS_TOKEN,
        "SWITCHYARD_REPLICA_SYNC_INTERVAL_S": "0.5",
        **extra,
    }
    for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DJANGO_SETTINGS_MODULE"):
        env.pop(name, None)
    return env


def seeded(env: dict[str, str]) -> str:
    """Migrate the platform in `env`'s state directory and seed the demo: the demo key."""
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "manage.py", *a], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    run("migrate", "--noinput", "-v0")
    return run("seed_demo").stdout.strip().splitlines()[-1]


@contextmanager
def serving(
    state: Path, env: dict[str, str], key: str, *, command: tuple[str, ...] = ("manage.py", "serve")
) -> Iterator[LiveServer]:
    """`manage.py serve` (or `command`, told the port as serve and daphne are) on a free port until the
    block ends; its log goes to stderr under CI."""
    port = _free_port()
    log = (state / "server.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, *command, "--port", str(port)],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = LiveServer(f"http://127.0.0.1:{port}", key, env, process)
    try:
        server.wait_until(lambda: httpx.get(f"{server.url}/readyz").status_code == 200, timeout_s=120)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        if os.environ.get("CI"):
            sys.stderr.write(Path(state / "server.log").read_text(errors="replace")[-4000:])


@pytest.fixture(scope="session")
def platform_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    state = tmp_path_factory.mktemp("state")
    # Its tests share one client address, and schemathesis tries keys that are not: failed sign-ins are
    # not throttled here (tests/e2e/test_edge_limits.py's own server shows that they are).
    env = embedded_env(state, SWITCHYARD_AUTH_FAILURE_LIMIT="100000")
    with serving(state, env, seeded(env)) as server:
        yield server
