"""The platform `bench serve --compare` starts: its server (and replica processes on Redis) on free ports,
and the over-quota flood it measures."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from serving.benchmarks.http_client import HttpClient

REPO_ROOT = Path(__file__).resolve().parents[2]
# The OpenMP runtime's setting (config/openmp.py's SETTING; config sits above serving, so named here and
# the two kept equal by tests/test_openmp.py).
OPENMP_SETTING = "SWITCHYARD_OPENMP"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def platform_env(state: Path) -> dict[str, str]:
    """The environment of a throwaway platform in `state`: the caller's, less its own Switchyard
    configuration (a SWITCHYARD_* setting of the shell, a database, Redis, secret or artifact store),
    which would make the platform measured other than the one the benchmark describes. The OpenMP
    runtime (config/openmp.py) is kept: it is this process's too, where the engine alone runs, and the two
    paths are compared on one runtime."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if (not name.startswith("SWITCHYARD_") or name == OPENMP_SETTING)
        and name not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "ARTIFACT_ROOT"}
    }
    return {**inherited, "SWITCHYARD_STATE_DIR": str(state)}


def run_manage(env: dict[str, str], *args: str) -> str:
    """`manage.py` with `args` in `env`; its output. Raises CalledProcessError when it fails."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


class Platform:
    """A throwaway platform in its own state directory: embedded (one process) or on Redis (a gateway
    process and a `run_replica` process)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        layer: str,
        engine_env: dict[str, str],
        redis_url: str,
        server: str = "uvicorn",
    ) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="switchyard-bench-"))
        # Nothing of the caller's own configuration: a SWITCHYARD_* setting of the shell (a per-tenant
        # cap, compilation, embedded replicas beside Redis ones) would make the replica other than the
        # engine alone it is compared with, whose configuration is engine_env's alone.
        self.env = {**platform_env(self.state), **engine_env}
        if layer == "redis":
            self.env["REDIS_URL"] = redis_url
        self.layer = layer
        self.server = server  # manage.py serve --server
        self.model_dir = model_dir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        self.key = ""

    def _manage(self, *args: str) -> str:
        return run_manage(self.env, *args)

    def _spawn(self, *args: str) -> None:
        log = (self.state / f"{args[0]}.log").open("wb")
        self._logs.append(log)
        self.processes.append(
            subprocess.Popen(
                [sys.executable, "manage.py", *args],
                cwd=REPO_ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )

    def start(self) -> None:
        self._manage("migrate", "--noinput", "-v0")
        self._manage("register_model", "bench", "v1", "--from", str(self.model_dir))
        self._manage(
            "create_tenant",
            "bench",
            "--requests-per-second",
            "10000",
            "--tokens-per-minute",
            "100000000",
            "--max-concurrent",
            "10000",
        )
        self.key = self._manage("create_api_key", "--tenant", "bench").strip().splitlines()[-1]
        self._spawn("serve", "--port", str(self.port), "--server", self.server)
        if self.layer == "redis":
            self._spawn("run_replica", "--model", "bench", "--version", "v1")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(f"{self.url}/readyz", timeout=2)
                # A gateway in front of replica processes is ready before any replica is: wait for one.
                if ready.status_code == 200 and ready.json()["num_ready_replicas"] >= 1:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the platform did not become ready; logs in {self.state}")

    def stop(self, *, keep_state: bool = False) -> None:
        """End every process started, ready or not; remove the state directory (a copy of the model,
        ~90 MB) unless `keep_state` (a run that failed: its logs are there)."""
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in self._logs:
            log.close()
        if keep_state:
            print(f"the platform's logs are in {self.state}", file=sys.stderr)
        else:
            shutil.rmtree(self.state, ignore_errors=True)


async def quota_flood(
    base_url: str, key: str, model: str, *, duration_s: float, concurrency: int
) -> dict[str, float]:
    """Requests from a tenant far over its quota: how many refusals one gateway process answers per second."""
    statuses: Counter[str] = Counter()
    path = f"/v1/models/{model}/infer"
    body = {"input": "hello", "max_tokens": 4}
    deadline = time.perf_counter() + duration_s

    async def worker(client: HttpClient) -> None:
        while time.perf_counter() < deadline:
            headers = {"Authorization": f"Bearer {key}"}
            async with asyncio.timeout(30.0), client.post(path, body, headers) as response:
                await response.read()
                statuses[str(response.status)] += 1

    async with HttpClient(base_url, max_connections=concurrency) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "rate_429_per_s": statuses["429"] / wall,
        **{f"status_{k}": float(v) for k, v in statuses.items()},
    }
