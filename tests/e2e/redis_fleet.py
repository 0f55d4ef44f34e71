"""The Redis fleet the production-mode tests run on (tests/e2e/test_redis_fleet.py, test_fleet_faults.py):
a gateway process (`manage.py serve`) and replica processes (`run_replica`) on the Redis channel layer
and a Postgres database of their own. Each module that uses it starts one, through `running_fleet`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from serving.benchmarks.serve_platform import run_manage
from serving.transport.protocol import HEARTBEAT_INTERVAL_S
from tests.conftest import REPO_ROOT, require_service
from tests.e2e.conftest import METRICS_TOKEN, LiveServer, _free_port

REDIS_URL = "redis://127.0.0.1:6379/14"
POSTGRES_ADMIN_URL = os.environ.get("SWITCHYARD_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
FLEET_DATABASE = "switchyard_e2e_fleet"


def _fresh_postgres_database() -> str:
    """Production mode runs on Postgres: a database of its own for the fleet's processes, recreated
    empty (they migrate it). Skips outside CI when Postgres is not running; CI must have it."""
    import psycopg

    require_service("Postgres", "127.0.0.1", 5432)
    admin = POSTGRES_ADMIN_URL.replace("postgres://", "postgresql://").rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {FLEET_DATABASE} WITH (FORCE)")
        connection.execute(f"CREATE DATABASE {FLEET_DATABASE}")
    return POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + "/" + FLEET_DATABASE


STARTED_ON: list[str] = []  # the replica of every stream, as soon as its headers arrive


@dataclass
class Fleet:
    server: LiveServer
    replicas: dict[str, subprocess.Popen[bytes]]  # replica id -> process
    state: Path  # the processes' logs: server.log, and replica-N.log for each replica started
    log_of: dict[str, Path] = field(default_factory=dict)  # replica id -> its log

    def ready_replicas(self) -> set[str]:
        beats = self.server.replicas()
        return {r["replica_id"] for r in beats if r["state"] == "ready"}

    def start_replica(self) -> None:
        replica_id, process = self.launch_replica("demo-chat")
        self.replicas[replica_id] = process

    def launch_replica(self, model: str) -> tuple[str, subprocess.Popen[bytes]]:
        """A ready `run_replica` process of `model` v1 (not in `replicas`, which holds demo-chat's)."""
        before = self.ready_replicas()
        log_path = self.state / f"replica-{len(self.log_of)}.log"
        with log_path.open("wb") as log:  # the child keeps its own descriptor
            process = subprocess.Popen(
                [
                    sys.executable,
                    "manage.py",
                    "run_replica",
                    "--model",
                    model,
                    "--version",
                    "v1",
                    "--kv-cache-mb",
                    "32",
                ],
                cwd=REPO_ROOT,
                env=self.server.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.server.wait_until(lambda: len(self.ready_replicas() - before) == 1, timeout_s=120)
        (replica_id,) = self.ready_replicas() - before
        self.log_of[replica_id] = log_path
        return replica_id, process

    def wait_for_exit(self, replica_id: str, timeout_s: float = 60) -> int:
        """The replica's exit code. One still running after `timeout_s` is made to print every thread's
        stack (faulthandler, on SIGABRT) and the test fails with its log and the gateway's: a hang
        here shows up in CI only, where nothing else would say where it waits."""
        process = self.replicas.pop(replica_id)
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            process.wait(30)
            tails = [
                f"--- {path.name} ---\n" + path.read_text(errors="replace")[-12000:]
                for path in (self.log_of[replica_id], self.state / "server.log")
            ]
            pytest.fail(f"replica {replica_id} still running {timeout_s:.0f} s on\n" + "\n".join(tails))


def running_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A module's fleet: two replicas of demo-chat v1 behind a gateway, until the module ends."""
    require_service("Redis", "127.0.0.1", 6379)
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    # A replica left running by an interrupted run would beat into this database and be routed to (its
    # beats look like this fleet's): said here, rather than as a test failing for no visible reason.
    time.sleep(3 * HEARTBEAT_INTERVAL_S)
    strays = client.keys("switchyard:replicas:*")
    assert not strays, f"replicas of another run are beating into {REDIS_URL}: {strays} (kill them)"
    state = tmp_path_factory.mktemp("fleet")
    env = {
        **os.environ,
        "SWITCHYARD_STATE_DIR": str(state),
        "REDIS_URL": REDIS_URL,
        "DATABASE_URL": _fresh_postgres_database(),
        "SWITCHYARD_METRICS_TOKEN": METRICS_TOKEN,
        "PYTHONFAULTHANDLER": "1",  # a process sent SIGABRT prints every thread's stack
    }
    for name in ("SECRET_KEY", "DJANGO_SETTINGS_MODULE"):
        env.pop(name, None)

    run_manage(env, "migrate", "--noinput", "-v0")
    key = run_manage(env, "seed_demo").strip().splitlines()[-1]
    port = _free_port()
    log = (state / "server.log").open("wb")
    web = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port)],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = LiveServer(f"http://127.0.0.1:{port}", key, env, web)
    fleet = Fleet(server, {}, state)
    try:
        server.wait_until(lambda: httpx.get(f"{server.url}/healthz").status_code == 200)
        fleet.start_replica()
        fleet.start_replica()
        yield fleet
    finally:
        for process in [web, *fleet.replicas.values()]:
            if process.poll() is None:
                process.kill()
            process.wait()
        log.close()
        redis.Redis.from_url(REDIS_URL).flushdb()


def stream(
    server: LiveServer, max_tokens: int, first_token: threading.Event | None = None, *, key: str | None = None
) -> dict:
    """Stream /infer (with `key`, by default the demo's); return the served replica and every event."""
    events: list[dict] = []
    first_at = float("nan")
    with httpx.stream(
        "POST",
        f"{server.url}/v1/models/demo-chat/infer",
        headers={"Authorization": f"Bearer {key or server.key}"},
        json={"input": "hello", "max_tokens": max_tokens, "stream": True},
        timeout=60,
    ) as response:
        replica = response.headers["X-Served-Replica"]
        STARTED_ON.append(replica)
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 1:
                    first_at = time.monotonic()
                    if first_token is not None:
                        first_token.set()
    return {"replica": replica, "events": events, "ended_at": time.monotonic(), "first_at": first_at}


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to each (they drain together), then wait for each; one that does not exit in 60 s is
    killed."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def autoscaling(fleet: Fleet, tag: str) -> Iterator[dict[str, Path]]:
    """Celery (a worker with beat, which runs the autoscaler every 0.5 s and takes the replicas of a
    version idle for 5 s away) and a provisioner of demo-classify on the CPU, started on `fleet` until the
    block ends, then stopped (stop_processes). Yields their logs, "celery" and "provisioner", named with
    `tag` (as is beat's schedule file) so that the tests of one fleet each read their own."""
    env = {
        **fleet.server.env,
        "SWITCHYARD_AUTOSCALER_INTERVAL_S": "0.5",
        "SWITCHYARD_AUTOSCALER_IDLE_BEFORE_ZERO_S": "5",
    }
    logs = {name: fleet.state / f"{name}-{tag}.log" for name in ("celery", "provisioner")}
    commands = {
        "celery": [
            *(sys.executable, "-m", "celery", "-A", "config", "worker", "--beat", "--pool", "solo"),
            *("--schedule", str(fleet.state / f"beat-schedule-{tag}"), "--loglevel", "INFO"),
        ],
        "provisioner": [
            *(sys.executable, "manage.py", "run_provisioner", "--model", "demo-classify"),
            *("--devices", "cpu", "--interval", "0.5"),
        ],
    }
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for name, command in commands.items():
            with logs[name].open("wb") as log:  # the child keeps its own descriptor
                processes.append(
                    subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        yield logs
    finally:
        stop_processes(processes)
