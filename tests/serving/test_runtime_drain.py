"""A version taken out of the routing table keeps its replica admitting until every gateway has seen
the edit, then drains: a rollback must not turn the requests routed in that gap into 503s."""

from __future__ import annotations

import asyncio

from channels.layers import InMemoryChannelLayer

from serving import runtime as runtime_module
from serving.replica import ReplicaState
from serving.runtime import DRAIN_GRACE_S, Runtime


class FakeReplica:
    replica_id = "r-v2"

    def __init__(self) -> None:
        self.state = ReplicaState.READY
        self.stopped = asyncio.Event()

    def drain(self) -> None:
        self.state = ReplicaState.DRAINING

    async def wait_idle(self) -> None:
        return None

    async def stop(self) -> None:
        self.state = ReplicaState.STOPPED
        self.stopped.set()


async def test_an_unrouted_version_keeps_admitting_for_the_grace_period_then_drains(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(runtime_module.time, "monotonic", lambda: clock[0])
    runtime = Runtime(InMemoryChannelLayer())
    replica = FakeReplica()
    runtime.replicas[("demo-chat", "v2")] = replica  # type: ignore[assignment]

    await runtime._reconcile([])  # the edit: v2 has no traffic any more
    clock[0] += DRAIN_GRACE_S * 0.9
    await runtime._reconcile([])
    assert replica.state is ReplicaState.READY  # a gateway with the old table may still route here
    assert ("demo-chat", "v2") in runtime.replicas

    clock[0] += DRAIN_GRACE_S * 0.2
    await runtime._reconcile([])
    assert replica.state is ReplicaState.DRAINING
    assert ("demo-chat", "v2") not in runtime.replicas
    await asyncio.wait_for(replica.stopped.wait(), timeout=5)


async def test_a_version_routed_again_within_the_grace_period_is_never_drained(monkeypatch) -> None:
    from registry.selectors import VersionRef

    clock = [1000.0]
    monkeypatch.setattr(runtime_module.time, "monotonic", lambda: clock[0])
    runtime = Runtime(InMemoryChannelLayer())
    replica = FakeReplica()
    runtime.replicas[("demo-chat", "v2")] = replica  # type: ignore[assignment]
    ref = VersionRef("demo-chat", "v2", version_id=2, artifact_uri="unused", sha256="unused", files={})

    await runtime._reconcile([])
    clock[0] += DRAIN_GRACE_S * 0.5
    await runtime._reconcile([ref])  # traffic back (a quick promote after a mistaken rollback)
    clock[0] += DRAIN_GRACE_S * 0.6
    await runtime._reconcile([])  # out again: the grace period starts over
    assert replica.state is ReplicaState.READY
