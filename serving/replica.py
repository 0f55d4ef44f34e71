"""A replica: one model version loaded once, serving the requests that arrive on its channel.

The engine loop runs as a task on the event loop; each engine step (schedule -> forward -> sample) runs
in a one-thread executor, so the loop stays free for channel I/O while the model works. Requests and
aborts are handed to the engine between steps, on the model thread, because the engine is not
thread-safe. After each step the new events of every request go out as ONE message per receiving
server process (inbox), never one per token: see ARCHITECTURE.md's transport measurements. Acceptances
(or refusals) of the requests a step admits go out before its forward pass, so the gateway sends the
response's headers while the prompt is prefilled rather than on the first token's path."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import sys
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

from registry import artifacts
from registry.selectors import VersionRef
from serving import metrics as m
from serving.faults import INJECTED_FAULT, Faults, check_fault_injection_allowed, configured_faults
from serving.metrics import MetricsRecorder, RequestSample, StepSample, register_recorder, unregister_recorder
from serving.replica_directory import HEARTBEAT_INTERVAL_S, Heartbeat, HeartbeatPublisher
from serving.shadow import SHADOW_RESULT
from serving.streams import STEP_MESSAGE

logger = logging.getLogger(__name__)

_ENGINE_IMPORT_LOCK = threading.Lock()

SUBMIT = "replica.submit"
ABORT = "replica.abort"


class ReplicaState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


def replica_channel_prefix(ref: VersionRef) -> str:
    return f"switchyard.replica.{ref.model_name}.{ref.version}."


@dataclass(slots=True)
class _Route:
    """Where a request's events go, and what the replica needs to word its final event."""

    reply_to: str
    submitted_at: float  # wall clock, so a gateway in another process can be compared
    seq: Any = None  # the engine's Sequence, read for its queue wait when it ends
    last_token_at: float | None = None  # monotonic, for inter-token latency


@dataclass(slots=True)
class _StepResult:
    events_by_inbox: dict[str, dict[str, list[dict[str, Any]]]] = field(
        default_factory=lambda: defaultdict(dict)
    )

    def add(self, route: _Route, request_id: str, event: dict[str, Any]) -> None:
        self.events_by_inbox[route.reply_to].setdefault(request_id, []).append(event)


def engine_config_from_settings() -> Any:
    from serving.engine.engine import EngineConfig

    return EngineConfig(
        max_num_seqs=settings.REPLICA_MAX_NUM_SEQS,
        max_num_batched_tokens=settings.REPLICA_MAX_NUM_BATCHED_TOKENS,
        kv_cache_bytes=settings.REPLICA_KV_CACHE_BYTES,
        compile=settings.REPLICA_COMPILE,
        pack_linear=settings.REPLICA_PACK_LINEAR,
    )


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
    ) -> None:
        """`layer` brings submissions and aborts; steps go back on `replies` (None: on `layer`). `faults`
        None: whatever settings.FAULTS sets for this version (normally nothing)."""
        self.ref = ref
        self.replica_id = uuid.uuid4().hex[:12]
        self.state = ReplicaState.LOADING
        self.channel_name = f"{replica_channel_prefix(ref)}{self.replica_id}"
        self.error: str | None = None
        self._layer = layer
        self._replies = layer if replies is None else replies
        self._engine_config = engine_config
        self._publisher = publisher
        self._torch_threads = torch_threads  # None: torch's default (every core)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replica-{ref.version}")
        self._engine: Any = None
        self._submissions: list[dict[str, Any]] = []  # arrived since the last step
        self._aborts: list[str] = []
        self._routes: dict[str, _Route] = {}  # every request the engine holds
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued, nothing running
        self._settled = asyncio.Event()  # loading ended, ready or failed
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early_sends: list[asyncio.Task[None]] = []  # acceptances sent during the current step
        self.num_waiting = 0
        self.num_running = 0
        self.kv_cache_usage = 0.0
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
        return len(self._submissions) + self.num_waiting + self.num_running

    @property
    def is_ready(self) -> bool:
        return self.state is ReplicaState.READY

    @property
    def engine(self) -> Any:
        return self._engine

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
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
        self._settled.set()
        register_recorder(self.metrics)
        coros = [(self._listen(), "listen"), (self._work(), "work"), (self._flush_periodically(), "metrics")]
        if self._publisher is not None:
            coros.append((self._beat(), "heartbeat"))
        for coro, name in coros:
            self._tasks.append(loop.create_task(coro, name=f"replica-{self.replica_id}-{name}"))
        logger.info("replica %s:%s ready on %s", self.ref.model_name, self.ref.version, self.channel_name)

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
        with _ENGINE_IMPORT_LOCK:  # transformers' lazy module import is not thread-safe
            from serving.engine.engine import Engine

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
        engine = Engine(path, config=self._engine_config or engine_config_from_settings())
        engine.warmup()  # allocate scratch and (if enabled) compile before reporting ready
        return engine

    async def wait_loaded(self) -> bool:
        """Wait until loading has ended; True when the replica is ready."""
        await self._settled.wait()
        return self.is_ready

    async def wait_idle(self) -> None:
        """Until nothing is queued or running (used by drain, and by tests after an abort)."""
        await self._idle.wait()

    def drain(self) -> None:
        """Admit nothing new; requests already accepted run to their end."""
        if self.state is ReplicaState.READY:
            self.state = ReplicaState.DRAINING

    async def stop(self) -> None:
        self.state = ReplicaState.STOPPED
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.flush_metrics()
        unregister_recorder(self.metrics)
        if self._publisher is not None:
            with contextlib.suppress(Exception):
                await self._publisher.withdraw(self.heartbeat())
        # A load or step already running in the model thread cannot be interrupted: wait for it, so that
        # nothing of this replica (a half-built model, transformers' global loading state) outlives stop.
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            replica_id=self.replica_id,
            model_name=self.ref.model_name,
            version=self.ref.version,
            channel_name=self.channel_name,
            state=str(self.state),
            num_waiting=self.num_waiting + len(self._submissions),
            num_running=self.num_running,
            kv_cache_usage=self.kv_cache_usage,
            sent_at=time.time(),
        )

    async def _beat(self) -> None:
        assert self._publisher is not None
        while True:
            try:
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

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(settings.METRICS_FLUSH_INTERVAL_S)
            await self.flush_metrics()

    # --- I/O on the event loop ---------------------------------------------------------------------

    async def _listen(self) -> None:
        while True:
            message = await self._layer.receive(self.channel_name)
            kind = message.get("type")
            if kind == SUBMIT:
                if self.state is not ReplicaState.READY:
                    self.metrics.record(requests=[RequestSample("error", error_type="replica_unavailable")])
                    await self._send(
                        message["reply_to"],
                        {
                            message["request_id"]: [
                                _error_event("replica_unavailable", f"the replica is {self.state}")
                            ]
                        },
                    )
                    continue
                self._submissions.append(message)
            elif kind == ABORT:
                self._aborts.append(message["request_id"])
            elif kind == SHADOW_RESULT:
                matched = bool(message.get("matched"))
                self.metrics.count({m.SHADOW_COMPARED: 1, m.SHADOW_MATCHED: int(matched)})
                continue
            else:
                continue
            self._idle.clear()
            self._wakeup.set()

    async def _send(self, inbox: str, items: dict[str, list[dict[str, Any]]]) -> None:
        message = {"type": STEP_MESSAGE, "items": [{"request_id": r, "events": e} for r, e in items.items()]}
        try:
            await self._replies.send(inbox, message)
        except Exception:
            logger.exception("replica %s: could not deliver a step to %s", self.replica_id, inbox)

    async def _send_all(self, result: _StepResult) -> None:
        for inbox, items in result.events_by_inbox.items():
            await self._send(inbox, items)

    def _start_early_send(self, result: _StepResult) -> None:
        assert self._loop is not None
        self._early_sends.append(self._loop.create_task(self._send_all(result)))

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._submissions and not self._aborts and not self._routes:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            submissions, self._submissions = self._submissions, []
            aborts, self._aborts = self._aborts, []
            try:
                result = await loop.run_in_executor(self._executor, self._step, submissions, aborts)
            except Exception as exc:
                # A failed forward pass fails every request in it; the replica keeps serving new ones.
                logger.exception("replica %s: engine step failed", self.replica_id)
                result = self._fail_all(str(exc))
            # The step's acceptances first: a request's first token must not overtake them. The model
            # thread queued their sends before the step's own completion, so the tasks exist by now.
            early, self._early_sends = self._early_sends, []
            for task in early:
                await task
            # Sent between steps, not during the next one: an event loop serialising and sending while
            # the model thread runs takes the GIL from it (measured: steps 10-15% slower on a CPU).
            await self._send_all(result)
            await asyncio.sleep(0)  # let submissions that arrived during the step join the next one

    # --- the model thread --------------------------------------------------------------------------

    def _step(self, submissions: list[dict[str, Any]], aborts: list[str]) -> _StepResult:
        engine = self._engine
        result = _StepResult()
        ended: list[RequestSample] = []
        for request_id in aborts:
            if self._routes.pop(request_id, None) is not None:
                engine.abort(request_id)
                ended.append(RequestSample("abort"))
        for message in submissions:
            self._admit(message, result, ended)
        if result.events_by_inbox:
            # One more message per inbox, and only for steps that admit something: cheap enough to send
            # during the forward pass, and the gateway then starts its response while it runs.
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._start_early_send, result)
            result = _StepResult()
        model_time_s: float | None = None
        itl_s: list[float] = []
        if engine.has_unfinished():
            started = time.perf_counter()
            if self._step_delay_s:
                time.sleep(self._step_delay_s)  # injected: a slow model, so it counts as model time
            outputs = engine.step()
            model_time_s = time.perf_counter() - started
            now = time.monotonic()
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
                    result.add(
                        route, output.request_id, {"token": output.new_text if i == 0 else "", "index": index}
                    )
                if output.is_finished:
                    del self._routes[output.request_id]
                    result.add(route, output.request_id, _final_event(output, route))
                    ended.append(_request_sample(output, route))
        stats = engine.stats()
        self.num_waiting, self.num_running, self.kv_cache_usage = (
            stats.num_waiting,
            stats.num_running,
            stats.kv_cache_usage,
        )
        step = None
        if model_time_s is not None:
            step = StepSample(
                model_time_s=model_time_s,
                batch_size=stats.num_scheduled_seqs,
                num_waiting=stats.num_waiting,
                num_running=stats.num_running,
                kv_cache_usage=stats.kv_cache_usage,
                itl_s=itl_s,
            )
        if step is not None or ended:
            self.metrics.record(step=step, requests=ended)
        return result

    def _admit(self, message: dict[str, Any], result: _StepResult, ended: list[RequestSample]) -> None:
        from serving.engine.chat import render_chat_prompt
        from serving.engine.sequence import SamplingParams

        engine = self._engine
        request_id = message["request_id"]
        route = _Route(message["reply_to"], message.get("submitted_at") or time.time())
        try:
            raw = message["params"]
            params = SamplingParams(**{**raw, "stop": tuple(raw.get("stop") or ())})
            text = message.get("input")
            if text is None:
                text = render_chat_prompt(engine.tokenizer, message["messages"])
            prompt_ids = engine.encode(text)
            engine.add_request(
                request_id,
                prompt_ids,
                params,
                tenant_id=message.get("tenant") or "default",
                cache_group=message.get("cache_group"),
                arrival_time=time.monotonic() - max(0.0, time.time() - route.submitted_at),
            )
        except (TypeError, ValueError, KeyError) as exc:
            result.add(route, request_id, _error_event("invalid_request_error", str(exc)))
            ended.append(RequestSample("error", error_type="invalid_request_error"))
            return
        result.add(route, request_id, {"accepted": True, "num_prompt_tokens": len(prompt_ids)})
        if self._fault_rng is not None and self._fault_rng.random() < self._error_rate:
            engine.abort(request_id)
            result.add(
                route, request_id, _error_event(INJECTED_FAULT, "injected fault (fault injection is on)")
            )
            ended.append(RequestSample("error", num_prompt_tokens=len(prompt_ids), error_type=INJECTED_FAULT))
            return
        route.seq = engine.scheduler.get(request_id)
        self._routes[request_id] = route

    def _fail_all(self, message: str) -> _StepResult:
        result = _StepResult()
        for request_id, route in self._routes.items():
            result.add(route, request_id, _error_event("internal_error", message))
            with contextlib.suppress(Exception):
                self._engine.abort(request_id)
        self.metrics.record(
            requests=[RequestSample("error", error_type="internal_error") for _ in self._routes]
        )
        self._routes.clear()
        return result


def _request_sample(output: Any, route: _Route) -> RequestSample:
    arrival, first, finished = output.arrival_time, output.first_token_time, output.finished_time
    finished = finished if finished is not None else time.monotonic()
    num_output_tokens = output.num_output_tokens
    first_scheduled = route.seq.first_scheduled_time if route.seq is not None else None
    return RequestSample(
        finish_reason=str(output.finish_reason),
        num_prompt_tokens=output.num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        ttft_s=first - arrival if first is not None else None,
        tpot_s=(finished - first) / (num_output_tokens - 1)
        if first is not None and num_output_tokens > 1
        else None,
        e2e_s=finished - arrival,
        queue_wait_s=first_scheduled - arrival if first_scheduled is not None else None,
    )


def _final_event(output: Any, route: _Route) -> dict[str, Any]:
    ttft = output.first_token_time - output.arrival_time if output.first_token_time is not None else None
    total = (output.finished_time or time.monotonic()) - output.arrival_time
    return {
        "finish_reason": str(output.finish_reason),
        "usage": {
            "prompt_tokens": output.num_prompt_tokens,
            "completion_tokens": output.num_output_tokens,
            "total_tokens": output.num_prompt_tokens + output.num_output_tokens,
            "cached_prompt_tokens": output.num_cached_prompt_tokens,
        },
        "timings": {"ttft_s": round(ttft, 6) if ttft is not None else None, "total_s": round(total, 6)},
    }


def _error_event(error_type: str, message: str) -> dict[str, Any]:
    return {"finish_reason": "error", "error": {"type": error_type, "message": message}}
