"""The platform the rollback benchmark runs: serve processes (and replicas) on one state directory, on SQLite
or a throwaway Postgres database."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


MODEL = "demo-chat"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def throwaway_postgres(url: str) -> Iterator[str]:
    """A new, empty database on the server of `url` for the duration; its URL."""
    from urllib.parse import urlsplit, urlunsplit

    import psycopg

    name = f"switchyard_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(urlsplit(url)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


@dataclass
class Platform:
    """`manage.py serve` processes sharing one state directory (artifacts, secret key, SQLite file) or
    one database. Start with `start()`; `close()` stops them."""

    state_dir: Path
    num_gateways: int = 1
    env_overrides: dict[str, str] = field(default_factory=dict)
    database_url: str | None = None  # None: the SQLite file in state_dir
    urls: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    demo_key: str = ""

    @property
    def env(self) -> dict[str, str]:
        env = {**os.environ, "SWITCHYARD_STATE_DIR": str(self.state_dir), **self.env_overrides}
        for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DJANGO_SETTINGS_MODULE", "ARTIFACT_ROOT"):
            env.pop(name, None)
        if self.database_url:
            env["DATABASE_URL"] = self.database_url
        return env

    def manage(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO_ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stderr[-3000:]}")
        return result.stdout

    def prepare(self) -> None:
        """Migrate and seed (demo-chat v1 stable, the demo tenant); keeps the demo key."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.manage("migrate", "--noinput", "-v0")
        self.demo_key = self.manage("seed_demo").strip().splitlines()[-1]

    def register(self, version: str) -> None:
        """Another version of demo-chat with v1's weights (a healthy candidate, unless faults say else)."""
        self.manage("register_model", MODEL, version, "--from", str(self.state_dir / "demo-model"))

    def tenant_key(self, name: str) -> str:
        """A tenant with room for any bench load, allowed to pin and to deploy demo-chat, and a key."""
        self.manage(
            "create_tenant",
            name,
            "--requests-per-second=100000",
            "--tokens-per-minute=1000000000",
            "--max-concurrent=1000",
            "--may-pin",
            "--may-deploy",
            # demo-chat is the platform's: a tenant deploys it only when granted it
            f"--deploy-model={MODEL}",
        )
        return self.manage("create_api_key", "--tenant", name).strip().splitlines()[-1]

    def start(self, *, timeout_s: float = 180.0) -> None:
        for index in range(self.num_gateways):
            port = free_port()
            log = (self.state_dir / f"gateway-{index}.log").open("ab")
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "manage.py", "serve", "--port", str(port)],
                    cwd=REPO_ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            log.close()  # the child holds its own descriptor
            self.urls.append(f"http://127.0.0.1:{port}")
        for url in self.urls:
            self.poll(lambda url=url: httpx.get(f"{url}/readyz", timeout=5).status_code == 200, timeout_s)

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        self.urls.clear()

    def poll(self, predicate: Callable[[], bool], timeout_s: float, *, every_s: float = 0.1) -> None:
        """Poll a condition of the servers (other processes: there is no event to wait on)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"a server exited with {process.returncode}; see {self.state_dir}")
            with contextlib.suppress(httpx.HTTPError):
                if predicate():
                    return
            time.sleep(every_s)
        raise TimeoutError(f"condition not met within {timeout_s} s")

    def api(self, method: str, path: str, key: str, *, gateway: int = 0, body: Any = None) -> Any:
        response = httpx.request(
            method,
            f"{self.urls[gateway]}{path}",
            headers={"Authorization": f"Bearer {key}"},
            json=body,
            timeout=30,
        )
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json()
