"""The per-process runtime of the data plane: the reply hub and, in embedded mode, the replicas.

daphne has no ASGI lifespan, so the runtime starts on first use (the `serve` command also starts it as
soon as the server listens). It belongs to one event loop; a new loop (a test's) gets a new runtime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from registry.selectors import VersionRef, versions_with_traffic
from serving.replica import Replica, ReplicaState
from serving.streams import ReplyHub

logger = logging.getLogger(__name__)


class Runtime:
    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.hub = ReplyHub(layer)
        self.replicas: dict[tuple[str, str], Replica] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    async def start(self, *, embedded_replicas: bool) -> None:
        await self.hub.start()
        if embedded_replicas:
            self._supervisor = asyncio.get_running_loop().create_task(
                self._supervise(), name="replica-supervisor"
            )

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        for replica in list(self.replicas.values()):
            await replica.stop()
        self.replicas.clear()
        await self.hub.stop()

    def replicas_for(self, model_name: str, version: str) -> list[Replica]:
        replica = self.replicas.get((model_name, version))
        return [replica] if replica is not None else []

    async def wait_ready(self) -> bool:
        """Wait for the supervisor's first pass and for every replica it started to finish loading."""
        await self._synced.wait()
        results = [await replica.wait_loaded() for replica in list(self.replicas.values())]
        return all(results)

    async def _supervise(self) -> None:
        """Keep one replica per version that has traffic; pick up new versions without a restart."""
        while True:
            try:
                wanted = await sync_to_async(versions_with_traffic, thread_sensitive=False)()
                await self._reconcile(wanted)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replica supervisor: sync failed; keeping the replicas it has")
            self._synced.set()
            await asyncio.sleep(settings.REPLICA_SYNC_INTERVAL_S)

    async def _reconcile(self, wanted: list[VersionRef]) -> None:
        wanted_keys = {(ref.model_name, ref.version): ref for ref in wanted}
        for key, ref in wanted_keys.items():
            replica = self.replicas.get(key)
            if replica is None or replica.state in (ReplicaState.FAILED, ReplicaState.STOPPED):
                if replica is not None and replica.state is ReplicaState.FAILED:
                    continue  # a broken artifact stays down until an operator acts; the error is logged
                replica = Replica(ref, layer=self.layer)
                self.replicas[key] = replica
                asyncio.get_running_loop().create_task(replica.start(), name=f"replica-start-{ref.version}")
        for key in set(self.replicas) - set(wanted_keys):
            replica = self.replicas.pop(key)
            replica.drain()
            await replica.stop()


_runtimes: dict[asyncio.AbstractEventLoop, Runtime] = {}


async def get_runtime() -> Runtime:
    loop = asyncio.get_running_loop()
    runtime = _runtimes.get(loop)
    if runtime is None:
        for stale_loop in [lp for lp in _runtimes if lp.is_closed()]:
            _runtimes.pop(stale_loop, None)
        runtime = Runtime(get_channel_layer())
        _runtimes[loop] = runtime
        await runtime.start(embedded_replicas=settings.EMBEDDED_REPLICAS)
    return runtime


async def shutdown_runtime() -> None:
    runtime = _runtimes.pop(asyncio.get_running_loop(), None)
    if runtime is not None:
        await runtime.stop()
