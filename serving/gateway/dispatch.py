"""From an authenticated request to a request in flight: authorize, route, admit, place.

Shared by every inference endpoint; the views only parse and format. A replica that dies before a
request's first token gets the request retried once on another replica (in_flight.py); after the first
token the client gets a terminal error event instead (a retry would repeat text it has already seen).
docs/architecture.md, "A request's path"."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from channels.db import database_sync_to_async

from registry import request_tenant
from registry.auth_throttle import api_key_attempt, api_key_failures
from registry.authentication import bearer_token
from registry.models import Model
from registry.selectors import RoutingSnapshot, TenantContext
from serving.gateway import adapter_routing, auth, shadow, slo_admission
from serving.gateway.data_plane import data_plane
from serving.gateway.errors import GatewayError
from serving.gateway.in_flight import InFlightRequest, close_all
from serving.gateway.key_watch import key_watch
from serving.gateway.quota import Charge, charge_estimate, check_choices_fit
from serving.gateway.quota_store import quota_store
from serving.gateway.router import choose_version, routing_cache, split_model_name
from serving.telemetry import prompt_log

logger = logging.getLogger(__name__)
_rng = random.Random()


def prompt_usage(final: dict[str, Any]) -> dict[str, int]:
    """A non-generative request's usage, from its final event: prompt tokens only, as OpenAI's embeddings."""
    prompt_tokens = int((final.get("usage") or {}).get("prompt_tokens", 0))
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


async def authenticate(authorization: str | None, *, client: str | None = None) -> TenantContext:
    """The caller's tenant. `client`: its address, under which failed keys are counted, and refused
    with a 429 once too many (registry/auth_throttle.py), right key or not."""
    attempt = api_key_attempt(client, bearer_token(authorization))
    wait_s = api_key_failures.retry_after_s(attempt)
    if wait_s is not None:
        raise GatewayError(429, "too many failed API key attempts; try again later", retry_after_s=wait_s)
    try:
        context = auth.authenticate_from_cache(authorization)
        if context is None:
            # Any worker thread will do (no hop to the one sync thread); Channels' wrapper closes that
            # thread's connection when the server dropped it or it is too old, as Django does around a
            # request.
            context = await database_sync_to_async(auth.authenticate, thread_sensitive=False)(authorization)
    except GatewayError as exc:
        if exc.status == 401:
            api_key_failures.record(attempt)
        raise
    request_tenant.note(context.tenant_id)  # for the access log (config/access_log.py)
    return context


async def model_snapshot(context: TenantContext, path_model: str) -> RoutingSnapshot | None:
    """The routing snapshot of the model a request names (`model` or `model@alias`), None if there is
    no such model; a 403 if the tenant may not use it, so that its kind tells a stranger nothing. From
    the routing cache, so it costs no database read while the entry is fresh. Give it to dispatch(),
    which then does not look it up again."""
    model_name = split_model_name(path_model)[0]
    snapshot = await routing_cache.aget(model_name)
    if snapshot is not None:
        auth.authorize_model(context, snapshot, pinned_version=None)
    return snapshot


async def dispatch(
    *,
    context: TenantContext,
    path_model: str,
    pin: str | None,
    params: dict[str, Any],
    text: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    inputs: list[str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    kind: str = Model.Kind.CAUSAL_LM,
    snapshot: RoutingSnapshot | None = None,
    version: str | None = None,
    num_choices: int = 1,
    room_for: int = 1,
    service_tier: str = "default",
) -> InFlightRequest:
    """Route, admit and submit. Raises GatewayError (404/403/429/503/400) before anything reaches a
    replica when it can; a prompt the replica refuses (too long for the model) comes back as a 400.
    Where admission and submission can go to Redis in one round trip, the replica is chosen before
    the quota is checked; a store that would save nothing by it (in memory, or a tenant it is
    refusing right now) admits first, so a 429 costs no more than the admission. `version`: the version
    another part of the same request already went to (the choices of an OpenAI `n`), whatever the
    traffic split would draw now; it is the platform's choice, not a pin, so it needs no pin right.
    `num_choices`: how many such requests make up the client's one (OpenAI's n), for charge_estimate.
    `room_for`: admitted only if that many such requests would be (the first of n choices: a 429 then
    comes before any choice reaches a replica, with the wait for all n). `service_tier`: as granted
    (service_tiers.grant_tier); it and the tenant's caps inside a replica go with the submission."""
    if sum(payload is not None for payload in (text, messages, inputs)) != 1:
        raise ValueError("dispatch needs exactly one of text, messages or inputs")
    model_name, alias = split_model_name(path_model)
    pin = (pin.strip() or None) if pin else None  # an empty header names no version
    if snapshot is None:  # not already read by the caller (model_snapshot)
        snapshot = await routing_cache.aget(model_name)
    if snapshot is None:
        raise GatewayError(404, f"model {model_name!r} not found")
    auth.authorize_model(context, snapshot, pinned_version=pin, alias=alias)
    if snapshot.kind != kind:
        raise GatewayError(
            400, f"model {model_name!r} is of kind {snapshot.kind}; this endpoint serves {kind} models"
        )
    if version is None:
        version = choose_version(snapshot, pin=pin, alias=alias, rng=_rng)
    prompt = {"text": text, "messages": messages, "inputs": inputs, "tools": tools}
    tokens = charge_estimate(context, params=params, num_choices=num_choices, **prompt)
    charge = Charge(context, tokens, room_for)
    # Before admission: a cancellation while it starts holds no slot. An adapter's replicas: its base's.
    runtime = adapter_routing.placed(await data_plane(), snapshot)
    store = quota_store()
    ticket = (
        None
        if store.sends_with_admission(context)
        else await store.aadmit(context, tokens=tokens, room_for=room_for)
    )
    submission = {
        "reply_to": runtime.hub.channel_name,
        "input": text,
        "messages": messages,
        "inputs": inputs,
        "params": params,
        "tenant": context.tenant_name,
        "cache_group": context.cache_group,
        "keepalives": True,  # events() skips them; a replica older than them sends none
        "service_tier": service_tier,
        "max_running": context.max_running_sequences,
        "kv_share": context.kv_share,
        "tools": tools,  # a chat's, for its template (chat_messages.py, tool_calls.py)
    }
    submission = adapter_routing.with_adapter(submission, snapshot, version)
    # A request may wait for a replica to start (a cold start) for a version the autoscaler gives replicas
    # to: one that serves, of a model that scales to zero, or one without traffic that it is pinned to
    # (authorized above: the tenant may pin and use the model), whose wait asks the autoscaler for one
    # (docs/architecture.md, "Replicas kept warm"). The embedded mode starts its own instead
    # (embedded_replica_coming).
    serves = snapshot.serves(version)
    cold_start = (snapshot.scales_to_zero and serves) or (pin is not None and not serves)
    is_generative = snapshot.kind == Model.Kind.CAUSAL_LM
    # A tenant with latency objectives skips the replicas forecast to miss them, or is refused (429) now.
    skip = frozenset[str]()
    if is_generative:
        skip = await slo_admission.skipped_by_forecast(
            runtime,
            context,
            model_name=model_name,
            version=version,
            submission=submission,
            ticket=ticket,
            charge=charge,
            service_tier=service_tier,
        )
    # A version without traffic (a pin to one) says nothing the judge could use when it has no replica.
    handle = (slo_admission.ForecastRequest if is_generative else InFlightRequest)(
        runtime,
        ticket,
        model_name,
        version,
        submission,
        cold_start=cold_start,
        counts_failures=snapshot.serves(version),
    )
    try:
        try:
            await handle.submit(exclude=skip, charge=charge if ticket is None else None)
        except GatewayError as exc:
            if exc.status == 503:
                handle.count_failure()
            raise
        key_watch().watch(context.api_key_hash, handle)  # a revoked key's streams end (key_watch.py)
        prompt_log.maybe_log(handle, tenant=context.tenant_name, submission=submission)  # off by default
        if shadow.should_mirror(snapshot.mirror, version, _rng):
            assert snapshot.mirror is not None
            mirror = snapshot.mirror[0]
            copy = adapter_routing.with_adapter(submission, snapshot, mirror)
            shadow.start_mirror(handle, runtime=runtime, version=mirror, submission=copy)
    except BaseException:
        await handle.close()
        raise
    return handle


async def dispatch_choices(n: int, **request: Any) -> list[InFlightRequest]:
    """The n choices of one request. The first is routed as any request; the others go to its version
    (not a pin: the platform chose it), each admitted against the quota as a request of its own. A
    seeded request's choice i draws from seed + i, so that its choices differ and each reproduces. More
    choices than the tenant's quota admits at once is a 400: refused with a 429, the client would retry
    a request that can never be admitted."""
    context: TenantContext = request["context"]
    if n > 1:
        payload = {k: request.get(k) for k in ("text", "messages", "inputs", "tools")}
        check_choices_fit(
            context, n=n, tokens=charge_estimate(context, params=request["params"], num_choices=n, **payload)
        )
        request["num_choices"] = n
    # Admitted only with room for all n: a 429 comes before any choice reaches a replica, and its
    # Retry-After is the wait for all of them.
    first = await dispatch(**request, room_for=n)
    if n == 1:
        return [first]
    params = request.pop("params")
    seed = params.get("seed")

    def params_for(index: int) -> dict[str, Any]:
        return params if seed is None else {**params, "seed": (seed + index) % 2**63}

    tasks = [
        asyncio.create_task(dispatch(**request, params=params_for(i), version=first.version))
        for i in range(1, n)
    ]
    try:
        await asyncio.wait(tasks)  # never raises for a task's own failure
    except BaseException:  # cancelled: the client left while the other choices were dispatched
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        await close_all([first, *_dispatched(tasks)])
        raise
    failure = next((t.exception() for t in tasks if not t.cancelled() and t.exception() is not None), None)
    if failure is not None:
        await close_all([first, *_dispatched(tasks)])
        raise failure
    return [first, *_dispatched(tasks)]


def _dispatched(tasks: list[asyncio.Task[InFlightRequest]]) -> list[InFlightRequest]:
    return [task.result() for task in tasks if not task.cancelled() and task.exception() is None]
