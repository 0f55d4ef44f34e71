"""What the gateway needs of its process's data plane, and how it gets it without importing the root.

The runtime (serving/runtime.py) is the composition root: it holds the reply hub, the channel layer,
this process's embedded replicas and the replica directory, and it imports both sides. The gateway
sees it only as a DataPlane, got through the dotted path settings.DATA_PLANE, so that no gateway
module imports the runtime, the replica side or the engine (docs/architecture.md, "Import rules"), and
no process that never serves a request loads the root for it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from django.conf import settings
from django.utils.module_loading import import_string

from serving.gateway.failures import GatewayFailures
from serving.transport.reply_hub import ReplyHub


@dataclass(frozen=True, slots=True)
class ReplicaHandle:
    """What the router needs of a replica, wherever it runs."""

    replica_id: str
    model_name: str
    version: str
    channel_name: str
    state: str
    load: int  # queue_depth + num_running: what the router balances on
    kv_cache_usage: float
    is_ready: bool
    is_local: bool
    queue_depth: int = 0  # waiting for a slot in the running batch (Heartbeat.num_waiting)
    num_running: int = 0
    step_s: float = 0.0  # its steps' mean time lately (Heartbeat.step_s); 0: none ran
    # What the TTFT forecast reads (serving/gateway/ttft_forecast.py): a step's time with one sequence
    # decoding, the prompt tokens queued ahead and its prefill rate, the most sequences it runs at once
    # and how fast its steps end them (Heartbeat's; 0: not known).
    base_step_s: float = 0.0
    queued_prompt_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    capacity: int = 0
    seats_freed_per_s: float = 0.0
    # Its last heartbeat is recent (an in-process replica always is): a replica killed while it loaded
    # leaves a "loading" beat for a minute, which must not read as one coming up.
    is_fresh: bool = True
    num_adapters: int = 0  # LoRA adapters resident in its engine (Heartbeat.num_adapters)
    # The steps within which its decoding sequences end at the latest, and the seconds since its last
    # step ended (Heartbeat's, aged to when the handle was made): the forecast's bound on a seat wait.
    latest_ends_in_steps: tuple[int, ...] = ()
    since_step_s: float = 0.0


class DataPlane(Protocol):
    """One event loop's data plane, as a request in flight uses it."""

    layer: Any  # the channel layer submissions and aborts go out on
    hub: ReplyHub  # this process's inbox: every request's events come back through it
    failures: GatewayFailures  # requests that fail where no replica can count them

    @property
    def can_cold_start(self) -> bool: ...

    async def candidates(
        self, model_name: str, version: str, *, refresh: bool = False
    ) -> list[ReplicaHandle]: ...

    async def wait_for_replica(self, model_name: str, version: str) -> list[ReplicaHandle]: ...

    async def embedded_replica_coming(self, model_name: str, version: str) -> bool: ...

    async def is_alive(self, handle: ReplicaHandle) -> bool: ...


@functools.cache
def _getter(path: str) -> Callable[[], Awaitable[DataPlane]]:
    return cast(Callable[[], Awaitable[DataPlane]], import_string(path))


async def data_plane() -> DataPlane:
    """This loop's data plane, started (settings.DATA_PLANE: the runtime's get_runtime)."""
    return await _getter(settings.DATA_PLANE)()
