"""Whole rollouts with real in-process replicas and load, as the embedded mode runs them; and the default
readiness hook (rollouts.services.candidate_is_ready) against each source it reads.

The rollouts run as `demo_rollout` does (serving.gateway.dispatch for load, replicas flushing to the metrics
store, the judge's Celery task called on its schedule), with a small model, tiny min_samples, a 2 s
bake window and a 0.5 s judge period, so each takes seconds."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError, close_old_connections

from registry.models import AliasEvent, Model
from registry.selectors import TenantContext, routing_snapshot
from registry.services import model_version_register
from rollouts import judge_tick, services
from rollouts.models import Deployment
from rollouts.tasks import rollout_judge_tick
from tests.rollouts.conftest import routing_state

State = Deployment.State
T = TypeVar("T")
MODEL = "demo-chat"
JUDGE_INTERVAL_S = 0.5
BAKE_S = 2
STEP_DELAY_MS = 150.0  # the slow candidate's injected delay per engine step
TPOT_SLA_MS = 50.0  # above a healthy TPOT of this small model, below the slow one's
ROLLOUT_TIMEOUT_S = 25.0
LOAD_CONTEXT = TenantContext.unlimited("load")
PROMPTS = ["Once upon a time", "The quick brown fox", "Hello, world!", "A request arrives"]


# --- the whole rollout --------------------------------------------------------------------------------


@dataclass
class Load:
    """Closed-loop clients through the same dispatch path as the HTTP views. A request refused before
    it reached a replica (503: the version it was routed to has no ready replica, as when a replica
    drains before every gateway has revalidated its routing table) is counted and retried."""

    num_by_version: Counter[str] = field(default_factory=Counter)
    num_errors: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    last_routed_at: dict[str, float] = field(default_factory=dict)  # version -> wall time it arrived
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    is_stopping: bool = False
    _routed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def start(self, num_clients: int, *, max_tokens: int) -> None:
        self.tasks = [asyncio.create_task(self._client(i, max_tokens)) for i in range(num_clients)]

    async def wait_routed(self, version: str, *, after: float, timeout_s: float) -> None:
        """Until a request that arrived after `after` (wall time) has been routed to `version`."""
        async with asyncio.timeout(timeout_s), self._routed:
            await self._routed.wait_for(lambda: self.last_routed_at.get(version, 0.0) > after)

    async def stop(self) -> None:
        """Stop every client. Cancelling alone can hang: on Python 3.11 asyncio.wait_for (dispatch's
        wait for the next event) can swallow a cancellation that lands as its inner get completes, and
        the client goes on. So clients also check a flag, and the cancel is repeated until all end."""
        self.is_stopping = True
        while pending := [task for task in self.tasks if not task.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=1.0)
        failures = [t.exception() for t in self.tasks if not t.cancelled() and t.exception() is not None]
        assert not failures, failures  # a client that died would silently thin the load

    async def _routed_to(self, version: str, arrived: float) -> None:
        async with self._routed:
            self.last_routed_at[version] = max(arrived, self.last_routed_at.get(version, 0.0))
            self._routed.notify_all()

    async def _client(self, index: int, max_tokens: int) -> None:
        from serving.gateway.dispatch import dispatch
        from serving.gateway.errors import GatewayError

        rng = random.Random(index)
        params = {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}
        while not self.is_stopping:
            arrived = time.time()
            try:
                handle = await dispatch(
                    context=LOAD_CONTEXT, path_model=MODEL, pin=None, params=params, text=rng.choice(PROMPTS)
                )
            except GatewayError as exc:
                if exc.status != 503:
                    raise
                self.refusals[exc.message] += 1
                # "no ready replica for demo-chat:v3": it was routed to v3
                await self._routed_to(exc.message.rpartition(f"{MODEL}:")[2], arrived)
                await asyncio.sleep(0.05)  # back off, as a client does after a 503
                continue
            self.num_by_version[handle.version] += 1
            await self._routed_to(handle.version, arrived)
            try:
                async for event in handle.events():
                    if event.get("finish_reason") == "error":
                        self.num_errors += 1
            finally:
                await handle.close()


@pytest.fixture
def embedded_platform(transactional_db: None, demo_model_dir: Path, settings: Any) -> Iterator[Model]:
    """demo-chat v1 (stable), v2 (the same weights) and v3 (the same weights, a slow engine step);
    replicas in this process with one torch thread (on 2 cores the loop and torch compete otherwise)."""
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    settings.REDIS_URL = None
    settings.EMBEDDED_REPLICAS = True
    settings.REPLICA_TORCH_THREADS = 1
    settings.REPLICA_SYNC_INTERVAL_S = 0.2
    settings.METRICS_FLUSH_INTERVAL_S = 0.2
    settings.ROLLOUT_JUDGE_INTERVAL_S = JUDGE_INTERVAL_S  # the judge's count of looks per bake window
    settings.ALLOW_FAULT_INJECTION = True
    settings.FAULTS = f"{MODEL}:v3=delay_ms:{STEP_DELAY_MS:g}"
    assert settings.ROLLOUT_READINESS_CHECK == "rollouts.services.candidate_is_ready"
    v1 = model_version_register(name=MODEL, version="v1", source_dir=demo_model_dir, created_by="test")
    for version in ("v2", "v3"):
        model_version_register(
            name=MODEL, version=version, source_dir=demo_model_dir, created_by="test", parent=v1
        )
    yield Model.objects.get(name=MODEL)
    torch.set_num_threads(threads_before)


def _retrying_locked(fn: Callable[..., T], *args: Any) -> T:
    """Call fn, again while SQLite says a table is locked. The test database is in-memory SQLite with a
    shared cache, where a reader meets a writer's table lock at once (no busy timeout), and this test
    has replicas flushing metrics, the supervisor and the router reading, and the judge writing, all on
    their own threads. (The platform's own paths survive it: a failed flush, sync or judge tick is
    retried on the next one, a failed routing read keeps the last table.) Each try is one transaction,
    rolled back whole when it fails."""
    for attempt in itertools.count():
        try:
            return fn(*args)
        except OperationalError as exc:
            if "locked" not in str(exc) or attempt >= 50:
                raise
            close_old_connections()
            time.sleep(0.02)
    raise AssertionError("unreachable")


def _create_and_tick(model: Model, version: str) -> tuple[int, bool, str]:
    """Create the deployment and run one judge tick at once, before this test's loop can let the
    supervisor load the candidate: (id, what the readiness hook said, the state after the tick)."""
    deployment = _retrying_locked(
        lambda: services.deployment_create(
            model=model,
            version=version,
            created_by="test",
            steps=[{"pct": 50}, {"pct": 100}],
            bake_seconds=BAKE_S,
            thresholds={"min_samples": 10, "tpot_sla_ms": TPOT_SLA_MS},
        )
    )
    is_ready = services.candidate_is_ready(deployment)
    _retrying_locked(rollout_judge_tick)  # its lease is a write (rollouts/judge_lease.py)
    return deployment.pk, is_ready, _retrying_locked(_deployment, deployment.pk).state


def _deployment(deployment_id: int) -> Deployment:
    return Deployment.objects.select_related("candidate", "incumbent").get(pk=deployment_id)


@contextlib.asynccontextmanager
async def running_platform() -> AsyncIterator[tuple[Any, Load]]:
    """This loop's runtime with its replicas loaded, and 8 clients of 8 tokens each."""
    from serving.runtime import get_runtime

    runtime = await get_runtime()
    assert await runtime.wait_ready()
    load = Load()
    load.start(8, max_tokens=8)
    try:
        yield runtime, load
    finally:
        await load.stop()


async def _run_rollout(runtime: Any, model: Model, version: str) -> tuple[Deployment, list[Any]]:
    """Deploy `version` and run the judge every JUDGE_INTERVAL_S until the deployment ends; returns it
    with its events."""
    deployment_id, was_ready, state = await sync_to_async(_create_and_tick)(model, version)
    # Provisioning waits for the candidate's replica: none of it was ready yet.
    assert (was_ready, state) == (False, State.PROVISIONING)
    deadline = time.monotonic() + ROLLOUT_TIMEOUT_S
    replica_was_ready_at_ramp = None
    while True:
        await asyncio.sleep(JUDGE_INTERVAL_S)  # the judge's period, as the beat schedule runs it
        await sync_to_async(_retrying_locked)(rollout_judge_tick)
        deployment = await sync_to_async(_retrying_locked)(_deployment, deployment_id)
        if deployment.state != State.PROVISIONING and replica_was_ready_at_ramp is None:
            replica = runtime.replicas.get((MODEL, version))
            replica_was_ready_at_ramp = replica is not None and replica.is_ready
        if not deployment.is_in_flight:
            break
        assert time.monotonic() < deadline, f"deployment still {deployment.state}"
    assert replica_was_ready_at_ramp
    events = await sync_to_async(_retrying_locked)(list, deployment.events.order_by("at", "id"))
    return deployment, events


@pytest.mark.django_db(transaction=True)
async def test_a_healthy_candidate_under_load_is_promoted_by_the_judge(embedded_platform) -> None:
    async with running_platform() as (runtime, load):
        deployment, events = await _run_rollout(runtime, embedded_platform, "v2")

    assert deployment.state == State.PROMOTED, [(e.to_state, e.reason) for e in events]
    assert [(e.to_state, e.actor) for e in events][-2:] == [
        ("ramping", judge_tick.JUDGE_ACTOR),
        ("promoted", judge_tick.JUDGE_ACTOR),
    ]
    advance = events[-1].figures
    assert advance["canary"]["num_requests"] >= 10 and advance["incumbent"]["num_requests"] >= 10
    assert "healthy for the whole bake window" in events[-1].reason
    _, weights, aliases = await sync_to_async(_retrying_locked)(routing_state, embedded_platform)
    assert weights == {"v2": 100} and aliases["stable"] == "v2"
    moved = await sync_to_async(_retrying_locked)(
        lambda: AliasEvent.objects.get(alias__name="stable", to_version__version="v2")
    )
    assert (moved.actor, moved.reason) == (judge_tick.JUDGE_ACTOR, f"deployment {deployment.pk} promoted")
    assert load.num_by_version["v2"] > 0 and load.num_errors == 0  # in time: _run_rollout has a deadline


@pytest.mark.django_db(transaction=True)
async def test_a_slow_candidate_under_load_is_rolled_back_by_the_judge_naming_tpot(
    embedded_platform,
) -> None:
    async with running_platform() as (runtime, load):
        deployment, events = await _run_rollout(runtime, embedded_platform, "v3")
        decided_at = deployment.rollback_decided_at.timestamp() if deployment.rollback_decided_at else 0.0
        # Keep the load on until requests arriving a second after the decision have been routed.
        await load.wait_routed("v1", after=decided_at + 1.0, timeout_s=10)

    assert deployment.state == State.ROLLED_BACK, [(e.to_state, e.reason) for e in events]
    decision = next(e for e in events if e.to_state == "rolling_back")
    assert decision.actor == judge_tick.JUDGE_ACTOR
    assert decision.reason.startswith("judge: ") and "TPOT" in decision.reason
    assert decision.figures["canary"]["tpot_p99_ms"] >= STEP_DELAY_MS
    assert decision.figures["canary"]["tpot_p99_ms"] > decision.figures["tpot_limit_ms"] >= TPOT_SLA_MS
    _, weights, aliases = await sync_to_async(_retrying_locked)(routing_state, embedded_platform)
    assert weights == {"v1": 100}
    assert aliases == {"stable": "v1", "canary": "v1"}
    # The routing edit was obeyed: no request that arrived a second after the decision went to v3.
    assert load.num_by_version["v3"] > 0
    assert load.last_routed_at["v3"] - decided_at <= 1.0


# --- the readiness hook, source by source ---------------------------------------------------------------


@pytest.fixture
def provisioning(make_model: Any) -> Deployment:
    """chat: v1 stable, a deployment of v2 provisioning (the canary alias points at v2)."""
    return services.deployment_create(model=make_model(), version="v2", created_by="test")


@pytest.fixture
def no_redis(settings: Any, monkeypatch: Any) -> None:
    from serving import runtime

    settings.REDIS_URL = None
    settings.EMBEDDED_REPLICAS = True
    monkeypatch.setattr(runtime, "_runtimes", {})  # no runtime in this process


@contextlib.contextmanager
def hosted_replicas(
    monkeypatch: Any, replicas: dict[tuple[str, str], Any], *, loop_closed: bool = False
) -> Iterator[None]:
    """This process's runtime, as serving.runtime keeps it (one per event loop), hosting `replicas`."""
    from serving import runtime

    loop = asyncio.new_event_loop()
    if loop_closed:
        loop.close()
    monkeypatch.setattr(runtime, "_runtimes", {loop: SimpleNamespace(replicas=replicas)})
    try:
        yield
    finally:
        loop.close()


def test_without_a_runtime_or_redis_the_alias_rule_stands(provisioning, no_redis) -> None:
    assert services.candidate_is_ready(provisioning) is True
    services.deployment_rollback(deployment=provisioning, actor="test")  # parks the canary alias on v1
    assert services.candidate_is_ready(provisioning) is False


def test_embedded_the_candidate_is_ready_when_a_replica_here_is(provisioning, no_redis, monkeypatch) -> None:
    v1 = SimpleNamespace(is_ready=True)
    with hosted_replicas(monkeypatch, {("chat", "v1"): v1}):
        assert services.candidate_is_ready(provisioning) is False  # the supervisor has not started it
    with hosted_replicas(monkeypatch, {("chat", "v1"): v1, ("chat", "v2"): SimpleNamespace(is_ready=False)}):
        assert services.candidate_is_ready(provisioning) is False  # loading
    with hosted_replicas(monkeypatch, {("chat", "v1"): v1, ("chat", "v2"): SimpleNamespace(is_ready=True)}):
        assert services.candidate_is_ready(provisioning) is True
    with hosted_replicas(monkeypatch, {("chat", "v1"): v1}, loop_closed=True):
        assert services.candidate_is_ready(provisioning) is True  # a dead loop's runtime: the alias rule


def test_the_judge_keeps_provisioning_until_the_replica_is_ready(provisioning, no_redis, monkeypatch) -> None:
    loading = SimpleNamespace(is_ready=False)
    with hosted_replicas(monkeypatch, {("chat", "v2"): loading}):
        judge_tick.deployment_judge(deployment=provisioning)
        provisioning.refresh_from_db()
        assert provisioning.state == State.PROVISIONING
        assert routing_snapshot(model_name="chat").weights == {"v1": 100}
        loading.is_ready = True
        judge_tick.deployment_judge(deployment=provisioning)
        provisioning.refresh_from_db()
    assert provisioning.state == State.RAMPING
    assert routing_snapshot(model_name="chat").weights == {"v1": 99, "v2": 1}


def _beat(version: str, *, state: str = "ready", age_s: float = 0.0) -> str:
    return json.dumps(
        {
            "replica_id": f"r-{version}-{state}",
            "model_name": "chat",
            "version": version,
            "channel_name": f"switchyard.replica.chat.{version}.x",
            "state": state,
            "num_waiting": 0,
            "num_running": 0,
            "kv_cache_usage": 0.0,
            "sent_at": time.time() - age_s,
        }
    )


@pytest.mark.redis
def test_with_redis_the_candidate_is_ready_when_a_replica_process_beats_ready(
    provisioning, redis_url, settings
) -> None:
    import redis

    from serving.transport.replica_directory import version_key

    settings.REDIS_URL = redis_url
    settings.EMBEDDED_REPLICAS = False
    client = redis.Redis.from_url(redis_url)
    keys = [version_key("chat", "v1"), version_key("chat", "v2")]
    client.delete(*keys)
    try:
        # No heartbeat of this model at all: replica processes are the only replicas, so none is ready.
        assert services.candidate_is_ready(provisioning) is False
        client.hset(keys[0], "inc", _beat("v1"))
        assert services.candidate_is_ready(provisioning) is False  # the fleet serves v1, has no v2
        client.hset(keys[1], "stale", _beat("v2", age_s=30))
        client.hset(keys[1], "loading", _beat("v2", state="loading"))
        assert services.candidate_is_ready(provisioning) is False
        client.hset(keys[1], "ready", _beat("v2"))
        assert services.candidate_is_ready(provisioning) is True
        client.hset(keys[1], "ready", _beat("v2", age_s=30))  # it stopped beating
        assert services.candidate_is_ready(provisioning) is False
    finally:
        client.delete(*keys)
        client.close()


def test_with_redis_unreachable_a_fleet_candidate_is_not_ready(provisioning, settings) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings.REDIS_URL = f"redis://127.0.0.1:{port}/0"  # nothing listens there
    settings.EMBEDDED_REPLICAS = False
    assert services.candidate_is_ready(provisioning) is False  # cannot tell is not ready
    settings.EMBEDDED_REPLICAS = True  # replicas here too: no runtime in this process, the alias rule
    assert services.candidate_is_ready(provisioning) is True
