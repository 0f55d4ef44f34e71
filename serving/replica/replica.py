"""A replica: one model version loaded once, serving the requests that arrive on its channel.

This class is its lifecycle (load, ready, drain, stop), its heartbeat and metrics, and the event loop's
side of its I/O: it takes submissions and aborts from the replica's channel and counts them into the
inbox. The rest runs on threads of their own, each in its module (docs/architecture.md, "The replica"):
the preparing thread makes a submission ready for the engine (serving/replica/preparer.py) and puts it in
the inbox (inbox.py); the model thread takes the inbox at the start of each step and runs the engine
(model_loop.py); what a step produced goes out in order through the outbox (outbox.py) while the next step
runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings

from registry.selectors import VersionRef
from serving.cancelling import cancel_and_wait
from serving.replica.engine_loading import engine_capacity, load_engine
from serving.replica.faults import ArmedFaults, Faults, arm_faults
from serving.replica.inbox import Inbox
from serving.replica.load_report import LoadReport
from serving.replica.metrics_flush import flush_metrics, flush_metrics_at_stop, flush_metrics_periodically
from serving.replica.model_loop import DeviceFailed, ModelLoop
from serving.replica.outbox import Outbox
from serving.replica.preparer import Preparer
from serving.replica.watchdog import end_hung_step, watch_steps
from serving.telemetry import metric_window as m
from serving.telemetry.recorder import MetricsRecorder, RequestSample, register_recorder, unregister_recorder
from serving.transport.protocol import (
    ABORT,
    HEARTBEAT_INTERVAL_S,
    REPLICA_UNAVAILABLE,
    SHADOW_RESULT,
    SUBMIT,
    Abort,
    ReplicaState,
    ShadowResult,
    Submit,
    replica_channel_prefix,
)
from serving.transport.receiving import receive_forever
from serving.transport.replica_directory import Heartbeat, HeartbeatPublisher
from serving.transport.reply_hub import ReplyHub

logger = logging.getLogger(__name__)

# How long a stop waits for the metrics store before it goes on without it.
STOP_FLUSH_TIMEOUT_S = 5.0


class Replica:
    def __init__(
        self,
        ref: VersionRef,
        *,
        layer: Any,
        replies: Any = None,
        engine_config: Any = None,
        publisher: HeartbeatPublisher | None = None,
        faults: Faults | None = None,
        torch_threads: int | None = None,
        local_hub: ReplyHub | None = None,
    ) -> None:
        """`layer` brings submissions and aborts; steps go back on `replies` (None: on `layer`). `faults`
        None: whatever settings.FAULTS sets for this version (normally nothing). `local_hub`: the reply
        hub of this process (embedded), which gets the steps for its inbox directly (outbox.py)."""
        self.ref = ref
        self.replica_id = uuid.uuid4().hex[:12]
        self.state = ReplicaState.LOADING
        self.channel_name = f"{replica_channel_prefix(ref.model_name, ref.version)}{self.replica_id}"
        self.error: str | None = None
        self._layer = layer
        self._engine_config = engine_config
        self._publisher = publisher
        self._torch_threads = torch_threads  # None: torch's default (every core)
        self.faults = faults
        self.armed_faults = ArmedFaults()
        # One thread: it loads the model, then runs the engine until the replica stops.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replica-{ref.version}")
        self.inbox = Inbox()
        self.preparer = Preparer(
            self.inbox, replica_id=self.replica_id, thread_name=f"replica-{ref.version}-prep"
        )
        self.outbox = Outbox(
            layer if replies is None else replies,
            inbox=self.inbox,
            local_hub=local_hub,
            replica_id=self.replica_id,
        )
        self.load_report = LoadReport()
        self.metrics = MetricsRecorder(
            model_name=ref.model_name,
            version=ref.version,
            version_id=ref.version_id,
            replica_id=self.replica_id,
        )
        self.model_loop = ModelLoop(
            inbox=self.inbox,
            preparer=self.preparer,
            outbox=self.outbox,
            metrics=self.metrics,
            load_report=self.load_report,
            faults=self.armed_faults,
            replica_id=self.replica_id,
        )
        self._last_request_at = 0.0  # monotonic: ready, or its last submission (the heartbeat's idle_s)
        self._is_leaving = False  # announce_drain(): its beat says draining while it still admits
        # A beat is built and published under it: one built before announce_drain() ("ready") must not
        # be written after the "draining" one.
        self._beat_lock = asyncio.Lock()
        self._engine_run: asyncio.Future[None] | None = None
        self._settled = asyncio.Event()  # loading ended, ready or failed
        self._failed = asyncio.Event()  # failed while serving: its engine thread died, or a step hung
        self.is_hung = False  # the watchdog took a step for hung: its thread will not be waited for
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def load(self) -> int:
        return self.inbox.num_pending + self.load_report.num_waiting + self.load_report.num_running

    @property
    def is_ready(self) -> bool:
        return self.state is ReplicaState.READY

    @property
    def engine(self) -> Any:
        return self.model_loop.engine

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.outbox.bind(loop)
        if self._publisher is not None:
            # Beating "loading" from the start: gateways see a replica on its way (a restart), whose
            # 503s meanwhile are not counted as the version having none (InFlightRequest.submit).
            self._tasks.append(loop.create_task(self._beat(), name=f"replica-{self.replica_id}-heartbeat"))
        try:
            self.faults = arm_faults(self.armed_faults, self.faults, self.ref.model_name, self.ref.version)
            engine = await loop.run_in_executor(self._executor, self._load)
        except Exception as exc:
            self.state = ReplicaState.FAILED
            self.error = str(exc)
            logger.error("replica %s:%s failed to load: %s", self.ref.model_name, self.ref.version, exc)
            self._settled.set()
            return
        self.model_loop.engine = self.preparer.engine = engine
        if self.state is ReplicaState.STOPPED:  # stopped while it loaded: serve nothing
            self._settled.set()
            return
        self.state = ReplicaState.READY
        self._last_request_at = self.load_report.recent_steps.since = time.monotonic()
        self._settled.set()
        register_recorder(self.metrics)
        self._engine_run = loop.run_in_executor(self._executor, self.model_loop.run)
        self._engine_run.add_done_callback(self._engine_ended)
        # Read for as long as it runs: ended, the replica would go on beating ready with nothing reading
        # its channel, and every request routed to it would wait out its timeout.
        reader = f"replica {self.replica_id}"
        coros = [
            (receive_forever(self._layer, self.channel_name, self._take, reader=reader), "listen"),
            (self.outbox.deliver(), "deliver"),
            (
                flush_metrics_periodically(self.metrics, layer=self._layer, channel_name=self.channel_name),
                "metrics",
            ),
        ]
        if (deadline_s := settings.REPLICA_STEP_WATCHDOG_S) > 0:
            watching = watch_steps(self.model_loop, deadline_s=deadline_s, on_hung=self._step_hung)
            coros.append((watching, "watchdog"))
        for coro, name in coros:
            self._tasks.append(loop.create_task(coro, name=f"replica-{self.replica_id}-{name}"))
        logger.info("replica %s:%s ready on %s", self.ref.model_name, self.ref.version, self.channel_name)

    def _load(self) -> Any:
        """On the model thread: the engine, warm, with what the heartbeat reports of it."""
        engine = load_engine(self.ref, engine_config=self._engine_config, torch_threads=self._torch_threads)
        self.load_report.capacity = engine_capacity(engine)
        # An injected delay (faults) is part of every step, so of its fixed cost too.
        self.load_report.base_step_s = getattr(engine, "base_step_s", 0.0) + self.armed_faults.step_delay_s
        self.outbox.connect()
        return engine

    def _engine_ended(self, run: asyncio.Future[None]) -> None:
        if run.cancelled() or run.exception() is None:
            return
        # A bug or a broken device (DeviceFailed), not a failed step (those fail their requests and the
        # thread goes on): nothing would run the engine any more, so the replica says it has failed and
        # gateways stop choosing it; its requests end on their gateways' liveness check (a failed replica
        # is not alive). Idle too: a drain waiting for the engine to empty would wait forever.
        if self.state is not ReplicaState.STOPPED:
            self.state = ReplicaState.FAILED
        error = run.exception()
        self.error = str(error) if isinstance(error, DeviceFailed) else f"the engine thread died: {error!r}"
        logger.error("replica %s: %s", self.replica_id, self.error, exc_info=run.exception())
        self.outbox.mark_idle()
        self._failed.set()

    async def _step_hung(self, elapsed_s: float) -> None:
        """The watchdog's verdict (serving/replica/watchdog.py): fail, and end what the thread held."""
        self.state, self.is_hung = ReplicaState.FAILED, True
        deadline_s = settings.REPLICA_STEP_WATCHDOG_S
        self.error = f"a step has run {elapsed_s:.1f} s, past the watchdog's {deadline_s:g} s"
        logger.error("replica %s: %s; failing it", self.replica_id, self.error)
        await end_hung_step(self.model_loop, self.outbox, "the replica's step hung; try again")
        self._failed.set()

    async def wait_failed(self) -> None:
        """Until it fails while serving (state FAILED): its engine thread died, or a step hung."""
        await self._failed.wait()

    async def wait_loaded(self) -> bool:
        """Wait until loading has ended; True when the replica is ready."""
        await self._settled.wait()
        return self.is_ready

    async def wait_idle(self) -> None:
        """Until nothing is queued or running (used by drain, and by tests after an abort)."""
        await self.outbox.wait_idle()

    async def wait_engine_ended(self) -> None:
        """Until the engine thread has ended: at stop(), or on its own when it died (state FAILED)."""
        if self._engine_run is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(self._engine_run)

    async def announce_drain(self) -> None:
        """Beat "draining" now, so that gateways stop choosing the replica, while it still admits what
        they sent before they saw it: drain() once those have come (ROUTED_AFTER_LEAVING_S)."""
        self._is_leaving = True
        if self._publisher is not None:
            try:
                async with self._beat_lock:
                    await self._publisher.publish(self.heartbeat())
            except Exception:  # the beat loop says it again within HEARTBEAT_INTERVAL_S
                logger.warning("replica %s: heartbeat failed", self.replica_id, exc_info=True)

    def drain(self) -> None:
        """Admit nothing new; requests already accepted run to their end."""
        if self.state is ReplicaState.READY:
            self.state = ReplicaState.DRAINING

    def end_drain(self, message: str) -> None:
        """A drain has run past its deadline: end every request the replica still holds with a
        replica_unavailable error, as a replica that goes away does (a gateway retries one that has no
        token yet on another replica), so that it goes idle and stops with its streams ended, its metrics
        flushed and its heartbeat withdrawn, before its supervisor kills it."""
        self.drain()
        self.inbox.end_all(message)

    async def stop(self) -> None:
        self.state = ReplicaState.STOPPED
        # A task that had ended with an error must not end the stop here: the heartbeat would never be
        # withdrawn, nor the model thread stopped. Nor may one that a Redis client let run on (the
        # listener in BZPOPMIN, the heartbeat): cancel_and_wait cancels it again.
        await cancel_and_wait(self._tasks)  # logs those that had failed, by name (the replica's id in it)
        self.inbox.stop()  # the model thread returns once its step, if it is in one, ends
        if self._engine_run is not None and not self._engine_run.done() and not self.is_hung:
            # The step under way records what it did when it ends: flushed before that, it would be lost.
            await asyncio.wait({self._engine_run}, timeout=STOP_FLUSH_TIMEOUT_S)
        # Withdrawn first: gateways stop choosing the replica now, whatever the metrics store does.
        if self._publisher is not None:
            with contextlib.suppress(Exception):
                await self._publisher.withdraw(self.heartbeat())
        try:
            # Bounded: a database that does not answer must not hold the process (a drained replica that
            # never exits is killed, and its metrics lost, by whatever supervises it).
            async with asyncio.timeout(STOP_FLUSH_TIMEOUT_S):
                await flush_metrics_at_stop(self.metrics)
        except TimeoutError:
            logger.warning(
                "replica %s: metrics not flushed at stop: the store did not answer", self.replica_id
            )
        unregister_recorder(self.metrics)
        # A load or step already running in the model thread cannot be interrupted: wait for it, so that
        # nothing of this replica (a half-built model, transformers' global loading state) outlives stop.
        await self.preparer.shutdown()
        if self.is_hung:  # its thread may never come back; the process exits without it (run_replica)
            self._executor.shutdown(wait=False, cancel_futures=True)
        else:
            await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        await self.outbox.close()

    def heartbeat(self) -> Heartbeat:
        state = ReplicaState.DRAINING if self._is_leaving and self.is_ready else self.state
        idle_s = time.monotonic() - self._last_request_at if self._last_request_at else 0.0
        return self.load_report.heartbeat(
            self.ref,
            self.replica_id,
            self.channel_name,
            state,
            num_pending=self.inbox.num_pending,
            idle_s=idle_s,
        )

    async def _beat(self) -> None:
        assert self._publisher is not None
        while True:
            try:
                async with self._beat_lock:
                    await self._publisher.publish(self.heartbeat())
            except Exception:
                logger.warning("replica %s: heartbeat failed", self.replica_id, exc_info=True)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def flush_metrics(self) -> int:
        """Write pending metrics to the store now (they go every METRICS_FLUSH_INTERVAL_S anyway)."""
        return await flush_metrics(self.metrics)

    # --- I/O on the event loop ---------------------------------------------------------------------

    async def _take(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == SUBMIT:
            try:
                submit = Submit.from_wire(message)
            except (
                TypeError
            ) as exc:  # a field missing: answered, if it says where, rather than left to time out
                self.metrics.record(requests=[RequestSample("error", error_type="invalid_request_error")])
                await self.outbox.refuse_malformed(message, exc)
                return
            if self.state is not ReplicaState.READY or self._has_engine_ended:
                # With no engine running (its thread died) this is a refusal too: in the inbox nothing
                # would take it, and the request would wait out its timeout.
                state = self.state if self.state is not ReplicaState.READY else ReplicaState.FAILED
                self.metrics.record(requests=[RequestSample("error", error_type=REPLICA_UNAVAILABLE)])
                await self.outbox.refuse(
                    submit.reply_to, submit.request_id, REPLICA_UNAVAILABLE, f"the replica is {state}"
                )
                return
            self._last_request_at = time.monotonic()
            self._arrive(submission=submit)
        elif kind == ABORT:
            if not self._has_engine_ended:  # else nothing holds the request any more: nothing to abort
                self._arrive(abort=Abort.from_wire(message).request_id)
        elif kind == SHADOW_RESULT:
            _count_shadow_result(self.metrics, ShadowResult.from_wire(message))

    @property
    def _has_engine_ended(self) -> bool:
        """Whether the model thread has returned or died. An arrival then must not clear idle: nothing
        would take it from the inbox, and a drain waiting for idle would wait for ever."""
        return self._engine_run is not None and self._engine_run.done()

    def _arrive(self, *, submission: Submit | None = None, abort: str | None = None) -> None:
        """Counted here, on the loop, so that idle (declared on the loop) waits for it; put in the inbox
        by the preparing thread, or as it came (Inbox.count_in)."""
        self.outbox.mark_busy()
        if not self.inbox.count_in(submission):
            self.preparer.submit(submission, abort)


def _count_shadow_result(metrics: MetricsRecorder, result: ShadowResult) -> None:
    """A shadow copy compared with its primary (serving/gateway/shadow.py): whether its text matched and,
    from a gateway that compared token events, its share of agreeing tokens and first differing one."""
    metrics.count({m.SHADOW_COMPARED: 1, m.SHADOW_MATCHED: int(result.matched)})
    if result.agreement is not None:
        diff = {m.SHADOW_AGREEMENT: result.agreement}
        if result.first_divergence is not None:
            diff[m.SHADOW_FIRST_DIVERGENCE] = float(result.first_divergence)
        metrics.observe(diff)
