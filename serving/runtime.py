"""The per-process runtime of the data plane: the reply hub, the replicas this process hosts (embedded
mode) and, with Redis, the directory of replicas in other processes.

The server starts it at startup (config/lifespan.py); without a lifespan (a test driving the ASGI app)
it starts on first use. It belongs to one event loop; a new loop (a test's) gets a new runtime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from registry.selectors import version_ref
from serving.cancelling import cancel_and_wait, raise_if_cancelling
from serving.gateway import shadow
from serving.gateway.breaker import breaker
from serving.gateway.data_plane import ReplicaHandle
from serving.gateway.errors import GatewayError
from serving.gateway.failures import GatewayFailures
from serving.gateway.quota import LEASE_RENEW_EVERY_S
from serving.gateway.quota_store import quota_store
from serving.gateway.router import REVALIDATE_S, routing_cache
from serving.replica.replica import Replica
from serving.replica.supervisor import ReplicaSupervisor
from serving.throttle import Throttle
from serving.transport.protocol import HEARTBEAT_INTERVAL_S, ReplicaState
from serving.transport.replica_directory import Heartbeat, ReplicaDirectory
from serving.transport.reply_hub import ReplyHub, reply_layer

logger = logging.getLogger(__name__)

# How long a replica whose version left the routing table keeps admitting before it drains: every
# gateway revalidates its routing table within REVALIDATE_S, twice that covers a slow database read.
DRAIN_GRACE_S = 2 * REVALIDATE_S


COLD_START_POLL_S = 0.25  # how often a cold start looks for its replica's ready heartbeat
DEMAND_EVERY_S = 1.0  # and how often it tells the autoscaler (Redis) that requests wait
# A pinned version the autoscaler declined waits for another to idle out (AUTOSCALER idle_before_zero_s,
# minutes): a retry much sooner is declined again.
PIN_DECLINED_RETRY_S = 30


@dataclass(slots=True)
class _ColdStart:
    poller: asyncio.Task[list[ReplicaHandle]]
    num_waiting: int = 0


def _local_handle(replica: Replica) -> ReplicaHandle:
    report = replica.load_report
    return ReplicaHandle(
        replica_id=replica.replica_id,
        model_name=replica.ref.model_name,
        version=replica.ref.version,
        channel_name=replica.channel_name,
        state=str(replica.state),
        load=replica.load,
        kv_cache_usage=report.kv_cache_usage,
        is_ready=replica.is_ready,
        is_local=True,
        # Counted as the heartbeat counts it: arrivals not yet handed to the engine wait too.
        queue_depth=replica.load - report.num_running,
        num_running=report.num_running,
        step_s=report.recent_steps.read(time.monotonic()).mean_s,  # the TTFT forecast's, and the dashboard's
        base_step_s=report.base_step_s,
        queued_prompt_tokens=report.queued_prompt_tokens,
        prefill_tokens_per_s=report.prefill_rate.per_s,
        capacity=report.capacity,
        seats_freed_per_s=report.seat_rate.per_s,
        num_adapters=report.num_adapters,
        latest_ends_in_steps=report.latest_ends_in_steps,
        since_step_s=report.since_step_s(),
    )


def _remote_handle(beat: Heartbeat) -> ReplicaHandle:
    return ReplicaHandle(
        replica_id=beat.replica_id,
        model_name=beat.model_name,
        version=beat.version,
        channel_name=beat.channel_name,
        state=beat.state,
        load=beat.load,
        kv_cache_usage=beat.kv_cache_usage,
        is_ready=beat.is_ready,
        is_local=False,
        queue_depth=beat.num_waiting,
        num_running=beat.num_running,
        step_s=beat.step_s,
        is_fresh=beat.is_fresh,
        base_step_s=beat.base_step_s,
        queued_prompt_tokens=beat.queued_prompt_tokens,
        prefill_tokens_per_s=beat.prefill_tokens_per_s,
        capacity=beat.capacity,
        seats_freed_per_s=beat.seats_freed_per_s,
        num_adapters=beat.num_adapters,
        latest_ends_in_steps=beat.latest_ends_in_steps,
        # As of now: the beat said how long before it was sent, and it has aged since (sent_at is on this
        # process's clock once read, replica_directory's docstring).
        since_step_s=beat.since_step_s + max(0.0, time.time() - beat.sent_at) if beat.since_step_s else 0.0,
    )


class Runtime:
    def __init__(self, layer: Any, replies: Any = None) -> None:
        self.layer = layer  # submissions and aborts
        self.replies = layer if replies is None else replies  # the replicas' steps, to self.hub
        self.hub = ReplyHub(self.replies)
        # The embedded replicas (make serve): one per version with traffic. Empty with replica processes.
        self.supervisor = ReplicaSupervisor(
            layer=self.layer, replies=self.replies, hub=self.hub, drain_grace_s=DRAIN_GRACE_S
        )
        self.directory = ReplicaDirectory(settings.REDIS_URL) if settings.REDIS_URL else None
        self._cold_starts: dict[tuple[str, str], _ColdStart] = {}  # versions requests wait for a replica of
        self._supervisor: asyncio.Task[None] | None = None
        self._route_refresher: asyncio.Task[None] | None = None
        self.failures = GatewayFailures()  # requests that failed where no replica counts them
        self._failure_flusher: asyncio.Task[None] | None = None
        self._lease_renewer: asyncio.Task[None] | None = None

    @property
    def replicas(self) -> dict[tuple[str, str], Replica]:
        """This process's serving replicas by (model, version); draining ones are the supervisor's."""
        return self.supervisor.replicas

    async def start(self, *, embedded_replicas: bool) -> None:
        await self.hub.start()
        self._route_refresher = asyncio.get_running_loop().create_task(
            self._refresh_routes(), name="routing-refresher"
        )
        self._failure_flusher = asyncio.get_running_loop().create_task(
            self._flush_failures_periodically(), name="gateway-failures-flusher"
        )
        self._lease_renewer = asyncio.get_running_loop().create_task(
            self._renew_leases_periodically(), name="quota-lease-renewer"
        )
        if embedded_replicas:
            self._supervisor = asyncio.get_running_loop().create_task(
                self.supervisor.run(), name="replica-supervisor"
            )
        else:
            self.supervisor.synced.set()

    async def stop(self) -> None:
        for cold in self._cold_starts.values():
            cold.poller.cancel()
        self._cold_starts.clear()
        loops = [
            task
            for task in (self._supervisor, self._route_refresher, self._failure_flusher, self._lease_renewer)
            if task is not None
        ]
        await cancel_and_wait(loops)  # logs those that had failed
        # All at once: each waits out its step and a metrics flush bounded at 5 s, which one after another
        # would add up past a supervisor's kill deadline; and one that fails stops none of the others.
        stopping = [*self.replicas.values(), *self.supervisor.draining.values()]
        outcomes = await asyncio.gather(*(replica.stop() for replica in stopping), return_exceptions=True)
        for replica, outcome in zip(stopping, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                logger.error("replica %s: its stop failed", replica.replica_id, exc_info=outcome)
        self.replicas.clear()
        self.supervisor.draining.clear()
        try:
            async with asyncio.timeout(5.0):  # a database that does not answer must not hold the shutdown
                flushed = await self.flush_failures()
        except TimeoutError:
            flushed = -1
        if flushed < 0:
            logger.warning("gateway failure counts dropped at shutdown: the metrics store did not take them")
        self.failures.close()
        await self.hub.stop()
        if self.directory is not None:
            await self.directory.close()

    async def flush_failures(self) -> int:
        """Write the gateway's failure counts to the metrics store; the number of windows written, -1 if
        it failed. Never raises: a store that is down only delays them."""
        try:
            return await database_sync_to_async(self.failures.flush, thread_sensitive=False)()
        except Exception:
            logger.warning("gateway failure counts: flush failed; will retry", exc_info=True)
            return -1

    async def _renew_leases_periodically(self) -> None:
        """Keeps this process's requests in flight counted against their tenants' concurrency; were the
        process to die, they would stop counting once their leases ran out."""
        while True:
            await asyncio.sleep(LEASE_RENEW_EVERY_S)
            try:
                async with asyncio.timeout(LEASE_RENEW_EVERY_S):  # a hung call must not end renewal
                    await quota_store().arenew()
            except Exception:
                logger.warning("quota leases: renewal failed; will retry", exc_info=True)

    async def _flush_failures_periodically(self) -> None:
        while True:
            await asyncio.sleep(settings.METRICS_FLUSH_INTERVAL_S)
            await self.flush_failures()

    async def candidates(
        self, model_name: str, version: str, *, refresh: bool = False
    ) -> list[ReplicaHandle]:
        """The version's replicas, from heartbeats up to a second old unless `refresh`."""
        handles = [_local_handle(r) for (m, v), r in self.replicas.items() if (m, v) == (model_name, version)]
        if self.directory is not None:
            local_ids = {h.replica_id for h in handles}
            beats = await self.directory.replicas(
                model_name, version, refresh=refresh, allow_stale=not refresh
            )
            for beat in beats:
                if beat.replica_id in local_ids:
                    continue
                if beat.state == "ready" and beat.has_missed_beats:
                    # Missed heartbeats open its breaker: should they resume, it waits out the open
                    # period and then takes one trial request before it gets its share again.
                    breaker.trip(beat.replica_id)
                handles.append(_remote_handle(beat))
        return handles

    @property
    def can_cold_start(self) -> bool:
        """Whether a request may wait for a replica to be started: with replica processes, which the
        autoscaler and a provisioner start. Embedded, the supervisor is asked instead
        (embedded_replica_coming)."""
        return self.directory is not None

    def _embedded_replica_loading(self, model_name: str, version: str) -> bool:
        """Whether this process's supervisor is bringing up a replica of the version: one loading, or
        none yet (the supervisor starts one at its next pass for a version with traffic)."""
        if self._supervisor is None:
            return False
        replica = self.replicas.get((model_name, version))
        return replica is None or replica.state is ReplicaState.LOADING

    async def embedded_replica_coming(self, model_name: str, version: str) -> bool:
        """Whether a request that found no ready replica of the version should wait for the embedded
        supervisor's (wait_for_replica), rather than be refused: the version's traffic just moved to it
        (a routing edit), or its replica is being replaced (docs/reliability.md, "Soak"). Refused with
        a 503 while it loaded, the moved traffic was 227 answers in the soak's one restart. A version
        with no traffic (a pin to it) gets one started for it (docs/architecture.md, "Replicas kept
        warm"): the README's `X-Version-Pin: v2` after registering v2 answered 503 for ever."""
        if not self._embedded_replica_loading(model_name, version):
            return False
        if self.supervisor.is_demanded(model_name, version):
            return True
        # A version with traffic gets its replica at the supervisor's next pass, unless its model scales to
        # zero: then, as a pin's, it is started for the request (serving/replica/on_demand.py).
        if await _still_serves(model_name, version) and not self.supervisor.starts_on_demand(
            model_name, version
        ):
            return True
        ref = await database_sync_to_async(version_ref, thread_sensitive=False)(
            model_name=model_name, version=version
        )
        return ref is not None and self.supervisor.demand(ref)

    async def wait_for_replica(self, model_name: str, version: str) -> list[ReplicaHandle]:
        """The version's replicas once one is ready, for a request that found none (its version scaled to
        zero). Meanwhile the autoscaler is told, through Redis, that a request waits for it. However many
        requests wait, one task per version polls for the replica; it stops when the last one leaves.
        The caller bounds the wait (asyncio.timeout). [] when the version takes no traffic any more."""
        key = (model_name, version)
        cold = self._cold_starts.get(key)
        if cold is None:
            poller = asyncio.get_running_loop().create_task(
                self._poll_for_replica(model_name, version), name=f"cold-start-{model_name}:{version}"
            )
            cold = self._cold_starts[key] = _ColdStart(poller)
        cold.num_waiting += 1
        try:
            return await asyncio.shield(cold.poller)
        finally:
            cold.num_waiting -= 1
            if cold.num_waiting == 0 and self._cold_starts.get(key) is cold:
                del self._cold_starts[key]
                cold.poller.cancel()  # done already, or nobody waits for it any more

    async def _poll_for_replica(self, model_name: str, version: str) -> list[ReplicaHandle]:
        told_at = -math.inf
        # With replica processes, a wait for a version that takes no traffic is a pinned request's (the
        # only kind dispatch lets wait for one): its demand is what gets the version a replica.
        pinned_from_start = self.directory is not None and not await _still_serves(model_name, version)
        while True:
            # Cancelled once, when its last waiter leaves; a cancellation lost in a Redis call would
            # leave it recording demand for a version nobody waits for, for ever.
            raise_if_cancelling()
            declined: str | None = None
            try:
                if self.directory is not None and time.monotonic() - told_at >= DEMAND_EVERY_S:
                    declined = await self.directory.record_demand(model_name, version)
                    told_at = time.monotonic()
                pinned = pinned_from_start or (
                    self.directory is None and self.supervisor.is_demanded(model_name, version)
                )
                if not pinned and not await _still_serves(model_name, version):
                    # Its traffic moved away (a rollback): the autoscaler starts no replica for it now,
                    # and one that comes up anyway is not to serve. Its requests get their 503 at once
                    # (no replicas), to send again, rather than at the end of their wait.
                    logger.info("cold start of %s:%s: it takes no traffic any more", model_name, version)
                    return []
                replicas = await self.candidates(model_name, version, refresh=True)
                if any(r.is_ready for r in replicas):
                    return replicas
                if self.directory is None and not self._embedded_replica_loading(model_name, version):
                    return replicas  # its load failed: the requests get their 503 at once
            except Exception as exc:  # Redis away for a moment: the requests wait on, up to their limit
                logger.warning("cold start of %s:%s: %r; trying again", model_name, version, exc)
            if declined is not None:
                # The autoscaler starts no replica for it (serving.selectors.publish_pin_declines): every
                # request that waits gets the reason now, not a timeout at COLD_START_TIMEOUT_S.
                logger.info("cold start of %s:%s declined: %s", model_name, version, declined)
                raise GatewayError(
                    503,
                    f"no replica of {model_name}:{version} is running and none will be started: {declined}",
                    retry_after_s=PIN_DECLINED_RETRY_S,
                )
            await asyncio.sleep(COLD_START_POLL_S)

    async def is_alive(self, handle: ReplicaHandle) -> bool:
        if handle.is_local:
            local = {r.replica_id: r for r in (*self.replicas.values(), *self.supervisor.draining.values())}
            replica = local.get(handle.replica_id)
            return replica is not None and replica.state in (ReplicaState.READY, ReplicaState.DRAINING)
        assert self.directory is not None
        try:
            asked_at = time.monotonic()
            alive = await self.directory.is_alive(handle.model_name, handle.version, handle.replica_id)
            if not alive and time.monotonic() - asked_at > HEARTBEAT_INTERVAL_S:
                # The read itself waited (Redis paused, or failing over): every replica's beats were held
                # up too, and the last one found is old for that reason, not because the replica stopped.
                # Asked again once a beat built after the wait has had time to land.
                await asyncio.sleep(2 * HEARTBEAT_INTERVAL_S)
                alive = await self.directory.is_alive(handle.model_name, handle.version, handle.replica_id)
            return alive
        except Exception:
            # Redis unreadable (a restart, a failover) says nothing of the replica: every stream checks
            # within LIVENESS_CHECK_S, and an error here would end them all without a final event. They
            # wait instead, up to their own timeouts.
            logger.warning("replica directory unreadable; %s taken for alive", handle.replica_id)
            return True

    def local_replicas(self) -> list[ReplicaHandle]:
        """This process's replicas, draining ones included."""
        return [_local_handle(r) for r in (*self.replicas.values(), *self.supervisor.draining.values())]

    async def all_replicas(self) -> list[ReplicaHandle]:
        """Every replica: this process's (for /readyz and the dashboard), and with Redis the fresh
        heartbeats of the others. Raises what the directory's read raises (Redis unreachable)."""
        handles = self.local_replicas()
        if self.directory is not None:
            local_ids = {h.replica_id for h in handles}
            for beat in await self.directory.all_replicas():
                if beat.replica_id not in local_ids and beat.is_fresh:
                    handles.append(_remote_handle(beat))
        return handles

    async def wait_ready(self) -> bool:
        """Wait for the supervisor's first pass and for every replica it started to finish loading."""
        await self.supervisor.synced.wait()
        results = [await replica.wait_loaded() for replica in list(self.replicas.values())]
        return all(results)

    async def _refresh_routes(self) -> None:
        """Keep the routing tables this process uses fresh off the request path: a request then routes
        from memory instead of waiting on a revision read (and a thread hop) every REVALIDATE_S."""
        while True:
            try:
                due = routing_cache.due_for_refresh()
                if due:
                    await database_sync_to_async(routing_cache.refresh, thread_sensitive=False)(due)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("routing refresher: revalidation failed; requests revalidate in line")
            await asyncio.sleep(REVALIDATE_S / 4)


_runtimes: dict[asyncio.AbstractEventLoop, Runtime] = {}  # started
_starting: dict[asyncio.AbstractEventLoop, asyncio.Task[Runtime]] = {}
# Loops whose runtime was shut down (the server is stopping): a request or a live feed still running
# there must not start a new one, which nobody would stop (its replicas, its Redis subscription).
_shut_down: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def live_runtimes() -> list[Runtime]:
    """This process's runtimes whose loops are still open. For other threads (the rollout judge, the
    autoscaler), which only read their replicas' state and never touch their loops."""
    return [rt for loop, rt in list(_runtimes.items()) if not loop.is_closed()]


async def _still_serves(model_name: str, version: str) -> bool:
    """Whether the version still must have replicas, as the routing cache has it (within a second). A
    table that cannot be read says nothing: the requests wait on, as they would have."""
    try:
        snapshot = await routing_cache.aget(model_name)
    except Exception:
        return True
    return snapshot is not None and snapshot.serves(version)


def started_runtime() -> Runtime | None:
    """This loop's runtime if it has started; starts nothing."""
    return _runtimes.get(asyncio.get_running_loop())


async def get_runtime() -> Runtime:
    """This loop's runtime, started. Callers that come while it starts wait for the one start: on Redis
    the reply hub's SUBSCRIBE takes a round trip, and a runtime handed out before it ends has no inbox
    (a request would name None as its reply channel and wait out its timeout)."""
    loop = asyncio.get_running_loop()
    runtime = _runtimes.get(loop)
    if runtime is not None:
        return runtime
    if loop in _shut_down:
        raise GatewayError(503, "the server is shutting down", retry_after_s=1)
    starting = _starting.get(loop)
    if starting is None:
        for stale_loop in [lp for lp in (*_runtimes, *_starting) if lp.is_closed()]:
            _runtimes.pop(stale_loop, None)
            _starting.pop(stale_loop, None)
        starting = _starting[loop] = loop.create_task(_start_runtime(loop), name="runtime-start")
    # Shielded: a caller cancelled while it waits (a client that left) must not cancel the start the
    # other callers wait for.
    try:
        return await asyncio.shield(starting)
    except Exception as exc:  # its channel layer unreachable (Redis down at start): the next caller retries
        if isinstance(exc, GatewayError):
            raise
        _warn_start_failed(exc)
        raise GatewayError(503, "the data plane is unavailable: try again", retry_after_s=1) from exc


_start_failed_warning = Throttle()


def _warn_start_failed(exc: Exception) -> None:
    if _start_failed_warning.is_due():  # once per 10 s of an outage, not once per request
        logger.warning(
            "the data-plane runtime could not start (%s: %s); requests get 503", type(exc).__name__, exc
        )


async def _start_runtime(loop: asyncio.AbstractEventLoop) -> Runtime:
    try:
        runtime = Runtime(get_channel_layer(), reply_layer())
        try:
            await runtime.start(embedded_replicas=settings.EMBEDDED_REPLICAS)
        except BaseException:
            # Registered half-started, it would be handed out for good; the next caller starts afresh.
            with _logged_failure("could not stop a runtime whose start failed"):
                await runtime.stop()
            raise
        _runtimes[loop] = runtime
        return runtime
    finally:
        if _starting.get(loop) is asyncio.current_task():  # not a later start, after a shutdown
            del _starting[loop]


@contextlib.contextmanager
def _logged_failure(message: str) -> Iterator[None]:
    try:
        yield
    except Exception:
        logger.exception(message)


async def shutdown_runtime() -> None:
    loop = asyncio.get_running_loop()
    _shut_down.add(loop)
    starting = _starting.pop(loop, None)
    if starting is not None:  # a start in progress stops what it started itself
        starting.cancel()
        await asyncio.wait({starting})  # it may have ended first, registered: stopped below
        if not starting.cancelled():
            starting.exception()  # retrieved: its callers have had it, if any were left
    runtime = _runtimes.pop(loop, None)
    if runtime is not None:
        await shadow.cancel_all()  # copies nobody waits for; their replicas are about to stop
        await runtime.stop()
