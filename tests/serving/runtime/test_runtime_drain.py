"""A version taken out of the routing table keeps its replica admitting until every gateway has seen
the edit, and while it is still used (REPLICA_KEEP_WARM_S), then drains: a rollback must not turn the
requests routed in that gap into 503s, and undoing a promotion is a routing edit, not a reload."""

from __future__ import annotations

import asyncio
import types

from channels.layers import InMemoryChannelLayer

from serving import runtime as runtime_module
from serving.replica.replica import Replica
from serving.runtime import DRAIN_GRACE_S, Runtime
from serving.transport.protocol import ReplicaState


class FakeReplica:
    replica_id = "r-v2"
    is_hung = False

    def __init__(self, idle_s: float = 1e9) -> None:
        self.state = ReplicaState.READY
        self.stopped = asyncio.Event()
        self.idle_s = idle_s  # since its last request

    def heartbeat(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(idle_s=self.idle_s)

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

    await runtime.supervisor.reconcile([])  # the edit: v2 has no traffic any more
    clock[0] += DRAIN_GRACE_S * 0.9
    await runtime.supervisor.reconcile([])
    assert replica.state is ReplicaState.READY  # a gateway with the old table may still route here
    assert ("demo-chat", "v2") in runtime.replicas

    clock[0] += DRAIN_GRACE_S * 0.2
    await runtime.supervisor.reconcile([])
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

    await runtime.supervisor.reconcile([])
    clock[0] += DRAIN_GRACE_S * 0.5
    await runtime.supervisor.reconcile([ref])  # traffic back (a quick promote after a mistaken rollback)
    clock[0] += DRAIN_GRACE_S * 0.6
    await runtime.supervisor.reconcile([])  # out again: the grace period starts over
    assert replica.state is ReplicaState.READY


async def test_the_runtimes_stop_stops_its_replicas_together_and_past_one_that_fails() -> None:
    """Each replica's stop waits out its step and a flush of up to 5 s: one after another they added up;
    and one that raised left the rest running."""

    class SlowReplica(FakeReplica):
        def __init__(self, replica_id: str, gate: asyncio.Event) -> None:
            super().__init__()
            self.replica_id, self.gate = replica_id, gate

        async def stop(self) -> None:
            self.stopped.set()
            await self.gate.wait()  # its flush: done only once every replica has begun to stop

    class FailingReplica(FakeReplica):
        replica_id = "r-broken"

        async def stop(self) -> None:
            raise RuntimeError("a bug in its stop")

    gate = asyncio.Event()
    runtime = Runtime(InMemoryChannelLayer())
    slow = [SlowReplica(f"r-{i}", gate) for i in range(2)]
    runtime.replicas[("m", "broken")] = FailingReplica()  # type: ignore[assignment]
    for i, replica in enumerate(slow):
        runtime.replicas[("m", f"v{i}")] = replica  # type: ignore[assignment]

    async def open_when_all_stopping() -> None:
        await asyncio.gather(*(replica.stopped.wait() for replica in slow))
        gate.set()

    opener = asyncio.ensure_future(open_when_all_stopping())
    await asyncio.wait_for(runtime.stop(), timeout=10)  # one after another, the first would wait for ever
    await opener
    assert runtime.replicas == {}


async def test_an_unrouted_version_still_used_stays_warm_until_it_has_idled_for_the_keep_warm_time(
    monkeypatch, settings
) -> None:  # type: ignore[no-untyped-def]
    clock = [1000.0]
    monkeypatch.setattr(runtime_module.time, "monotonic", lambda: clock[0])
    settings.REPLICA_KEEP_WARM_S = 300
    runtime = Runtime(InMemoryChannelLayer())
    replica = FakeReplica(idle_s=10)  # promoted away from 10 s ago; pinned requests may still come
    runtime.replicas[("demo-chat", "v1")] = replica  # type: ignore[assignment]
    await runtime.supervisor.reconcile([])
    clock[0] += DRAIN_GRACE_S * 2
    replica.idle_s = 250
    await runtime.supervisor.reconcile([])
    assert replica.state is ReplicaState.READY  # set_traffic v1=100 now is a routing edit, not a load
    replica.idle_s = 301
    await runtime.supervisor.reconcile([])
    assert replica.state is ReplicaState.DRAINING
    await asyncio.wait_for(replica.stopped.wait(), timeout=5)


async def test_a_pinned_version_without_traffic_gets_a_replica_on_demand(monkeypatch) -> None:
    from registry.selectors import VersionRef

    started: list[str] = []
    monkeypatch.setattr(Replica, "start", _recording(started))  # no model to load: the start is what counts
    runtime = Runtime(InMemoryChannelLayer())
    ref = VersionRef("demo-chat", "v2", version_id=2, artifact_uri="unused", sha256="unused", files={})
    assert not runtime.supervisor.is_demanded("demo-chat", "v2")
    assert runtime.supervisor.demand(ref)
    assert runtime.supervisor.is_demanded("demo-chat", "v2")
    await runtime.supervisor.reconcile([])  # no traffic: started all the same, for the pin
    await asyncio.sleep(0)
    assert ("demo-chat", "v2") in runtime.replicas and started == ["v2"]
    assert runtime.supervisor.is_demanded("demo-chat", "v2")  # kept, by the keep-warm rule, while used
    # Bounded: REPLICA_MAX_PINNED (2) versions without traffic at once; a third pin is refused.
    v3, v4 = (
        VersionRef("demo-chat", v, version_id=i, artifact_uri="unused", sha256="unused", files={})
        for i, v in ((3, "v3"), (4, "v4"))
    )
    assert runtime.supervisor.demand(v3) and not runtime.supervisor.demand(v4)


def _recording(started: list[str]):  # type: ignore[no-untyped-def]
    async def start(self) -> None:  # type: ignore[no-untyped-def]
        started.append(self.ref.version)

    return start
