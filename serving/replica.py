"""A replica: one model version loaded once, serving requests that arrive on its channel.

Embedded mode runs replicas as tasks on the server's event loop, with model work in a one-thread
executor so the loop stays free for I/O. For now each replica serves with the naive generator, one
request at a time; the engine replaces it (issue 2 of the engine work)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from registry import artifacts
from registry.selectors import VersionRef
from serving.streams import STEP_MESSAGE

logger = logging.getLogger(__name__)

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


class Replica:
    def __init__(self, ref: VersionRef, *, layer: Any) -> None:
        self.ref = ref
        self.replica_id = uuid.uuid4().hex[:12]
        self.state = ReplicaState.LOADING
        self.channel_name = f"{replica_channel_prefix(ref)}{self.replica_id}"
        self.error: str | None = None
        self._layer = layer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replica-{ref.version}")
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued, nothing running
        self._aborted: set[str] = set()
        self._outbox: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._generator: Any = None
        self.num_running = 0
        self.started_at = time.monotonic()
        self._settled = asyncio.Event()  # set once loading ended, ready or failed

    @property
    def num_queued(self) -> int:
        return len(self._pending)

    @property
    def load(self) -> int:
        return self.num_queued + self.num_running

    @property
    def is_ready(self) -> bool:
        return self.state is ReplicaState.READY

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._generator = await loop.run_in_executor(self._executor, self._load)
        except Exception as exc:
            self.state = ReplicaState.FAILED
            self.error = str(exc)
            logger.error("replica %s:%s failed to load: %s", self.ref.model_name, self.ref.version, exc)
            self._settled.set()
            return
        self.state = ReplicaState.READY
        self._settled.set()
        for coro, name in ((self._listen(), "listen"), (self._work(), "work"), (self._send(), "send")):
            self._tasks.append(loop.create_task(coro, name=f"replica-{self.replica_id}-{name}"))
        logger.info("replica %s:%s ready on %s", self.ref.model_name, self.ref.version, self.channel_name)

    async def wait_loaded(self) -> bool:
        """Wait until loading has ended; True when the replica is ready."""
        await self._settled.wait()
        return self.is_ready

    async def wait_idle(self) -> None:
        """Until nothing is queued or running (used by drain, and by tests after an abort)."""
        await self._idle.wait()

    def _load(self) -> Any:
        from serving.engine.naive import NaiveGenerator

        path = Path(self.ref.artifact_uri)
        artifacts.verify(path, expected_files=self.ref.files, expected_sha256=self.ref.sha256)
        generator = NaiveGenerator(path)
        # Warm-up: the first forward pass allocates and initialises kernels; do it before ready.
        from serving.engine.sequence import SamplingParams

        generator.generate(generator.encode("warm up"), SamplingParams(max_tokens=2, temperature=0.0))
        return generator

    async def stop(self) -> None:
        self.state = ReplicaState.STOPPED
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._executor.shutdown(wait=False, cancel_futures=True)

    def drain(self) -> None:
        self.state = ReplicaState.DRAINING

    async def _listen(self) -> None:
        while True:
            message = await self._layer.receive(self.channel_name)
            if message.get("type") == SUBMIT:
                if self.state is not ReplicaState.READY:
                    self._reply(
                        message["reply_to"],
                        message["request_id"],
                        [_error_event("replica_unavailable", "the replica is draining")],
                    )
                    continue
                self._pending.append(message)
                self._idle.clear()
                self._wakeup.set()
            elif message.get("type") == ABORT:
                self._aborted.add(message["request_id"])
                self._pending = collections.deque(
                    m for m in self._pending if m["request_id"] != message["request_id"]
                )

    def _reply(self, reply_to: str, request_id: str, events: list[dict[str, Any]]) -> None:
        self._outbox.put_nowait(
            (reply_to, {"type": STEP_MESSAGE, "items": [{"request_id": request_id, "events": events}]})
        )

    async def _send(self) -> None:
        # One sender keeps messages in the order they were produced.
        while True:
            channel, message = await self._outbox.get()
            try:
                await self._layer.send(channel, message)
            except Exception:
                logger.exception("replica %s: could not deliver to %s", self.replica_id, channel)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._idle.clear()
            message = self._pending.popleft()
            self.num_running = 1
            try:
                await loop.run_in_executor(self._executor, self._serve_one, message, loop)
            except Exception as exc:
                logger.exception("replica %s: request failed", self.replica_id)
                self._reply(
                    message["reply_to"], message["request_id"], [_error_event("internal_error", str(exc))]
                )
            finally:
                self.num_running = 0
                self._aborted.discard(message["request_id"])

    def _serve_one(self, message: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
        """Runs on the model thread; hands events to the loop without blocking on it."""
        from serving.engine.sequence import SamplingParams

        request_id, reply_to = message["request_id"], message["reply_to"]

        def emit(events: list[dict[str, Any]]) -> None:
            loop.call_soon_threadsafe(self._reply, reply_to, request_id, events)

        if request_id in self._aborted:
            return
        generator = self._generator
        try:
            params = SamplingParams(**{**message["params"], "stop": tuple(message["params"].get("stop", ()))})
            text = message.get("input")
            if text is None:
                from serving.engine.chat import render_chat_prompt

                text = render_chat_prompt(generator.tokenizer, message["messages"])
            prompt_ids = generator.encode(text)
            generator.check(prompt_ids, params)
        except (TypeError, ValueError) as exc:
            emit([_error_event("invalid_request_error", str(exc))])
            return
        emit([{"accepted": True, "num_prompt_tokens": len(prompt_ids)}])
        queued_s = max(0.0, time.time() - message.get("submitted_at", time.time()))

        def on_token(token_id: int, index: int, delta: str) -> bool:
            emit([{"token": delta, "index": index}])
            return request_id not in self._aborted

        result = generator.generate(
            prompt_ids, params, on_token, should_abort=lambda: request_id in self._aborted
        )
        emit(
            [
                {
                    "finish_reason": str(result.finish_reason),
                    "usage": {
                        "prompt_tokens": result.num_prompt_tokens,
                        "completion_tokens": len(result.output_token_ids),
                        "total_tokens": result.num_prompt_tokens + len(result.output_token_ids),
                    },
                    "timings": {
                        "queue_s": round(queued_s, 6),
                        "ttft_s": round(result.ttft_s or 0.0, 6),
                        "total_s": round(result.total_s, 6),
                    },
                }
            ]
        )


def _error_event(error_type: str, message: str) -> dict[str, Any]:
    return {"finish_reason": "error", "error": {"type": error_type, "message": message}}
