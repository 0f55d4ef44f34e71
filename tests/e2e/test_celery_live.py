"""Production's background work for real: `celery -A config beat` sends the rollout judge's and the
autoscaler's ticks through Redis to `celery -A config worker`, which writes their results to the database.

The two processes share a SQLite file with the test (the test database is in memory) and a Redis database
of their own. The test plays the replicas: it publishes their heartbeats to Redis as `run_replica` does
(serving/transport/replica_directory.py), a ready candidate and an incumbent with a queue, and waits for
the judge to finish provisioning the canary and for the autoscaler to ask for more incumbent replicas.

Beat and the embedded scheduler (config/periodic.py, the server's own when there is no Redis) must run one
schedule, settings.CELERY_BEAT_SCHEDULE: the first test here fails if they ever read different ones."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, require_service

REDIS_URL = "redis://127.0.0.1:6379/11"  # its own: 13 is tests/rollouts/test_tasks.py's, 14 the fleet's
TICK_S = "0.5"  # both ticks' period here (SWITCHYARD_*_INTERVAL_S; 5 s by default)
DEADLINE_S = 30.0  # from the processes' start; the ticks land within seconds once both are up

SETUP = """
from django.core.management import call_command
call_command("migrate", interactive=False, verbosity=0)
from registry.models import Model, ModelVersion, RoutingEntry, RoutingTable
from registry.services import alias_set
from rollouts.services import deployment_create
model = Model.objects.create(name="chat")
table = RoutingTable.objects.create(model=model)
for weight, version in ((100, "v1"), (0, "v2")):
    row = ModelVersion.objects.create(
        model=model, version=version, artifact_uri="/x", sha256="0" * 64, size_bytes=0, files={}
    )
    RoutingEntry.objects.create(table=table, version=row, weight=weight)
alias_set(model=model, name="stable", version=ModelVersion.objects.get(version="v1"), actor="test")
print(deployment_create(model=model, version="v2", created_by="test").pk)
"""


def test_celery_beat_and_the_embedded_scheduler_run_one_schedule() -> None:
    """What `celery beat` schedules (its Scheduler, built from the app's configuration as the command
    builds it) is what the embedded scheduler parses from settings.CELERY_BEAT_SCHEDULE, the mapping
    start_embedded_scheduler hands it (tests/rollouts/test_tasks.py checks that hand-over)."""
    from celery.beat import Scheduler
    from django.conf import settings

    from config.celery import app
    from config.periodic import interval_seconds, parse_schedule

    beat = Scheduler(app, lazy=False)
    beat_entries = {
        name: (entry.task, interval_seconds(entry.schedule))
        for name, entry in beat.schedule.items()
        if name != "celery.backend_cleanup"  # Celery's own, only with a result backend that expires
    }
    embedded = {e.name: (e.task_name, e.interval_s) for e in parse_schedule(settings.CELERY_BEAT_SCHEDULE)}
    assert beat_entries == embedded
    assert {task for task, _ in embedded.values()} >= {
        "rollouts.tasks.rollout_judge_tick",
        "rollouts.tasks.autoscaler_tick",
    }


@dataclass
class CeleryProcesses:
    database: Path
    deployment_id: int
    logs: dict[str, Path]
    processes: dict[str, subprocess.Popen[bytes]]

    def check_running(self) -> None:
        for name, process in self.processes.items():
            assert process.poll() is None, f"celery {name} exited {process.returncode}\n{self.log_tails()}"

    def log_tails(self) -> str:
        return "\n".join(
            f"--- celery {name} ---\n{path.read_text(errors='replace')[-3000:]}"
            for name, path in self.logs.items()
        )

    def query(self, sql: str, *params: object) -> list[tuple[object, ...]]:
        with sqlite3.connect(self.database, timeout=5) as connection:
            return connection.execute(sql, params).fetchall()


@pytest.fixture
def celery_processes(tmp_path: Path) -> Iterator[CeleryProcesses]:
    """A migrated SQLite file holding model chat (v1 at 100%, v2 at 0%) and a canary deployment of v2
    still provisioning, then a worker and beat on it; both are stopped (killed if need be) at the end."""
    require_service("Redis", "127.0.0.1", 6379)
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()  # its own database: what an earlier run left
    database = tmp_path / "switchyard.sqlite3"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "SWITCHYARD_STATE_DIR": str(tmp_path),
        "DATABASE_URL": f"sqlite:///{database}",
        "REDIS_URL": REDIS_URL,
        "ARTIFACT_ROOT": str(tmp_path / "artifacts"),
        "SWITCHYARD_ROLLOUT_JUDGE_INTERVAL_S": TICK_S,
        "SWITCHYARD_AUTOSCALER_INTERVAL_S": TICK_S,
    }
    env.pop("SECRET_KEY", None)
    setup = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", textwrap.dedent(SETUP)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert setup.returncode == 0, setup.stderr
    deployment_id = int(setup.stdout.strip().splitlines()[-1])

    commands = {
        # solo: one task at a time in the worker's own process, as small deployments run it
        "worker": ["worker", "--pool", "solo", "--without-heartbeat", "--without-gossip", "--without-mingle"],
        # its schedule file in the test's directory, not the repository's working directory
        "beat": ["beat", "--schedule", str(tmp_path / "celerybeat-schedule")],
    }
    logs = {name: tmp_path / f"celery-{name}.log" for name in commands}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, args in commands.items():
            with logs[name].open("wb") as log:  # the child keeps its own descriptor
                processes[name] = subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "config", *args, "--loglevel", "info"],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        yield CeleryProcesses(database, deployment_id, logs, processes)
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        client.flushdb()
        client.close()


def _publish_heartbeats() -> None:
    """The beats two `run_replica` processes would publish, stamped with Redis's clock by the replicas'
    own script: the candidate v2 ready and idle, the incumbent v1 ready with 6 requests waiting."""
    import redis

    from serving.transport.replica_directory import PUBLISH_BEAT_SCRIPT, Heartbeat, version_key

    client = redis.Redis.from_url(REDIS_URL)
    try:
        for version, num_waiting in (("v1", 6), ("v2", 0)):
            beat = Heartbeat(
                replica_id=f"replica-{version}",
                model_name="chat",
                version=version,
                channel_name=f"switchyard.replica.chat.{version}.test",
                state="ready",
                num_waiting=num_waiting,
                num_running=0,
                kv_cache_usage=0.0,
                sent_at=0.0,  # the script writes Redis's TIME
                capacity=64,
            )
            key = version_key("chat", version)
            client.eval(PUBLISH_BEAT_SCRIPT, 1, key, beat.replica_id, json.dumps(asdict(beat)))
    finally:
        client.close()


@pytest.mark.redis
@pytest.mark.live_server_process
def test_beat_drives_the_judge_and_the_autoscaler_through_a_worker(celery_processes: CeleryProcesses) -> None:
    deadline = time.monotonic() + DEADLINE_S
    judged: list[tuple[object, ...]] = []
    targets: dict[str, tuple[object, ...]] = {}
    while not (judged and targets.get("v1", (0,))[0] == 3):
        assert time.monotonic() < deadline, (
            f"judged {judged}, targets {targets}, after {DEADLINE_S:g} s\n{celery_processes.log_tails()}"
        )
        celery_processes.check_running()
        _publish_heartbeats()  # kept fresh: both ticks ignore beats older than a few seconds
        judged = celery_processes.query(
            "SELECT from_state, to_state, actor FROM rollouts_deploymentevent "
            "WHERE deployment_id = ? AND to_state = 'ramping'",
            celery_processes.deployment_id,
        )
        rows = celery_processes.query(
            "SELECT v.version, t.replicas, t.reason FROM rollouts_scaletarget t "
            "JOIN registry_modelversion v ON v.id = t.version_id"
        )
        targets = {str(version): (replicas, reason) for version, replicas, reason in rows}
        time.sleep(0.2)  # another process writes these rows: there is nothing to await but a poll

    # The judge saw the candidate's ready heartbeat and moved the canary on to its first step.
    assert judged == [("provisioning", "ramping", "rollout-judge")]
    (state,) = celery_processes.query(
        "SELECT state FROM rollouts_deployment WHERE id = ?", celery_processes.deployment_id
    )
    assert state == ("ramping",)
    # The autoscaler read the incumbent's queue (6 waiting, 2 a replica) and asked for 3 replicas.
    assert str(targets["v1"][1]).startswith("queue depth 6"), targets
    beat_log = celery_processes.logs["beat"].read_text(errors="replace")
    assert "Sending due task rollout-judge (rollouts.tasks.rollout_judge_tick)" in beat_log
    assert "Sending due task autoscaler (rollouts.tasks.autoscaler_tick)" in beat_log
