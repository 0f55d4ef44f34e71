"""The judge as a Celery task: registration, beat schedule, the embedded scheduler, a real worker."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from celery.schedules import crontab, schedule
from django.conf import settings

from config import periodic as scheduler
from rollouts import judge_tick, services
from rollouts.models import Deployment
from tests.conftest import REPO_ROOT, require_service

JUDGE_TASK = "rollouts.tasks.rollout_judge_tick"


def test_the_beat_schedule_runs_the_judge_every_5_seconds() -> None:
    entries = [e for e in settings.CELERY_BEAT_SCHEDULE.values() if e["task"] == JUDGE_TASK]
    assert len(entries) == 1
    assert scheduler.interval_seconds(entries[0]["schedule"]) == 5.0


def test_the_judge_is_a_registered_celery_task() -> None:
    from config.celery import app

    app.loader.import_default_modules()  # what a worker does at start (autodiscovery)
    assert JUDGE_TASK in app.tasks
    assert scheduler.resolve_task(JUDGE_TASK) is app.tasks[JUDGE_TASK]


def test_schedule_forms_the_embedded_scheduler_understands() -> None:
    assert scheduler.interval_seconds(2) == 2.0
    assert scheduler.interval_seconds(dt.timedelta(milliseconds=250)) == 0.25
    assert scheduler.interval_seconds(schedule(run_every=dt.timedelta(seconds=7))) == 7.0
    with pytest.raises(ValueError, match="fixed intervals"):
        scheduler.interval_seconds(crontab(minute="*/5"))
    with pytest.raises(ValueError, match="positive"):
        scheduler.interval_seconds(0)


@pytest.mark.django_db
def test_a_tick_judges_every_deployment_in_flight_and_survives_one_failing(
    make_model, fake_metrics, monkeypatch
) -> None:
    from rollouts.tasks import rollout_judge_tick

    first = services.deployment_create(model=make_model("alpha"), version="v2", created_by="t")
    second = services.deployment_create(model=make_model("beta"), version="v2", created_by="t")
    real_judge = judge_tick.deployment_judge

    def judge_or_fail(*, deployment, **kwargs):  # type: ignore[no-untyped-def]
        if deployment.pk == first.pk:
            raise RuntimeError("boom")
        return real_judge(deployment=deployment, **kwargs)

    monkeypatch.setattr(judge_tick, "deployment_judge", judge_or_fail)
    assert rollout_judge_tick() == 1
    assert Deployment.objects.get(pk=second.pk).state == "ramping"
    assert Deployment.objects.get(pk=first.pk).state == "provisioning"


@pytest.mark.django_db(transaction=True)
async def test_the_embedded_scheduler_runs_the_judge_task_on_its_schedule(make_model, fake_metrics) -> None:
    from asgiref.sync import sync_to_async

    @sync_to_async(thread_sensitive=False)
    def setup() -> int:
        return services.deployment_create(model=make_model(), version="v2", created_by="t").pk

    @sync_to_async(thread_sensitive=False)
    def state(pk: int) -> str | None:
        from django.db import OperationalError

        try:
            return Deployment.objects.get(pk=pk).state
        except OperationalError:  # the test database is shared-cache in-memory SQLite: table locks
            return None

    deployment_id = await setup()
    beat = asyncio.create_task(
        scheduler.run_periodic_tasks(
            {
                "judge": {"task": JUDGE_TASK, "schedule": 0.1},
                "nothing": {"task": "no.such.task", "schedule": 0.1},
            }
        )
    )
    try:
        deadline = time.monotonic() + 5
        while await state(deployment_id) != "ramping":
            assert time.monotonic() < deadline, "the scheduler never ran the judge"
            assert not beat.done(), beat
            await asyncio.sleep(0.05)
    finally:
        beat.cancel()
        with pytest.raises(asyncio.CancelledError):
            await beat


async def test_the_embedded_scheduler_starts_once_and_never_alongside_celery(settings, monkeypatch) -> None:
    started = []

    async def fake_run(schedule):  # type: ignore[no-untyped-def]
        started.append(schedule)
        await asyncio.sleep(3600)

    monkeypatch.setattr(scheduler, "run_periodic_tasks", fake_run)
    monkeypatch.setattr(scheduler, "_embedded", None)
    settings.REDIS_URL = "redis://127.0.0.1:6379/0"
    assert scheduler.start_embedded_scheduler() is None
    settings.REDIS_URL = None
    first = scheduler.start_embedded_scheduler()
    assert first is not None
    assert scheduler.start_embedded_scheduler() is first
    await asyncio.sleep(0)
    assert started == [settings.CELERY_BEAT_SCHEDULE]
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


@pytest.mark.redis
def test_one_tick_through_a_real_celery_worker_on_redis(tmp_path: Path) -> None:
    """The task goes through Redis (.apply_async) to `celery -A config worker`, which writes the
    transition to a SQLite file both processes share (the test database is in memory)."""
    require_service("Redis", "127.0.0.1", 6379)
    broker = "redis://127.0.0.1:6379/13"
    queue = f"test-judge-{uuid.uuid4().hex[:8]}"
    database = tmp_path / "worker.sqlite3"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DATABASE_URL": f"sqlite:///{database}",
        "REDIS_URL": broker,
        "ARTIFACT_ROOT": str(tmp_path / "artifacts"),
    }
    env.pop("CI", None)  # nothing in the subprocesses depends on it

    def run(code: str) -> str:
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v0"],
        cwd=REPO_ROOT,
        env=env,
        check=True,
        timeout=60,
    )
    deployment_id = int(
        run(f"""
        import django; django.setup()
        import config.celery  # the app shared tasks bind to, as in any process that sends tasks
        from registry.models import Model, ModelVersion, RoutingEntry, RoutingTable
        from registry.services import alias_set
        from rollouts.services import deployment_create
        from rollouts.tasks import rollout_judge_tick
        model = Model.objects.create(name="chat")
        table = RoutingTable.objects.create(model=model)
        for i, v in enumerate(["v1", "v2"]):
            mv = ModelVersion.objects.create(model=model, version=v, artifact_uri="/x", sha256="0" * 64,
                                             size_bytes=0, files={{}})
            RoutingEntry.objects.create(table=table, version=mv, weight=100 - 100 * i)
        alias_set(model=model, name="stable", version=ModelVersion.objects.get(version="v1"), actor="t")
        deployment = deployment_create(model=model, version="v2", created_by="t")
        rollout_judge_tick.apply_async(queue={queue!r})
        print(deployment.pk)
    """).strip()
    )

    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "--pool",
            "solo",
            "-Q",
            queue,
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "info",
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    import json

    import redis

    from serving.transport.replica_directory import version_key

    beats = redis.Redis.from_url(broker)
    try:
        deadline = time.monotonic() + 45
        row = None
        while row is None and time.monotonic() < deadline and worker.poll() is None:
            # With REDIS_URL the candidate is ready only when a replica process says so: beat as one.
            beat = {"replica_id": "r-v2", "model_name": "chat", "version": "v2", "state": "ready"}
            beat |= {"channel_name": "switchyard.replica.chat.v2.x", "num_waiting": 0, "num_running": 0}
            beat |= {"kv_cache_usage": 0.0, "sent_at": time.time()}
            beats.hset(version_key("chat", "v2"), "r-v2", json.dumps(beat))
            time.sleep(0.25)
            with sqlite3.connect(database) as conn:
                row = conn.execute(
                    "SELECT from_state, to_state, actor FROM rollouts_deploymentevent "
                    "WHERE deployment_id = ? AND to_state = 'ramping'",
                    (deployment_id,),
                ).fetchone()
    finally:
        worker.terminate()
        output = worker.communicate(timeout=20)[0]
        beats.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
        beats.delete(version_key("chat", "v2"))
        beats.close()
    assert row == ("provisioning", "ramping", "rollout-judge"), output[-3000:]
    assert JUDGE_TASK in output  # the worker listed it among its tasks and ran it
