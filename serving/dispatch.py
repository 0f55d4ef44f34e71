"""From an admitted request to a stream of events: route, submit to a replica, wait, abort on exit.

Shared by every inference endpoint; the views only parse and format."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async

from registry.models import Model
from registry.selectors import TenantContext
from serving import gateway
from serving.gateway import GatewayError, Ticket
from serving.replica import ABORT, SUBMIT
from serving.router import choose_replica, choose_version, routing_cache, split_model_name
from serving.runtime import get_runtime
from serving.streams import iterate_events

ACCEPT_TIMEOUT_S = 30.0
INACTIVITY_TIMEOUT_S = 60.0
_rng = random.Random()


@dataclass(slots=True)
class Dispatch:
    """An accepted request on its replica: iterate `events()` to the end, or close it to abort."""

    request_id: str
    model_name: str
    version: str
    num_prompt_tokens: int
    _queue: asyncio.Queue[dict[str, Any]]
    _replica_channel: str
    _ticket: Ticket
    _runtime: Any
    num_completion_tokens: int = 0
    is_finished: bool = False
    _closed: bool = field(default=False)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        async for event in iterate_events(self._queue, inactivity_timeout_s=INACTIVITY_TIMEOUT_S):
            if "token" in event:
                self.num_completion_tokens += 1
            if "finish_reason" in event:
                self.is_finished = True
            yield event

    async def close(self) -> None:
        """Idempotent. A request that has not finished is aborted on its replica, freeing its blocks."""
        if self._closed:
            return
        self._closed = True
        self._runtime.hub.close(self.request_id)
        if not self.is_finished:
            with contextlib.suppress(Exception):
                await self._runtime.layer.send(
                    self._replica_channel, {"type": ABORT, "request_id": self.request_id}
                )
        used = self.num_prompt_tokens + self.num_completion_tokens
        await sync_to_async(gateway.quota_store().release, thread_sensitive=False)(
            self._ticket, used_tokens=used
        )


async def authenticate(authorization: str | None) -> TenantContext:
    return await sync_to_async(gateway.authenticate, thread_sensitive=False)(authorization)


async def dispatch(
    *,
    context: TenantContext,
    path_model: str,
    pin: str | None,
    params: dict[str, Any],
    text: str | None = None,
    messages: list[dict[str, str]] | None = None,
    kind: str = Model.Kind.CAUSAL_LM,
) -> Dispatch:
    """Route and submit. Raises GatewayError (404/403/429/503/400) before anything reaches a replica
    when it can; a prompt the replica refuses (too long for the model) comes back as a 400."""
    model_name, alias = split_model_name(path_model)
    pin = pin.strip() if pin else None
    snapshot = await sync_to_async(routing_cache.get, thread_sensitive=False)(model_name)
    if snapshot is None:
        raise GatewayError(404, f"model {model_name!r} not found")
    gateway.authorize_model(context, model_name, pinned_version=pin)
    if snapshot.kind != kind:
        raise GatewayError(
            400, f"model {model_name!r} is a {snapshot.kind} model; this endpoint serves {kind}"
        )
    version = choose_version(snapshot, pin=pin, alias=alias, rng=_rng)
    if (text is None) == (messages is None):
        raise ValueError("dispatch needs exactly one of text or messages")
    input_chars = len(text) if text is not None else sum(len(m["content"]) for m in messages or ())
    tokens = gateway.estimate_tokens(input_chars=input_chars, max_tokens=params.get("max_tokens", 1))
    ticket = await sync_to_async(gateway.quota_store().admit, thread_sensitive=False)(context, tokens=tokens)
    runtime = await get_runtime()
    request_id = uuid.uuid4().hex
    handle: Dispatch | None = None
    try:
        replica = choose_replica(runtime.replicas_for(model_name, version), rng=_rng)
        if replica is None:
            raise GatewayError(503, f"no ready replica for {model_name}:{version}", retry_after_s=2)
        queue = runtime.hub.open(request_id)
        await runtime.layer.send(
            replica.channel_name,
            {
                "type": SUBMIT,
                "request_id": request_id,
                "reply_to": runtime.hub.channel_name,
                "input": text,
                "messages": messages,
                "params": params,
                "tenant": context.tenant_name,
            "cache_group": context.cache_group,
                "submitted_at": time.time(),
            },
        )
        handle = Dispatch(request_id, model_name, version, 0, queue, replica.channel_name, ticket, runtime)
        try:
            first = await asyncio.wait_for(queue.get(), timeout=ACCEPT_TIMEOUT_S)
        except TimeoutError:
            await handle.close()
            raise GatewayError(
                503, "the replica did not accept the request in time", retry_after_s=2
            ) from None
        if first.get("finish_reason") == "error":
            handle.is_finished = True
            await handle.close()
            error = first.get("error", {})
            status = 400 if error.get("type") == "invalid_request_error" else 503
            raise GatewayError(status, error.get("message", "the replica refused the request"))
        handle.num_prompt_tokens = int(first.get("num_prompt_tokens", 0))
        return handle
    except BaseException:
        runtime.hub.close(request_id)
        if handle is None:  # once a handle exists, its close() gives the quota back
            await sync_to_async(gateway.quota_store().release, thread_sensitive=False)(ticket, used_tokens=0)
        raise
