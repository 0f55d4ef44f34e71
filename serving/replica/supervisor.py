"""The embedded supervisor: in a process that hosts replicas itself (`make serve`), one replica per model
version with traffic, started when a version gets traffic, or when a request pinned to a version without
any finds no replica (demand()). A replica whose version has no traffic (it lost it, or it was started
for a pin) is drained, then stopped, once it has taken no request for REPLICA_KEEP_WARM_S: undoing a
promotion is then a routing edit, not a reload, and a pinned version stays up while it is used
(docs/architecture.md, "Replicas kept warm"). A version of a model that scales to zero is started on
demand too, and retired alike (on_demand.py). Replica processes (`manage.py run_replica`) are started by
a provisioner instead (rollouts/fleet/).

It runs on the runtime's event loop (serving/runtime.py builds it), as the replicas' own loop tasks do."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

from registry.selectors import VersionRef, versions_to_serve
from serving.replica.on_demand import started_on_demand
from serving.replica.replica import Replica
from serving.transport.protocol import ReplicaState
from serving.transport.reply_hub import ReplyHub

logger = logging.getLogger(__name__)


class ReplicaSupervisor:
    def __init__(self, *, layer: Any, replies: Any, hub: ReplyHub, drain_grace_s: float) -> None:
        self._layer = layer
        self._replies = replies
        self._hub = hub
        # How long a replica whose version left the routing table keeps admitting before it drains: the
        # gateways learn of the edit within their routing cache's revalidation period.
        self._drain_grace_s = drain_grace_s
        self.replicas: dict[tuple[str, str], Replica] = {}  # by (model, version): serving
        self.draining: dict[str, Replica] = {}  # by replica id: no new work, finishing what they hold
        self._unwanted_since: dict[tuple[str, str], float] = {}  # out of the routing table, not yet draining
        self._demanded: dict[tuple[str, str], VersionRef] = {}  # pinned, no replica yet: started next pass
        self._woken = asyncio.Event()  # a demand: the next pass now, not at the end of the interval
        self._routed: set[tuple[str, str]] = set()  # the versions with traffic, as of the last pass
        self._on_demand: set[tuple[str, str]] = set()  # with traffic, started on demand (on_demand.py)
        self.synced = asyncio.Event()  # its first pass is done

    def demand(self, ref: VersionRef) -> bool:
        """A request pinned to a version that has no replica here and no traffic: one is started at once
        (the request waits for it: the runtime's wait_for_replica), kept while it is used. False, and
        nothing started, when REPLICA_MAX_PINNED replicas without traffic are up already: each holds a
        model and its KV cache, and pins may name any old version. A version with traffic of a model that
        scales to zero (starts_on_demand) is started whatever the pins hold: its traffic is routed to it."""
        key = (ref.model_name, ref.version)
        if key not in self._on_demand:
            pinned = (set(self._demanded) | (set(self.replicas) - self._routed)) - self._on_demand
            if len(pinned) >= settings.REPLICA_MAX_PINNED:
                return False
        self._demanded[key] = ref
        self._woken.set()
        return True

    def starts_on_demand(self, model_name: str, version: str) -> bool:
        """Whether the version has traffic but gets a replica only when a request asks (on_demand.py)."""
        return (model_name, version) in self._on_demand

    def is_demanded(self, model_name: str, version: str) -> bool:
        """Whether a replica of the version is coming or kept here: demanded for a pin and not yet
        started, or running (whatever started it: the keep-warm rule then holds it while it is used)."""
        key = (model_name, version)
        return key in self._demanded or key in self.replicas

    async def run(self) -> None:
        """Keep one replica per version that has traffic; pick up new versions without a restart."""
        while True:
            try:
                # An adapter version with traffic wants its base's replica, which serves it.
                wanted = await database_sync_to_async(versions_to_serve, thread_sensitive=False)()
                on_demand = await database_sync_to_async(started_on_demand, thread_sensitive=False)(wanted)
                always = [ref for ref in wanted if (ref.model_name, ref.version) not in on_demand]
                await self.reconcile(always, on_demand=on_demand)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replica supervisor: sync failed; keeping the replicas it has")
            self.synced.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), settings.REPLICA_SYNC_INTERVAL_S)
            self._woken.clear()

    async def reconcile(
        self, wanted: list[VersionRef], *, on_demand: set[tuple[str, str]] | None = None
    ) -> None:
        """`wanted`: the versions that keep a replica up; `on_demand`: those with traffic whose replica is
        started when demanded and retired once idle, as a pinned version's."""
        wanted_keys = {(ref.model_name, ref.version): ref for ref in wanted}
        self._routed = set(wanted_keys)
        self._on_demand = set(on_demand or ())
        demanded, self._demanded = self._demanded, {}
        for key, ref in {**demanded, **wanted_keys}.items():
            replica = self.replicas.get(key)
            if replica is not None and replica.is_hung:
                # Its step hung (the watchdog): replaced, since a new thread may serve where that one
                # stopped. It is idle (its requests ended), and its stop does not wait for the hung
                # thread, whose memory stays with it.
                self.draining[replica.replica_id] = replica
                asyncio.get_running_loop().create_task(self._drain_then_stop(replica), name=f"hung-{key[1]}")
            elif replica is not None and replica.state is not ReplicaState.STOPPED:
                continue  # a FAILED replica stays down until an operator acts; the error is logged
            replica = Replica(
                ref,
                layer=self._layer,
                replies=self._replies,
                torch_threads=settings.REPLICA_TORCH_THREADS or settings.EMBEDDED_TORCH_THREADS,
                local_hub=self._hub,
            )
            self.replicas[key] = replica
            asyncio.get_running_loop().create_task(replica.start(), name=f"replica-start-{ref.version}")
        now = time.monotonic()
        for key in list(self._unwanted_since):
            if key in wanted_keys or key not in self.replicas:
                del self._unwanted_since[key]
        for key in set(self.replicas) - set(wanted_keys):
            # Gateways learn of a routing edit up to their revalidation period later; until every one
            # has, a request may still be routed here, so the replica keeps admitting for at least the
            # drain grace (up to one supervisor period more) first.
            since = self._unwanted_since.setdefault(key, now)
            if (
                now - since < self._drain_grace_s
                or _idle_s(self.replicas[key]) < settings.REPLICA_KEEP_WARM_S
            ):
                continue
            del self._unwanted_since[key]
            replica = self.replicas.pop(key)
            replica.drain()
            self.draining[replica.replica_id] = replica
            asyncio.get_running_loop().create_task(self._drain_then_stop(replica), name=f"drain-{key[1]}")

    async def _drain_then_stop(self, replica: Replica) -> None:
        """Scale-down waits for the requests already accepted, then frees the model."""
        await replica.wait_idle()
        await replica.stop()
        self.draining.pop(replica.replica_id, None)


def _idle_s(replica: Replica) -> float:
    """Seconds since its last submission (or since it became ready), as its heartbeat says."""
    return replica.heartbeat().idle_s
