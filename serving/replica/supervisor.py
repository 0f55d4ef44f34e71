"""The embedded supervisor: in a process that hosts replicas itself (`make serve`), one replica per model
version with traffic, started when a version gets traffic and drained, then stopped, when it loses it.
Replica processes (`manage.py run_replica`) are started by a provisioner instead (rollouts/fleet/).

It runs on the runtime's event loop (serving/runtime.py builds it), as the replicas' own loop tasks do."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

from registry.selectors import VersionRef, versions_with_traffic
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
        self.synced = asyncio.Event()  # its first pass is done

    async def run(self) -> None:
        """Keep one replica per version that has traffic; pick up new versions without a restart."""
        while True:
            try:
                wanted = await database_sync_to_async(versions_with_traffic, thread_sensitive=False)()
                await self.reconcile(wanted)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replica supervisor: sync failed; keeping the replicas it has")
            self.synced.set()
            await asyncio.sleep(settings.REPLICA_SYNC_INTERVAL_S)

    async def reconcile(self, wanted: list[VersionRef]) -> None:
        wanted_keys = {(ref.model_name, ref.version): ref for ref in wanted}
        for key, ref in wanted_keys.items():
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
            if now - since < self._drain_grace_s:
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
