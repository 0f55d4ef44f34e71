"""A replica: one model version loaded once, serving the requests that arrive on its channel.

Three threads. The engine runs on its own model thread, step after step (schedule -> forward -> sample),
for as long as it holds work; it is not thread-safe, so requests and aborts wait in an inbox that the
model thread empties at the start of each step. The event loop thread does the rest of the I/O: it
takes submissions and aborts from the replica's channel, heartbeats and flushes metrics; a preparing
thread, between the two, fills the inbox. (It used to be one executor call per step from the loop, with
the sends awaited in between: on a loaded 2-core machine the model sat idle ~1.4 ms a step for two
thread hand-offs and a Redis round trip; docs/architecture.md, "The engine on a thread of its own".)

What each step produced goes out in order while the model thread runs the next step. On Redis the
model thread publishes it itself, without waiting for Redis's reply (serving/transport/channel_layers.py):
handed to the loop thread first, a first token waited a median ~0.8 ms for that thread to wake and win the GIL
(docs/architecture.md, "Steps published from the model thread"). On the in-memory layer, which only the event
loop may touch, the loop thread sends it.

A submission is made ready for the engine (its sampling parameters checked, a chat rendered, the prompt
tokenized) on the preparing thread, while the model thread runs the step in progress; the model thread
only adds it. Tokenizing there cost each new request's step ~0.1-0.5 ms for a short prompt here, and a
prompt of 32,768 characters (the gateway's limit) held every running sequence ~9 ms (docs/architecture.md,
"Tokenizing off the model thread").

After each step the new events of every request go out as ONE message per receiving server process
(inbox), never one per token: docs/architecture.md, "One message per step and inbox". Acceptances (or
refusals) of the requests a step admits go out as its forward pass starts (on Redis written by the publisher's
own thread during the pass, and always before the step's tokens), so the gateway sends the response's headers
while the prompt is prefilled rather than on the first token's path.

A version of a non-generative model (an embedding model, a classifier) gets the same replica over an
EncoderEngine (serving/engine/encoder.py): its inputs wait in a dynamic batcher, and the model thread
sleeps until the engine says a batch is due (full, or its oldest input has waited its delay) or a new
arrival wakes it. A request's one result is its final event: the vectors (embeddings, or a classifier's
scores with its labels) in base64."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jinja2
from channels.db import database_sync_to_async
from django.conf import settings

from registry import artifacts
from registry.models import Model
from registry.selectors import VersionRef
from serving.cancelling import cancel_and_wait
from serving.replica.config import encoder_config_from_settings, engine_config_from_settings
from serving.replica.faults import Faults, check_fault_injection_allowed, configured_faults
from serving.replica.step_result import (
    Arrival,
    Outgoing,
    Route,
    StepResult,
    failure_message,
    final_event,
    request_sample,
)
from serving.telemetry import metric_window as m
from serving.telemetry.recorder import (
    MetricsRecorder,
    RequestSample,
    StepSample,
    register_recorder,
    unregister_recorder,
)
from serving.transport.protocol import (
    ABORT,
    HEARTBEAT_INTERVAL_S,
    INJECTED_FAULT,
    KEEPALIVE_S,
    REPLICA_FAILED,
    REPLICA_UNAVAILABLE,
    SHADOW_RESULT,
    SUBMIT,
    Abort,
    ReplicaState,
    ShadowResult,
    accepted_event,
    error_event,
    keepalive_event,
    max_tokens_for,
    replica_channel_prefix,
    step_message,
    token_event,
)
from serving.transport.replica_directory import Heartbeat, HeartbeatPublisher, RecentSteps
from serving.transport.reply_hub import ReplyHub

logger = logging.getLogger(__name__)

# How far the model thread may run ahead of the loop's sends (hand-overs not yet sent). A send that
# hangs then stops the engine, as it would have before, instead of piling up steps without bound.
MAX_UNSENT = 64
# Embedded, how long the model thread waits for the loop to deliver a step that starts a stream (see
# Replica._emit) before it goes on regardless.
START_DELIVERY_WAIT_S = 0.005
# Steps of one decoding sequence it takes before their median, not the warm-up's, is a step's base.
MIN_BASE_SAMPLES = 8
# How long the listening task waits before it tries a failed receive again, doubled up to the most.
LISTEN_RETRY_MIN_S = 0.1
LISTEN_RETRY_MAX_S = 2.0

# Failed steps in a row after which the model thread probes its device (Engine.probe): a device that
# fails the probe too is broken (a sticky CUDA error), and the replica fails rather than stay ready and
# fail every request. A request that fails every step it is in fails only its own steps: the probe,
# which holds none of them, passes, and the replica serves on.
PROBE_AFTER_FAILED_STEPS = 3
# How long a stop waits for the metrics store before it goes on without it.
STOP_FLUSH_TIMEOUT_S = 5.0


class DeviceFailed(RuntimeError):
    """The model thread's end when its device fails a probe (PROBE_AFTER_FAILED_STEPS)."""


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
        hub of this process (embedded), which gets the steps for its inbox handed to it on the loop
        rather than sent through `replies`."""
        self.ref = ref
        self.replica_id = uuid.uuid4().hex[:12]
        self.state = ReplicaState.LOADING
        self.channel_name = f"{replica_channel_prefix(ref.model_name, ref.version)}{self.replica_id}"
        self.error: str | None = None
        self._layer = layer
        self._replies = layer if replies is None else replies
        # Embedded, a step sent through the in-memory layer is deep-copied, queued, and waits for the
        # hub's task to wake: Python on the loop, holding the GIL while the model thread runs the next
        # step. Handed to the hub directly, the loop used ~8% less CPU while streaming
        # (docs/architecture.md, "The GIL in the embedded server").
        self._local_hub = local_hub
        # The model thread's own publisher where the reply layer offers one (Redis); else the loop sends.
        make_publisher = getattr(self._replies, "blocking_publisher", None)
        self._step_publisher: Any = make_publisher() if make_publisher is not None else None
        self._engine_config = engine_config
        self._publisher = publisher
        self._torch_threads = torch_threads  # None: torch's default (every core)
        # One thread: it loads the model, then runs the engine until the replica stops.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replica-{ref.version}")
        # One thread, so arrivals reach the inbox in the order they came. The Rust tokenizer releases the
        # GIL inside transformers' call, so the loop and the model thread run on meanwhile (a chat
        # template and the Python around the tokenizer do hold it).
        self._preparer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replica-{ref.version}-prep")
        self._engine: Any = None
        # The inbox. The preparing thread appends, the model thread takes everything at the start of a
        # step; both under the condition's lock, which neither holds for longer than a list swap.
        self._inbox = threading.Condition()
        # Prepared, not yet handed to the engine; or a submission as it came (a dict), for the model
        # thread to prepare itself: see _arrive.
        self._submissions: list[Arrival | dict[str, Any]] = []
        self._aborts: list[str] = []
        self._num_preparing = 0  # arrived, still being prepared (under the inbox's lock)
        self._is_model_waiting = False  # the model thread waits for work, its engine empty (same lock)
        self._num_queued = 0  # arrivals ever counted in (the model thread counts those it takes)
        self._last_request_at = 0.0  # monotonic: ready, or its last submission (the heartbeat's idle_s)
        self._stopping = False  # tells the model thread to return
        self._is_leaving = False  # announce_drain(): its beat says draining while it still admits
        # A beat is built and published under it: one built before announce_drain() ("ready") must not
        # be written after the "draining" one.
        self._beat_lock = asyncio.Lock()
        # Set by end_drain(): the model thread ends every request it holds with this message, and any it
        # admits later (those being prepared when the drain began). _is_end_pending wakes it for that.
        self._drain_ended: str | None = None
        self._is_end_pending = False
        self._engine_run: asyncio.Future[None] | None = None
        self._outbox: asyncio.Queue[Outgoing] = asyncio.Queue()  # model thread -> loop, in step order
        self._unsent = threading.Semaphore(MAX_UNSENT)
        self._routes: dict[str, Route] = {}  # every request the engine holds (model thread only)
        self._keepalive_due = time.monotonic() + KEEPALIVE_S  # model thread only
        self._idle = asyncio.Event()  # nothing queued, nothing running, everything sent
        self._idle.set()
        self._settled = asyncio.Event()  # loading ended, ready or failed
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_waiting = 0
        self.num_running = 0
        self.kv_cache_usage = 0.0
        self.capacity = 0  # set once the engine is built
        self.base_step_s = 0.0  # a step with one sequence decoding, set once the engine is warm
        self._one_sequence_steps: deque[float] = deque(maxlen=64)  # the model thread's
        self.recent_steps = RecentSteps()
        self.metrics = MetricsRecorder(
            model_name=ref.model_name,
            version=ref.version,
            version_id=ref.version_id,
            replica_id=self.replica_id,
        )
        self.faults = faults
        self._step_delay_s = 0.0
        self._error_rate = 0.0
        self._fault_rng: random.Random | None = None

    @property
    def load(self) -> int:
        return self._num_preparing + len(self._submissions) + self.num_waiting + self.num_running

    @property
    def is_ready(self) -> bool:
        return self.state is ReplicaState.READY

    @property
    def engine(self) -> Any:
        return self._engine

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        if self._publisher is not None:
            # Beating "loading" from the start: gateways see a replica on its way (a restart), whose
            # 503s meanwhile are not counted as the version having none (InFlightRequest.submit).
            self._tasks.append(loop.create_task(self._beat(), name=f"replica-{self.replica_id}-heartbeat"))
        try:
            self._arm_faults()
            self._engine = await loop.run_in_executor(self._executor, self._load)
        except Exception as exc:
            self.state = ReplicaState.FAILED
            self.error = str(exc)
            logger.error("replica %s:%s failed to load: %s", self.ref.model_name, self.ref.version, exc)
            self._settled.set()
            return
        if self.state is ReplicaState.STOPPED:  # stopped while it loaded: serve nothing
            self._settled.set()
            return
        self.state = ReplicaState.READY
        self._last_request_at = self.recent_steps.since = time.monotonic()
        self._settled.set()
        register_recorder(self.metrics)
        self._engine_run = loop.run_in_executor(self._executor, self._run_engine)
        self._engine_run.add_done_callback(self._engine_ended)
        coros = [
            (self._listen(), "listen"),
            (self._deliver(), "deliver"),
            (self._flush_periodically(), "metrics"),
        ]
        for coro, name in coros:
            self._tasks.append(loop.create_task(coro, name=f"replica-{self.replica_id}-{name}"))
        logger.info("replica %s:%s ready on %s", self.ref.model_name, self.ref.version, self.channel_name)

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
        self._idle.set()

    def _arm_faults(self) -> None:
        if self.faults is None:
            self.faults = configured_faults(self.ref.model_name, self.ref.version)
        if self.faults is None or not self.faults.is_active:
            return
        check_fault_injection_allowed()  # refused: the replica fails to start, saying why
        self._step_delay_s = self.faults.step_delay_ms / 1000
        self._error_rate = self.faults.error_rate
        self._fault_rng = random.Random(self.faults.seed)
        logger.warning(
            "replica %s:%s: FAULT INJECTION on: %s", self.ref.model_name, self.ref.version, self.faults
        )

    def _load(self) -> Any:
        # Deferred: the runtime, which every web process imports (a gateway-only one too), imports this
        # module; the engine brings torch, which only a process that hosts a replica may load.
        from serving.engine.loading import MODEL_LOAD_LOCK

        if self._torch_threads is not None:
            import torch

            torch.set_num_threads(self._torch_threads)  # process-wide: every replica here shares it
        if settings.REPLICA_GIL_SWITCH_INTERVAL_S:
            # The engine thread runs Python between torch calls (scheduling, sampling, detokenizing)
            # while the event loop thread waits to accept requests and send tokens; by default it may
            # wait up to 5 ms for the GIL each time. Process-wide.
            sys.setswitchinterval(settings.REPLICA_GIL_SWITCH_INTERVAL_S)
        path = Path(self.ref.artifact_uri)
        artifacts.verify(path, expected_files=self.ref.files, expected_sha256=self.ref.sha256)
        # transformers' lazy module imports are not thread-safe, and an embedded server loads its
        # replicas in threads: a generative engine registering its attention while an embedding model
        # was being built failed to find transformers' own AttentionInterface. Engines are built one at a
        # time; their warm-ups, below, overlap.
        with MODEL_LOAD_LOCK:
            # Deferred, as MODEL_LOAD_LOCK above: the engine brings torch.
            from serving.engine.encoder import EncoderConfig, EncoderEngine
            from serving.engine.engine import Engine

            engine: Any
            if self.ref.kind != Model.Kind.CAUSAL_LM:
                config = self._engine_config
                if not isinstance(config, EncoderConfig):
                    # run_replica's flags come as a generative EngineConfig: its sizing says nothing of
                    # batching, but the device it names is where this model must go too.
                    config = encoder_config_from_settings(device=getattr(config, "device", None))
                engine = EncoderEngine(path, kind=self.ref.kind, config=config)
            else:
                engine = Engine(path, config=self._engine_config or engine_config_from_settings())
        if isinstance(engine, Engine):  # its forward, attention and Linear layers, and why not the others
            logger.info("replica %s:%s: %s", self.ref.model_name, self.ref.version, engine.runner.describe())
        elif isinstance(engine, EncoderEngine):
            logger.info("replica %s:%s: %s", self.ref.model_name, self.ref.version, engine.head.describe())
        # What the autoscaler reads as full: a generative engine's running batch, an encoder's batch.
        self.capacity = (
            engine.config.max_num_seqs if isinstance(engine, Engine) else engine.config.max_batch_size
        )
        engine.warmup()  # allocate scratch and (if enabled) compile before reporting ready
        # An injected delay (faults) is part of every step, so of its fixed cost too.
        self.base_step_s = getattr(engine, "base_step_s", 0.0) + self._step_delay_s
        if self._step_publisher is not None:
            self._step_publisher.connect()  # a Redis that is down fails the load, not the first step
        return engine

    async def wait_loaded(self) -> bool:
        """Wait until loading has ended; True when the replica is ready."""
        await self._settled.wait()
        return self.is_ready

    async def wait_idle(self) -> None:
        """Until nothing is queued or running (used by drain, and by tests after an abort)."""
        await self._idle.wait()

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
        with self._inbox:
            self._drain_ended = message
            self._is_end_pending = True
            self._inbox.notify()

    async def stop(self) -> None:
        self.state = ReplicaState.STOPPED
        # A task that had ended with an error must not end the stop here: the heartbeat would never be
        # withdrawn, nor the model thread stopped. Nor may one that a Redis client let run on (the
        # listener in BZPOPMIN, the heartbeat): cancel_and_wait cancels it again.
        await cancel_and_wait(self._tasks)  # logs those that had failed, by name (the replica's id in it)
        with self._inbox:
            self._stopping = True  # the model thread returns once its step, if it is in one, ends
            self._inbox.notify()
        if self._engine_run is not None and not self._engine_run.done():
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
                await self._last_flush()
        except TimeoutError:
            logger.warning(
                "replica %s: metrics not flushed at stop: the store did not answer", self.replica_id
            )
        unregister_recorder(self.metrics)
        # A load or step already running in the model thread cannot be interrupted: wait for it, so that
        # nothing of this replica (a half-built model, transformers' global loading state) outlives stop.
        # The same for a preparation under way; those not started are dropped (nothing would serve them).
        self._preparer.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._preparer.shutdown, wait=True)
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        if self._step_publisher is not None:
            # It joins its writer thread and reads Redis's last replies: blocking, so not on the loop,
            # where an embedded replica shares it with every stream of the server.
            await asyncio.to_thread(self._step_publisher.close)

    def heartbeat(self) -> Heartbeat:
        steps = self.recent_steps.read(time.monotonic())
        return Heartbeat(
            replica_id=self.replica_id,
            model_name=self.ref.model_name,
            version=self.ref.version,
            channel_name=self.channel_name,
            state=str(ReplicaState.DRAINING if self._is_leaving and self.is_ready else self.state),
            num_waiting=self.num_waiting + self._num_preparing + len(self._submissions),
            num_running=self.num_running,
            kv_cache_usage=self.kv_cache_usage,
            sent_at=time.time(),
            capacity=self.capacity,
            is_generative=self.ref.kind == Model.Kind.CAUSAL_LM,
            idle_s=time.monotonic() - self._last_request_at if self._last_request_at else 0.0,
            step_s=steps.mean_s,
            step_rate=steps.per_s,
            base_step_s=self.base_step_s,
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
        """Write pending metrics to the store. Never raises: a store that is down only delays them."""
        try:
            return await database_sync_to_async(self.metrics.flush, thread_sensitive=False)()
        except Exception:
            logger.warning("replica %s: metrics flush failed; will retry", self.replica_id, exc_info=True)
            return 0

    async def _last_flush(self) -> None:
        """flush_metrics on a daemon thread of its own. A flush left hanging on a pool thread (the
        default executor's, where flush_metrics runs) would hold the process at exit: asyncio.run and
        the interpreter join those threads, and with no timeout on Python 3.11."""
        loop = asyncio.get_running_loop()
        flushed: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not flushed.done():
                flushed.set_result(None)

        def flush() -> None:
            from django.db import connections

            try:
                self.metrics.flush()
            except Exception:
                logger.warning("replica %s: metrics flush failed at stop", self.replica_id, exc_info=True)
            finally:
                connections.close_all()  # this thread's own; nothing else would close them
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                    loop.call_soon_threadsafe(settle)

        threading.Thread(target=flush, name=f"replica-{self.replica_id}-last-flush", daemon=True).start()
        await flushed

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(settings.METRICS_FLUSH_INTERVAL_S)
            await self.flush_metrics()

    # --- I/O on the event loop ---------------------------------------------------------------------

    async def _listen(self) -> None:
        """Take submissions and aborts from the replica's channel for as long as it runs. A receive that
        fails (Redis restarting, a dropped connection) is retried: ended, the replica would go on beating
        ready with nothing reading its channel, and every request routed to it would wait out its
        timeout."""
        backoff_s = LISTEN_RETRY_MIN_S
        while True:
            try:
                message = await self._layer.receive(self.channel_name)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning(
                    "replica %s: receive failed; retrying in %.1f s",
                    self.replica_id,
                    backoff_s,
                    exc_info=True,
                )
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, LISTEN_RETRY_MAX_S)
                continue
            backoff_s = LISTEN_RETRY_MIN_S
            try:
                await self._take(message)
            except asyncio.CancelledError:
                raise
            except Exception:  # one malformed message must not stop the replica from listening
                logger.exception("replica %s: could not take a message", self.replica_id)

    async def _take(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == SUBMIT:
            if self.state is not ReplicaState.READY or self._has_engine_ended:
                # With no engine running (its thread died) this is a refusal too: in the inbox nothing
                # would take it, and the request would wait out its timeout.
                state = self.state if self.state is not ReplicaState.READY else ReplicaState.FAILED
                self.metrics.record(requests=[RequestSample("error", error_type="replica_unavailable")])
                await self._send(
                    message["reply_to"],
                    {message["request_id"]: [error_event("replica_unavailable", f"the replica is {state}")]},
                )
                return
            self._last_request_at = time.monotonic()
            self._arrive(submission=message)
        elif kind == ABORT:
            if not self._has_engine_ended:  # else nothing holds the request any more: nothing to abort
                self._arrive(abort=Abort.from_wire(message).request_id)
        elif kind == SHADOW_RESULT:
            matched = ShadowResult.from_wire(message).matched
            self.metrics.count({m.SHADOW_COMPARED: 1, m.SHADOW_MATCHED: int(matched)})

    @property
    def _has_engine_ended(self) -> bool:
        """Whether the model thread has returned or died. An arrival then must not clear idle: nothing
        would take it from the inbox, and a drain waiting for idle would wait for ever."""
        return self._engine_run is not None and self._engine_run.done()

    def _arrive(self, *, submission: dict[str, Any] | None = None, abort: str | None = None) -> None:
        """Counted here, on the loop, so that idle (declared on the loop) waits for it; put in the inbox
        by the preparing thread. A submission that finds the model thread waiting with an empty engine
        and nothing being prepared goes to the inbox as it came: the model thread prepares it itself,
        with no step for it to hold up, and the request skips one thread's wake-up on its way to its
        first forward pass. Nothing earlier is still being prepared, so the inbox keeps arrival order."""
        self._idle.clear()
        with self._inbox:
            self._num_queued += 1
            if submission is not None and self._is_model_waiting and self._num_preparing == 0:
                self._submissions.append(submission)
                self._inbox.notify()
                return
            self._num_preparing += 1
        try:
            self._preparer.submit(self._prepare_and_put, submission, abort)
        except RuntimeError:  # shut down: the replica is stopping, and nothing will take it
            with self._inbox:
                self._num_queued -= 1
                self._num_preparing -= 1

    # --- the preparing thread ----------------------------------------------------------------------

    def _prepare_and_put(self, submission: dict[str, Any] | None, abort: str | None) -> None:
        arrival = self._prepare(submission) if submission is not None else None
        with self._inbox:
            self._num_preparing -= 1
            if arrival is not None:
                self._submissions.append(arrival)
            if abort is not None:
                self._aborts.append(abort)
            self._inbox.notify()

    def _prepare(self, message: dict[str, Any]) -> Arrival:
        """Everything about a submission the engine itself need not do: never raises, a failure is the
        arrival's error. Reads the tokenizer only (concurrent reads are safe; nothing here sets its
        truncation or padding, the one thing that would not be)."""
        # Deferred (torch, via the engine's package): see _load.
        from serving.engine.chat import encode_chat_prompt
        from serving.engine.sequence import SamplingParams

        request_id = str(message.get("request_id"))
        route = Route(
            str(message.get("reply_to")),
            message.get("submitted_at") or time.time(),
            wants_keepalives=message.get("keepalives") is True,
        )
        arrival = Arrival(request_id, route)
        try:
            raw = message["params"]
            fields = {**raw, "stop": tuple(raw.get("stop") or ())}
            if "logit_bias" in raw:
                fields["logit_bias"] = tuple(tuple(pair) for pair in raw["logit_bias"])
            to_context = "max_tokens" in raw and raw["max_tokens"] is None  # chat's default: to the end
            if to_context:
                fields["max_tokens"] = 1  # set below, once the prompt's length is known
            arrival.params = SamplingParams(**fields)
            inputs = message.get("inputs")  # a non-generative request's texts
            if inputs is not None:
                if not isinstance(inputs, list) or not all(isinstance(t, str) for t in inputs):
                    raise ValueError("inputs must be a list of strings")
                encoded = [self._engine.encode(t) for t in inputs]
                arrival.prompt_ids, arrival.num_prompt_tokens = encoded, sum(map(len, encoded))
            else:
                text = message.get("input")
                if text is None:
                    arrival.prompt_ids = encode_chat_prompt(
                        self._engine.tokenizer, message["messages"], self._engine.encode
                    )
                else:
                    arrival.prompt_ids = self._engine.encode(text)
                arrival.num_prompt_tokens = len(arrival.prompt_ids)
                if to_context:  # as far as the context goes, and as far as the KV cache could hold
                    room = self._engine.max_output_tokens(arrival.num_prompt_tokens)
                    max_tokens = max_tokens_for(None, room=room, limit=settings.MAX_TOKENS_LIMIT)
                    arrival.params = dataclasses.replace(arrival.params, max_tokens=max_tokens)
            arrival.tenant = message.get("tenant") or "default"
            arrival.cache_group = message.get("cache_group")
        except (TypeError, ValueError, KeyError) as exc:
            arrival.error = error_event("invalid_request_error", str(exc))
        except Exception as exc:
            if type(exc) is jinja2.TemplateError:
                # The template's raise_exception refused the conversation (roles that do not alternate,
                # say): the request's fault. Its subclasses (a template that does not parse, an undefined
                # name) are the version's.
                arrival.error = error_event("invalid_request_error", str(exc))
            else:
                logger.exception("replica %s: could not prepare request %s", self.replica_id, request_id)
                arrival.error = error_event("internal_error", "the replica could not admit it")
        return arrival

    async def _send(self, inbox: str, items: dict[str, list[dict[str, Any]]]) -> None:
        try:
            await self._replies.send(inbox, step_message(items))
        except Exception:
            logger.exception("replica %s: could not deliver a step to %s", self.replica_id, inbox)

    async def _deliver(self) -> None:
        """Send what the model thread produced, one item after another: a step's events never overtake
        the acceptances before them, nor the previous step's. Idle is declared here, after the last
        events are sent, so a drain that waits for it loses nothing."""
        while True:
            outgoing = await self._outbox.get()
            for inbox, items in outgoing.result.events_by_inbox.items():
                hub = self._local_hub
                if hub is not None and inbox == hub.channel_name:
                    try:
                        hub.deliver(step_message(items))
                    except Exception:
                        logger.exception("replica %s: could not deliver a step to %s", self.replica_id, inbox)
                else:
                    await self._send(inbox, items)
            if outgoing.delivered is not None:
                # Scheduled after the tasks the delivery woke (the streams' SSE writes), so it runs last.
                asyncio.get_running_loop().call_soon(outgoing.delivered.set)
            self._unsent.release()
            if outgoing.is_engine_empty and outgoing.num_taken == self._num_queued:
                self._idle.set()

    # --- the model thread --------------------------------------------------------------------------

    def _emit(
        self, result: StepResult, *, is_engine_empty: bool = False, num_taken: int = 0, soon: bool = False
    ) -> None:
        """Send a step's events: published from this thread where it has a publisher (`soon`: by the
        publisher's thread, still before anything published later), else handed to the loop. The loop
        is told when the engine empties either way, since idle is declared there."""
        if self._step_publisher is None:
            if result.events_by_inbox or is_engine_empty:
                # Embedded, the loop's handling of a step is Python that needs the GIL; run alongside
                # the next forward pass, the two threads trade it at every torch call. For a step that
                # starts a stream (an acceptance, a first token) the model thread lets the loop finish
                # first: the gateway's response start and first chunk go out uncontended, and the prefill
                # runs without them. Other steps do not wait: at 64 streams waiting for every delivery
                # cost 2-7% of the throughput (docs/architecture.md, "The GIL in the embedded server").
                delivered = threading.Event() if result.starts_a_stream else None
                self._hand_to_loop(Outgoing(result, is_engine_empty, num_taken, delivered))
                if delivered is not None:
                    delivered.wait(START_DELIVERY_WAIT_S)
            return
        publish = self._step_publisher.publish_soon if soon else self._step_publisher.publish
        for inbox, items in result.events_by_inbox.items():
            try:
                publish(inbox, step_message(items))
            except Exception:
                logger.exception("replica %s: could not deliver a step to %s", self.replica_id, inbox)
        if is_engine_empty:
            # Idle is what a drain waits for before the process exits: nothing may be left unwritten.
            self._step_publisher.flush()
            self._hand_to_loop(Outgoing(StepResult(), is_engine_empty, num_taken))

    def _hand_to_loop(self, outgoing: Outgoing) -> None:
        assert self._loop is not None
        while not self._unsent.acquire(timeout=0.25):
            if self._stopping or self._loop.is_closed():
                return
        try:
            self._loop.call_soon_threadsafe(self._outbox.put_nowait, outgoing)
        except RuntimeError:  # the loop closed without stop(): the process is exiting
            self._stopping = True

    def _run_engine(self) -> None:
        """The model thread's loop: take the inbox, step, hand the events over, record the step's
        stats and metrics, and go straight on to the next step while the loop sends the events; sleep
        only when the engine holds nothing."""
        engine = self._engine
        num_taken = 0  # inbox items taken, all told: _deliver compares it with _num_queued
        num_failed_in_a_row = 0
        while True:
            with self._inbox:
                while not (self._stopping or self._submissions or self._aborts or self._is_end_pending):
                    # A generative engine is due whenever it holds work; an encoder engine's batch when
                    # it is full or its oldest input has waited its delay. A new arrival wakes this wait.
                    due_s = engine.seconds_until_ready()
                    if due_s == 0:
                        break
                    # With a timeout: a loop closed without stop() (an exception on the way out) must end
                    # this thread too, or the interpreter waits for it at exit.
                    if self._loop is None or self._loop.is_closed():
                        return
                    self._is_model_waiting = due_s is None
                    self._inbox.wait(timeout=0.5 if due_s is None else min(due_s, 0.5))
                    self._is_model_waiting = False
                if self._stopping:
                    return
                submissions, self._submissions = self._submissions, []
                aborts, self._aborts = self._aborts, []
                self._is_end_pending = False
                num_taken += len(submissions) + len(aborts)
            broken: Exception | None = None  # the device's failure, which the probe confirmed
            # Before the step: no forward pass for requests that are ending.
            ended = self._end_drained()
            try:
                result = self._step(submissions, aborts)
                if result.model_time_s is not None:  # a forward pass ran, not only admissions or aborts
                    num_failed_in_a_row = 0
            except Exception as exc:
                # A failed forward pass fails the requests in it; the replica keeps serving the others
                # and new ones. A failure anywhere else may have left any request half done: all fail.
                logger.exception("replica %s: engine step failed", self.replica_id)
                # engine.StepFailed names the requests of the failed forward pass; anything else, all.
                result = self._fail_all(failure_message(exc), getattr(exc, "request_ids", None))
                num_failed_in_a_row += 1
                if num_failed_in_a_row >= PROBE_AFTER_FAILED_STEPS:
                    num_failed_in_a_row = 0
                    broken = self._probe()
            if ended is not None:
                result.merge_events(ended)
            if broken is not None:
                # The replica's failure, not the requests': a gateway retries those that have no token
                # yet on another replica, and its breaker counts it (dispatch.REPLICA_FAILURES).
                failed = self._fail_all(
                    f"the replica's device failed ({type(broken).__name__}); try again",  # text: in the log
                    error_type="replica_unavailable",
                )
                result.merge_events(failed)
            is_engine_empty = not engine.has_unfinished()
            # Recording fails nothing: the step itself went well, and its requests go on.
            with _logged_failure("replica %s: could not record a step's metrics", self.replica_id):
                if result.ended:  # before the events: a client that saw its stream end finds it counted
                    self.metrics.record(requests=result.ended)
            # Then the tokens: the stats and the step's sample are ~0.1 ms a step no token waits for.
            self._emit(result)
            with _logged_failure("replica %s: could not record a step's stats", self.replica_id):
                self._account(result)
            if is_engine_empty:  # after the account, so whoever waits for idle reads the final stats
                self._emit(StepResult(), is_engine_empty=True, num_taken=num_taken)
            if broken is not None:  # its requests have their errors: the thread ends, and the replica fails
                raise DeviceFailed(f"its device failed a probe after failed steps: {broken!r}") from broken

    def _end_drained(self) -> StepResult | None:
        """end_drain() on the model thread: every request held ends with its message."""
        if self._drain_ended is None or not self._routes:
            return None
        logger.warning(
            "replica %s: %s; ending the %d requests it still holds",
            self.replica_id,
            self._drain_ended,
            len(self._routes),
        )
        return self._fail_all(self._drain_ended, error_type="replica_unavailable")

    def _probe(self) -> Exception | None:
        """Engine.probe on the model thread: None when the device works, else what it raised."""
        try:
            self._engine.probe()
        except Exception as exc:
            logger.error("replica %s: the device failed its probe: %r", self.replica_id, exc)
            return exc
        logger.warning(
            "replica %s: %d steps failed in a row but the device passed its probe: serving on",
            self.replica_id,
            PROBE_AFTER_FAILED_STEPS,
        )
        return None

    def _step(self, submissions: list[Arrival | dict[str, Any]], aborts: list[str]) -> StepResult:
        engine = self._engine
        result = StepResult()
        ended: list[RequestSample] = []  # this step's, handed to the result that goes out last
        for arrival in submissions:
            self._admit(arrival if isinstance(arrival, Arrival) else self._prepare(arrival), result, ended)
        # After the admissions: a request and its abort can come in one inbox (a client that left while
        # its prompt was being prepared), and the abort must find it.
        for request_id in aborts:
            if self._routes.pop(request_id, None) is not None:
                engine.abort(request_id)
                ended.append(RequestSample("abort"))
        if ended:
            # Counted now, before their events go out: a forward pass that fails below replaces this
            # step's result with its failures, and these would be lost from the counts.
            with _logged_failure("replica %s: could not record a step's metrics", self.replica_id):
                self.metrics.record(requests=ended)
            ended = []
        if result.events_by_inbox:
            # One more message per inbox, and only for steps that admit something: sent during the
            # forward pass (not by this thread, which has the pass to start), and the gateway then
            # starts its response while it runs.
            self._emit(result, soon=True)
            result = StepResult()
        model_time_s: float | None = None
        itl_s: list[float] = []
        if engine.seconds_until_ready() == 0:
            self.recent_steps.begin(time.monotonic())
            started = time.perf_counter()
            try:
                if self._step_delay_s:
                    time.sleep(self._step_delay_s)  # injected: a slow model, so it counts as model time
                outputs = engine.step()
            except BaseException:
                self.recent_steps.cancel()  # or an idle replica would read as busy with it for ever
                raise
            model_time_s = time.perf_counter() - started
            now = time.monotonic()
            finished: list[str] = []
            for output in outputs:
                route = self._routes.get(output.request_id)
                if route is None:
                    continue
                if output.new_token_ids:
                    if route.last_token_at is not None:
                        itl_s.append(now - route.last_token_at)
                    route.last_token_at = now
                for i, _ in enumerate(output.new_token_ids):
                    index = output.num_output_tokens - len(output.new_token_ids) + i
                    event = token_event(output.new_text if i == 0 else "", index)
                    if output.logprobs is not None and i < len(output.logprobs):
                        entry = output.logprobs[i]
                        event["logprob"] = {
                            "token": entry.token,
                            "logprob": entry.logprob,
                            "top": entry.top,
                            "bytes": entry.bytes,
                        }
                    result.add(route, output.request_id, event)
                if output.is_finished:
                    result.add(route, output.request_id, final_event(output, route))
                    ended.append(request_sample(output, route))
                    finished.append(output.request_id)
            # Only once every event of the step is built: should one raise (an encoder's vectors, say),
            # _fail_all still finds each request of the step, those that finished in it too, and ends it
            # with an error instead of leaving its client to time out.
            for request_id in finished:
                del self._routes[request_id]
        self._add_keepalives(result)
        result.model_time_s, result.itl_s, result.ended = model_time_s, itl_s, ended
        return result

    def _add_keepalives(self, result: StepResult) -> None:
        """Every KEEPALIVE_S, a keepalive for each request held that has no event in this step: one
        queued behind a full batch for longer than the gateway's inactivity timeout is not lost."""
        now = time.monotonic()
        if now < self._keepalive_due:
            return
        self._keepalive_due = now + KEEPALIVE_S
        for request_id, route in self._routes.items():
            if route.wants_keepalives and request_id not in result.events_by_inbox.get(route.reply_to, {}):
                result.add(route, request_id, keepalive_event())

    def _account(self, result: StepResult) -> None:
        """What the heartbeat reports, and the step's sample."""
        stats = self._engine.stats()
        self.num_waiting, self.num_running, self.kv_cache_usage = (
            stats.num_waiting,
            stats.num_running,
            stats.kv_cache_usage,
        )
        if result.model_time_s is not None:
            self.recent_steps.add(time.monotonic(), result.model_time_s)
            if stats.num_scheduled_seqs == 1 and stats.num_batched_tokens == 1:
                # One sequence decoding: what the warm-up timed, here without the warm-up's company (the
                # replicas of an embedded server warm up together) and with all of the step's own work.
                # The median of the latest, so that neither one lucky step nor one slow one sets it.
                self._one_sequence_steps.append(result.model_time_s)
                if len(self._one_sequence_steps) >= MIN_BASE_SAMPLES:
                    self.base_step_s = statistics.median(self._one_sequence_steps)
            step = StepSample(
                model_time_s=result.model_time_s,
                batch_size=stats.num_scheduled_seqs,
                num_waiting=stats.num_waiting,
                num_running=stats.num_running,
                kv_cache_usage=stats.kv_cache_usage,
                itl_s=result.itl_s,
            )
            batch = getattr(self._engine, "last_batch", None)  # an encoder engine's dynamic batch
            if batch is not None:
                step.close_reason, step.fill_time_s = str(batch.reason), batch.fill_time_s
            self.metrics.record(step=step)

    def _admit(self, arrival: Arrival, result: StepResult, ended: list[RequestSample]) -> None:
        engine = self._engine
        request_id, route = arrival.request_id, arrival.route
        if self._drain_ended is not None:  # prepared while the drain ran out: the replica is going away
            result.add(route, request_id, error_event("replica_unavailable", self._drain_ended))
            ended.append(RequestSample("error", error_type="replica_unavailable"))
            return
        if arrival.error is not None:
            result.add(route, request_id, arrival.error)
            ended.append(RequestSample("error", error_type=arrival.error["error"]["type"]))
            return
        try:
            engine.add_request(
                request_id,
                arrival.prompt_ids,
                arrival.params,
                tenant_id=arrival.tenant,
                cache_group=arrival.cache_group,
                arrival_time=time.monotonic() - max(0.0, time.time() - route.submitted_at),
            )
        except (TypeError, ValueError, KeyError) as exc:
            result.add(route, request_id, error_event("invalid_request_error", str(exc)))
            ended.append(RequestSample("error", error_type="invalid_request_error"))
            return
        except Exception:
            # This request fails alone; raised further it would fail the whole step and drop the
            # acceptances already made in it.
            logger.exception("replica %s: could not admit request %s", self.replica_id, request_id)
            with contextlib.suppress(Exception):
                engine.abort(request_id)
            result.add(route, request_id, error_event("internal_error", "the replica could not admit it"))
            ended.append(RequestSample("error", error_type="internal_error"))
            return
        num_prompt_tokens = arrival.num_prompt_tokens
        result.add(route, request_id, accepted_event(num_prompt_tokens))
        if self._fault_rng is not None and self._fault_rng.random() < self._error_rate:
            engine.abort(request_id)
            result.add(
                route, request_id, error_event(INJECTED_FAULT, "injected fault (fault injection is on)")
            )
            ended.append(
                RequestSample("error", num_prompt_tokens=num_prompt_tokens, error_type=INJECTED_FAULT)
            )
            return
        route.seq = engine.sequence(request_id)
        self._routes[request_id] = route

    def _fail_all(
        self, message: str, request_ids: list[str] | None = None, *, error_type: str = "internal_error"
    ) -> StepResult:
        """End `request_ids` (None: every request the replica holds) with an error of `error_type`."""
        result, samples = StepResult(), []
        failed = list(self._routes) if request_ids is None else [r for r in request_ids if r in self._routes]
        for request_id in failed:
            route = self._routes.pop(request_id)
            result.add(route, request_id, error_event(error_type, message))
            with contextlib.suppress(Exception):
                self._engine.abort(request_id)
            # replica_unavailable (the device failed, a drain ran out) is a rejection the metrics leave to
            # the gateway while the request has no token: it retries it elsewhere. One whose stream it had
            # begun ends in an error its client sees, which the version's error rate must count.
            has_begun = route.last_token_at is not None
            counted_as = REPLICA_FAILED if error_type == REPLICA_UNAVAILABLE and has_begun else error_type
            samples.append(RequestSample("error", error_type=counted_as))
        self.metrics.record(requests=samples)
        return result


@contextlib.contextmanager
def _logged_failure(message: str, *args: object) -> Iterator[None]:
    try:
        yield
    except Exception:
        logger.exception(message, *args)
