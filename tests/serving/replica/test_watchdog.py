"""The step watchdog (serving/replica/watchdog.py): a step that hangs without raising fails the replica
within the deadline, ends the requests it held with a terminal error a gateway retries elsewhere, and
then run_replica exits non-zero for its supervisor, and the embedded supervisor replaces it."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.layers import InMemoryChannelLayer

from serving.replica.replica import Replica
from serving.transport.protocol import REPLICA_UNAVAILABLE, ReplicaState
from tests.serving.replica.test_replica_failures import FakePublisher, WatchedReplies, _replica
from tests.serving.replica.test_replica_pipeline import _submit

pytestmark = pytest.mark.django_db(transaction=True)

DEADLINE_S = 0.5


def _hang_from_the_second_step(replica: Replica) -> threading.Event:
    """The engine's steps hang from the second on, until the returned event is set."""
    engine, release, calls = replica.engine, threading.Event(), [0]
    real_step = engine.step

    def step() -> Any:
        calls[0] += 1
        if calls[0] >= 2:
            release.wait(30)
        return real_step()

    engine.step = step
    return release


async def test_a_hung_step_fails_the_replica_and_ends_its_requests_within_the_deadline(
    registered_model, settings
) -> None:
    settings.REPLICA_STEP_WATCHDOG_S = DEADLINE_S
    layer, replies, publisher = InMemoryChannelLayer(), WatchedReplies(), FakePublisher()
    replica = await _replica(layer, replies, publisher=publisher)
    release = _hang_from_the_second_step(replica)
    try:
        started = time.monotonic()
        await _submit(layer, replica, "r1", max_tokens=20)
        events = await asyncio.wait_for(replies.ended("r1"), timeout=DEADLINE_S + 5)
        assert events[-1]["error"]["type"] == REPLICA_UNAVAILABLE  # a gateway retries it elsewhere
        assert time.monotonic() - started < DEADLINE_S + 2  # the watchdog looks every deadline/4
        await asyncio.wait_for(replica.wait_failed(), timeout=1)
        assert replica.state is ReplicaState.FAILED and replica.is_hung
        assert "watchdog" in (replica.error or "")
        assert replica.heartbeat().state == "failed"
        await asyncio.wait_for(replica.wait_idle(), timeout=1)  # a drain would not wait for the thread
        await asyncio.wait_for(replica.stop(), timeout=10)  # nor does the stop
    finally:
        release.set()
    await asyncio.wait_for(replica.wait_engine_ended(), timeout=10)  # its step came back, and then
    assert [e for e in replies.events("r1") if "finish_reason" in e] == [events[-1]]  # it said nothing


async def test_run_replica_exits_non_zero_when_a_step_hangs(registered_model, settings) -> None:
    from registry.selectors import version_ref
    from serving.management.commands.run_replica import Command

    settings.REPLICA_STEP_WATCHDOG_S = DEADLINE_S
    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v1")
    layer = InMemoryChannelLayer()
    replica = Replica(ref, layer=layer, replies=WatchedReplies(), publisher=FakePublisher(), torch_threads=1)
    err = io.StringIO()
    command = Command(stdout=io.StringIO(), stderr=err)
    running = asyncio.ensure_future(command._run(replica, asyncio.Event()))
    await asyncio.wait_for(replica.wait_loaded(), timeout=60)
    release = _hang_from_the_second_step(replica)
    try:
        await _submit(layer, replica, "r1", max_tokens=20)
        assert await asyncio.wait_for(running, timeout=DEADLINE_S + 5) == 1
        assert "watchdog" in err.getvalue()
    finally:
        release.set()
        await asyncio.wait_for(replica.stop(), timeout=10)


async def test_the_embedded_supervisor_replaces_a_hung_replica(registered_model, settings) -> None:
    from registry.selectors import version_ref
    from serving.replica.supervisor import ReplicaSupervisor
    from serving.transport.reply_hub import ReplyHub

    settings.REPLICA_STEP_WATCHDOG_S = DEADLINE_S
    layer = InMemoryChannelLayer()
    supervisor = ReplicaSupervisor(layer=layer, replies=layer, hub=ReplyHub(layer), drain_grace_s=0)
    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v1")
    await supervisor.reconcile([ref])
    (hung,) = supervisor.replicas.values()
    assert await asyncio.wait_for(hung.wait_loaded(), timeout=60)
    release = _hang_from_the_second_step(hung)
    try:
        await _submit(layer, hung, "r1", max_tokens=20, reply_to="switchyard.inbox.watchdog-test")
        await asyncio.wait_for(hung.wait_failed(), timeout=DEADLINE_S + 5)
        await supervisor.reconcile([ref])
        (replacement,) = supervisor.replicas.values()
        assert replacement is not hung
        assert await asyncio.wait_for(replacement.wait_loaded(), timeout=60)
    finally:
        release.set()
        for replica in [*supervisor.replicas.values(), *supervisor.draining.values()]:
            await asyncio.wait_for(replica.stop(), timeout=10)
