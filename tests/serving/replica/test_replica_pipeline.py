"""The replica's two threads: the model thread steps on while the event loop sends the last step's
events, and stops when the loop falls MAX_UNSENT hand-overs behind. The sends are held here by a reply
layer that waits to be let go, as a slow Redis connection would. On Redis the model thread publishes
the steps itself."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.layers import InMemoryChannelLayer

from serving.replica.replica import Replica
from serving.transport.channel_layers import StepPubSubChannelLayer
from serving.transport.protocol import ABORT, SUBMIT, Submit
from serving.transport.reply_hub import ReplyHub

pytestmark = pytest.mark.django_db(transaction=True)

INBOX = "switchyard.inbox.test"


class HeldReplies:
    """A reply layer whose sends wait until `let_go()`; it keeps every message in order."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._go = asyncio.Event()

    def let_go(self) -> None:
        self._go.set()

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        assert channel == INBOX
        await self._go.wait()
        self.messages.append(message)

    def events(self, request_id: str) -> list[dict[str, Any]]:
        return [
            event
            for message in self.messages
            for item in message["items"]
            if item["request_id"] == request_id
            for event in item["events"]
        ]


async def _started_replica(replies: HeldReplies) -> tuple[Replica, InMemoryChannelLayer]:
    from registry.selectors import version_ref

    layer = InMemoryChannelLayer()
    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v1")
    replica = Replica(ref, layer=layer, replies=replies, torch_threads=1)
    await replica.start()
    assert replica.is_ready, replica.error
    return replica, layer


async def _replica_sending_at_once() -> tuple[Replica, InMemoryChannelLayer, HeldReplies]:
    """A started replica whose sends are not held back."""
    replies = HeldReplies()
    replies.let_go()
    replica, layer = await _started_replica(replies)
    return replica, layer, replies


async def _submit(
    layer: InMemoryChannelLayer,
    replica: Replica,
    request_id: str,
    max_tokens: int,
    reply_to: str = INBOX,
    **fields: Any,
) -> None:
    await layer.send(
        replica.channel_name,
        {
            "type": SUBMIT,
            "request_id": request_id,
            "reply_to": reply_to,
            "input": "once upon a time",
            "params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            **fields,
        },
    )


def _watch_steps(replica: Replica) -> tuple[threading.Event, list[int]]:
    """An event set when a step finishes a sequence, and the number of steps run so far."""
    finished = threading.Event()
    num_steps = [0]
    step = replica.engine.step

    def watched() -> Any:
        outputs = step()
        num_steps[0] += 1
        if any(output.is_finished for output in outputs):
            finished.set()
        return outputs

    replica.engine.step = watched
    return finished, num_steps


def _assert_one_whole_stream(events: list[dict[str, Any]], num_tokens: int) -> None:
    assert events[0]["accepted"] is True
    tokens = [e for e in events if "token" in e]
    assert [e["index"] for e in tokens] == list(range(num_tokens))
    terminal = [e for e in events if "finish_reason" in e]
    assert len(terminal) == 1 and events[-1] is terminal[0]
    assert terminal[0]["finish_reason"] == "length"


async def test_the_engine_runs_a_request_to_its_end_while_the_sends_are_held(registered_model) -> None:
    replies = HeldReplies()
    replica, layer = await _started_replica(replies)
    try:
        finished, _ = _watch_steps(replica)
        await _submit(layer, replica, "r1", max_tokens=12)
        # Nothing has been sent, not even the acceptance, and the model thread finishes regardless.
        assert await asyncio.to_thread(finished.wait, 30)
        assert replies.messages == []
        assert not replica.outbox.is_idle  # idle waits for the sends: a drain must not lose them
        replies.let_go()
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        _assert_one_whole_stream(replies.events("r1"), num_tokens=12)
        stats = replica.engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    finally:
        replies.let_go()
        await replica.stop()


async def test_the_heartbeat_says_how_long_steps_take_and_what_one_sequence_costs(registered_model) -> None:
    replica, layer, _ = await _replica_sending_at_once()
    try:
        quiet = replica.heartbeat()
        # Measured at warm-up, before any request: the fixed cost of a step.
        assert quiet.base_step_s > 0 and quiet.step_s == 0.0
        finished, _ = _watch_steps(replica)
        await _submit(layer, replica, "r1", max_tokens=12)
        assert await asyncio.to_thread(finished.wait, 30)
        beat = replica.heartbeat()
        # 13 steps (a prefill, then a token a step), and a share of the time since ready spent on them
        assert beat.step_s > 0 and 0 < beat.step_rate * beat.step_s <= 1

        # The model slows down after its warm-up (here: 20 ms more a step, as a busier device would):
        # the base follows its steps of one sequence, not the warm-up's figure.
        assert quiet.base_step_s < 0.02
        replica.armed_faults.step_delay_s = 0.02
        finished, _ = _watch_steps(replica)
        await _submit(layer, replica, "r2", max_tokens=30)  # more slow steps than fast ones before
        assert await asyncio.to_thread(finished.wait, 30)
        assert replica.heartbeat().base_step_s >= 0.02
    finally:
        await replica.stop()


async def test_a_step_that_fails_leaves_no_step_running(registered_model, monkeypatch) -> None:
    replica, layer, replies = await _replica_sending_at_once()
    try:

        def fail() -> list[Any]:
            raise RuntimeError("a bug in the forward pass")

        monkeypatch.setattr(replica.engine, "step", fail)
        await _submit(layer, replica, "r1", max_tokens=4)
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        assert replies.events("r1")[-1]["finish_reason"] == "error"
        # A whole window on, the replica reads as idle, not as busy with a step that never ended.
        assert replica.load_report.recent_steps.read(time.monotonic() + 10) == (0.0, 0.0)
    finally:
        await replica.stop()


async def _replica_with_a_local_hub(
    replies: HeldReplies,
) -> tuple[Replica, InMemoryChannelLayer, ReplyHub, asyncio.Queue[dict[str, Any]]]:
    """A started replica whose process has a reply hub (embedded), and the hub's queue for request r1."""
    from registry.selectors import version_ref

    layer = InMemoryChannelLayer()
    hub = ReplyHub(layer)
    hub.channel_name = INBOX  # as start() would name it, without its receiving task
    queue = hub.open("r1", on_backlog=lambda: False)
    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v1")
    replica = Replica(ref, layer=layer, replies=replies, torch_threads=1, local_hub=hub)
    await replica.start()
    return replica, layer, hub, queue


async def _read_to_the_end(queue: asyncio.Queue[dict[str, Any]]) -> list[dict[str, Any]]:
    events = [await asyncio.wait_for(queue.get(), timeout=30)]
    while "finish_reason" not in events[-1]:
        events.append(await asyncio.wait_for(queue.get(), timeout=30))
    return events


async def test_steps_for_the_local_hubs_inbox_are_handed_to_it_not_sent_through_the_layer(
    registered_model,
) -> None:
    replies = HeldReplies()  # never let go: a step sent through it would never arrive
    replica, layer, _, queue = await _replica_with_a_local_hub(replies)
    try:
        await _submit(layer, replica, "r1", max_tokens=6)
        _assert_one_whole_stream(await _read_to_the_end(queue), num_tokens=6)
        assert replies.messages == []
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
    finally:
        replies.let_go()
        await replica.stop()


async def test_embedded_a_stream_starts_on_the_loop_before_the_forward_pass_that_follows(
    registered_model, monkeypatch
) -> None:
    """The acceptance is delivered before the prefill runs, and the first token before the next step."""
    from serving.replica import outbox as outbox_module

    monkeypatch.setattr(outbox_module, "START_DELIVERY_WAIT_S", 30.0)  # as long as the loop takes
    replica, layer, hub, queue = await _replica_with_a_local_hub(HeldReplies())
    delivered: list[dict[str, Any]] = []  # every event the hub was handed, on the loop
    delivered_at_step: list[int] = []  # how many of them there were when each step began
    deliver, step = hub.deliver, replica.engine.step

    def watched_deliver(message: dict[str, Any]) -> None:
        delivered.extend(event for item in message["items"] for event in item["events"])
        deliver(message)

    def watched() -> Any:
        delivered_at_step.append(len(delivered))
        return step()

    hub.deliver = watched_deliver  # type: ignore[method-assign]

    replica.engine.step = watched
    try:
        await _submit(layer, replica, "r1", max_tokens=4)
        _assert_one_whole_stream(await _read_to_the_end(queue), num_tokens=4)
        # The acceptance was delivered before the prefill, the first token before the second step.
        assert delivered_at_step[:2] == [1, 2]
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
    finally:
        await replica.stop()


async def test_the_model_thread_waits_when_the_loop_falls_behind(registered_model, monkeypatch) -> None:
    from serving.replica import outbox as outbox_module

    monkeypatch.setattr(outbox_module, "MAX_UNSENT", 3)
    replies = HeldReplies()
    replica, layer = await _started_replica(replies)
    try:
        finished, num_steps = _watch_steps(replica)
        blocked = threading.Event()
        semaphore = replica.outbox._unsent

        class Watched:
            def acquire(self, timeout: float) -> bool:
                if semaphore.acquire(blocking=False):
                    return True
                blocked.set()
                return semaphore.acquire(timeout=timeout)

            def release(self) -> None:
                semaphore.release()

        replica.outbox._unsent = Watched()  # type: ignore[assignment]
        await _submit(layer, replica, "r1", max_tokens=40)
        assert await asyncio.to_thread(blocked.wait, 30)
        # The acceptance and two steps wait to be sent; the third step's events wait in the model thread.
        assert num_steps[0] == 3 and not finished.is_set()
        replies.let_go()
        assert await asyncio.to_thread(finished.wait, 30)
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        _assert_one_whole_stream(replies.events("r1"), num_tokens=40)
    finally:
        replies.let_go()
        await replica.stop()


async def test_a_request_that_cannot_be_admitted_fails_alone(registered_model) -> None:
    replica, layer, replies = await _replica_sending_at_once()
    encode = replica.engine.encode

    def encode_or_fail(text: str) -> Any:
        if text == "break me":
            raise RuntimeError("a bug in admission")
        return encode(text)

    replica.engine.encode = encode_or_fail
    add_request = replica.engine.add_request

    def add_or_fail(request_id: str, *args: Any, **kwargs: Any) -> Any:
        if request_id == "bad-add":
            raise RuntimeError("a bug in the engine's admission")
        return add_request(request_id, *args, **kwargs)

    replica.engine.add_request = add_or_fail
    try:
        await layer.send(
            replica.channel_name,
            {"type": SUBMIT, "request_id": "bad", "reply_to": INBOX, "input": "break me", "params": {}},
        )
        await _submit(layer, replica, "bad-add", max_tokens=4)
        await _submit(layer, replica, "good", max_tokens=4)
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        failed = {
            "finish_reason": "error",
            "error": {"type": "internal_error", "message": "the replica could not admit it"},
        }
        assert replies.events("bad") == replies.events("bad-add") == [failed]
        _assert_one_whole_stream(replies.events("good"), num_tokens=4)
    finally:
        await replica.stop()


async def test_a_prompt_being_tokenized_does_not_stop_the_running_sequences(registered_model) -> None:
    """Tokenizing happens off the model thread: a prompt whose tokenization hangs (a very long one, say)
    holds up only itself, and is served once it is ready. On the model thread it stopped every step."""
    replica, layer, replies = await _replica_sending_at_once()
    finished, _ = _watch_steps(replica)
    step, stepped = replica.engine.step, threading.Event()

    def step_and_tell() -> Any:
        outputs = step()
        stepped.set()
        return outputs

    replica.engine.step = step_and_tell
    encode = replica.engine.encode
    in_tokenizer, release = threading.Event(), threading.Event()
    short_was_running: list[bool] = []

    def slow_encode(text: str) -> Any:
        if text == "a long prompt":
            short_was_running.append(not finished.is_set())
            in_tokenizer.set()
            assert release.wait(30)
        return encode(text)

    replica.engine.encode = slow_encode
    try:
        await _submit(layer, replica, "short", max_tokens=64)
        assert await asyncio.to_thread(stepped.wait, 30)  # "short" is running
        await layer.send(
            replica.channel_name,
            {
                "type": SUBMIT,
                "request_id": "long",
                "reply_to": INBOX,
                "input": "a long prompt",
                "params": {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True},
            },
        )
        assert await asyncio.to_thread(in_tokenizer.wait, 30)
        assert short_was_running == [True]
        assert await asyncio.to_thread(finished.wait, 30)  # with "long" still in the tokenizer
        assert replies.events("long") == []
        release.set()
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        _assert_one_whole_stream(replies.events("short"), num_tokens=64)
        _assert_one_whole_stream(replies.events("long"), num_tokens=3)
    finally:
        release.set()
        await replica.stop()


async def test_an_abort_that_reaches_the_engine_with_its_submission_still_aborts_it(registered_model) -> None:
    """A client that leaves while its prompt is being prepared: the submission and the abort can come
    to the model thread in one inbox, and the request must not run."""
    replica, layer, replies = await _replica_sending_at_once()
    step, in_step, release = replica.engine.step, threading.Event(), threading.Event()

    def held_step() -> Any:
        in_step.set()
        assert release.wait(30)
        return step()

    put, abort_put = replica.preparer.put, threading.Event()

    def put_and_tell(submission: Any, abort: str | None) -> None:
        put(submission, abort)
        if abort == "gone":
            abort_put.set()

    replica.engine.step = held_step
    replica.preparer.put = put_and_tell  # type: ignore[method-assign]
    try:
        await _submit(layer, replica, "runner", max_tokens=4)
        assert await asyncio.to_thread(in_step.wait, 30)  # the model thread is inside a step
        await _submit(layer, replica, "gone", max_tokens=8)
        await layer.send(replica.channel_name, {"type": ABORT, "request_id": "gone"})
        assert await asyncio.to_thread(abort_put.wait, 30)  # both wait in the inbox for the next step
        release.set()
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        assert [e for e in replies.events("gone") if "token" in e] == []
        assert replica.engine.stats().num_running == 0
        _assert_one_whole_stream(replies.events("runner"), num_tokens=4)
    finally:
        release.set()
        await replica.stop()


async def test_the_final_event_times_the_wait_before_the_first_forward_pass_from_the_submission(
    registered_model,
) -> None:
    """queue_s counts from the gateway's submission (its wall clock, as ttft_s does), not from when the
    replica got it: here the submission is dated 250 ms back, as a slow hop would leave it."""
    replica, layer, replies = await _replica_sending_at_once()
    try:
        await layer.send(
            replica.channel_name,
            {
                "type": SUBMIT,
                "request_id": "r1",
                "reply_to": INBOX,
                "input": "once upon a time",
                "params": {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True},
                "submitted_at": time.time() - 0.25,
            },
        )
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        events = replies.events("r1")
        _assert_one_whole_stream(events, num_tokens=3)
        timings = events[-1]["timings"]
        assert 0.25 <= timings["queue_s"] < timings["ttft_s"] < timings["total_s"]
    finally:
        await replica.stop()


async def test_metrics_that_cannot_be_recorded_fail_no_request(registered_model) -> None:
    replica, layer, replies = await _replica_sending_at_once()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the metrics")

    replica.metrics.record = broken  # type: ignore[method-assign]
    try:
        await _submit(layer, replica, "r1", max_tokens=4)
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        await _submit(layer, replica, "r2", max_tokens=4)
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        _assert_one_whole_stream(replies.events("r1"), num_tokens=4)
        _assert_one_whole_stream(replies.events("r2"), num_tokens=4)
        assert replica.is_ready
    finally:
        await replica.stop()


async def test_a_failed_forward_pass_fails_its_batch_and_the_waiting_request_runs_on(
    registered_model, settings
) -> None:
    """One running at a time: r2 waits while r1 decodes. A forward pass that fails (out of memory, say)
    loses the requests in it, not the queue behind them."""
    settings.REPLICA_MAX_NUM_SEQS = 1
    replica, layer, replies = await _replica_sending_at_once()
    scheduler, runner = replica.engine.scheduler, replica.engine.runner
    execute = runner.execute
    failures: list[int] = []

    def fails_once_r2_waits(batch: Any, lora: Any = None) -> Any:
        if not failures and scheduler.num_waiting:
            failures.append(scheduler.num_waiting)
            raise RuntimeError("out of memory")
        return execute(batch, lora)

    runner.execute = fails_once_r2_waits
    try:
        await _submit(layer, replica, "r1", max_tokens=1000)
        await _submit(layer, replica, "r2", max_tokens=4)
        await asyncio.wait_for(replica.wait_idle(), timeout=30)
        assert failures == [1]
        r1 = replies.events("r1")
        assert r1[-1] == {
            "finish_reason": "error",
            "error": {
                "type": "internal_error",
                # the kind of failure, not its text (the log has it): "out of memory" stays out
                "message": "the replica failed on this request's step (RuntimeError); try again",
            },
        }
        _assert_one_whole_stream(replies.events("r2"), num_tokens=4)
        assert replica.is_ready and replica.model_loop.routes == {}
        assert replica.engine.stats().kv_cache_usage == 0.0  # r1's blocks freed
    finally:
        await replica.stop()


async def test_an_abort_taken_in_a_step_whose_forward_pass_fails_is_still_counted(
    registered_model, settings
) -> None:
    """The dashboard's and the rollout judge's abort counts must not depend on what the forward pass
    after the abort did."""
    settings.REPLICA_MAX_NUM_SEQS = 1
    replica, layer, replies = await _replica_sending_at_once()
    runner = replica.engine.runner
    execute = runner.execute
    failures: list[str] = []

    def fails_once_r1_has_gone(batch: Any, lora: Any = None) -> Any:
        if not failures and "r1" not in replica.model_loop.routes:  # the step that took r1's abort runs r2
            failures.append("r2")
            raise RuntimeError("out of memory")
        return execute(batch, lora)

    runner.execute = fails_once_r1_has_gone
    aborted_before = replica.metrics.snapshot().totals.counters.get("aborted", 0)
    try:
        await _submit(layer, replica, "r1", max_tokens=1000)
        await _submit(layer, replica, "r2", max_tokens=4)
        await layer.send(replica.channel_name, {"type": ABORT, "request_id": "r1"})
        await asyncio.wait_for(replica.wait_idle(), timeout=30)
        assert failures == ["r2"]
        assert "(RuntimeError)" in replies.events("r2")[-1]["error"]["message"]
        assert replica.metrics.snapshot().totals.counters.get("aborted", 0) == aborted_before + 1
    finally:
        await replica.stop()


def break_the_engine_thread(replica: Any) -> None:
    """Its next step raises, and so does the step's own failure handling: the model thread dies."""

    def broken(*args: object) -> Any:
        raise RuntimeError("a bug")

    replica.engine.step = broken
    replica.model_loop.fail = broken


async def test_a_dead_engine_thread_fails_the_replica_and_a_drain_still_ends(registered_model) -> None:
    from serving.transport.protocol import ReplicaState

    replica, layer, _ = await _replica_sending_at_once()
    break_the_engine_thread(replica)
    try:
        await _submit(layer, replica, "r1", max_tokens=4)
        assert replica._engine_run is not None
        with pytest.raises(RuntimeError, match="a bug"):
            await asyncio.wait_for(replica._engine_run, timeout=10)
        # What run_replica waits on beside SIGTERM, to exit (non-zero) rather than beat "failed" for ever.
        await asyncio.wait_for(replica.wait_engine_ended(), timeout=10)
        replica.drain()
        await asyncio.wait_for(replica.wait_idle(), timeout=10)
        assert replica.state is ReplicaState.FAILED
        assert "the engine thread died" in (replica.error or "")
    finally:
        await replica.stop()


def test_the_engine_thread_ends_when_its_loop_closes_without_a_stop(registered_model) -> None:
    """The interpreter waits for the model thread at exit: a replica whose loop ends without stop()
    (an exception on the way out of run_replica) must not keep the process alive."""
    from registry.selectors import version_ref

    ref = version_ref(model_name="demo-chat", version="v1")
    loop = asyncio.new_event_loop()
    replica = Replica(ref, layer=InMemoryChannelLayer(), replies=HeldReplies(), torch_threads=1)
    loop.run_until_complete(replica.start())
    assert replica.is_ready
    # What asyncio.run does on its way out: cancel what is left, then close the loop.
    for task in replica._tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*replica._tasks, return_exceptions=True))
    loop.close()
    ended = threading.Thread(target=replica._executor.shutdown, kwargs={"wait": True})
    ended.start()
    ended.join(10)
    assert not ended.is_alive()


async def _replica_replying_on_redis(
    redis_url: str,
) -> tuple[Replica, InMemoryChannelLayer, StepPubSubChannelLayer, str]:
    """A replica, not started yet, that takes submissions in memory and publishes its steps on Redis,
    and a gateway's inbox subscribed there."""
    from registry.selectors import version_ref

    replies = StepPubSubChannelLayer(
        hosts=[{"address": redis_url, "socket_timeout": None}], serializer_format="json"
    )
    inbox = await replies.new_channel("switchyard.inbox.")
    layer = InMemoryChannelLayer()
    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v1")
    return Replica(ref, layer=layer, replies=replies, torch_threads=1), layer, replies, inbox


@pytest.mark.redis
async def test_on_redis_the_model_thread_publishes_each_step_itself(registered_model, redis_url) -> None:
    """No hand-over to the event loop on a first token's path: the steps are published from the model
    thread, reach the gateway's inbox whole and in order, and idle (what a drain waits for) comes only
    after the last of them is out."""
    replica, layer, replies, inbox = await _replica_replying_on_redis(redis_url)
    publisher = replica.outbox.step_publisher
    assert publisher is not None
    publishing_threads: set[str] = set()
    publish = publisher.publish

    def watched(channel: str, message: dict[str, Any]) -> None:
        publishing_threads.add(threading.current_thread().name)
        publish(channel, message)

    publisher.publish = watched
    await replica.start()
    assert replica.is_ready, replica.error
    try:
        await _submit(layer, replica, "r1", max_tokens=12, reply_to=inbox)
        await asyncio.wait_for(replica.wait_idle(), timeout=30)
        events: list[dict[str, Any]] = []
        while not any("finish_reason" in e for e in events):
            message = await asyncio.wait_for(replies.receive(inbox), timeout=5)
            events += [e for item in message["items"] if item["request_id"] == "r1" for e in item["events"]]
        _assert_one_whole_stream(events, num_tokens=12)
        # The model thread only (the replica's one executor thread), never the event loop's.
        assert [name.split("_")[0] for name in publishing_threads] == [f"replica-{replica.ref.version}"]
    finally:
        await replica.stop()
        await replies.flush()


@pytest.mark.redis
async def test_on_redis_what_is_left_to_the_publishers_thread_is_out_before_the_replica_is_idle(
    registered_model, redis_url
) -> None:
    """A drain waits for idle and then the process exits: a refusal left to the publisher's thread
    (here one that never runs) must have been written by then."""
    replica, layer, replies, inbox = await _replica_replying_on_redis(redis_url)
    assert replica.outbox.step_publisher is not None
    idle_writer = threading.Thread(target=lambda: None)  # one that has already ended: it writes nothing
    idle_writer.start()
    idle_writer.join()
    replica.outbox.step_publisher._writer = idle_writer
    await replica.start()
    assert replica.is_ready, replica.error
    try:
        await layer.send(
            replica.channel_name,
            {
                "type": SUBMIT,
                "request_id": "too-long",
                "reply_to": inbox,
                "input": "once upon a time",
                "params": {"max_tokens": 10**9, "temperature": 0.0},
            },
        )
        await asyncio.wait_for(replica.wait_idle(), timeout=30)
        message = await asyncio.wait_for(replies.receive(inbox), timeout=5)
        (item,) = message["items"]
        assert item["request_id"] == "too-long"
        assert item["events"][0]["error"]["type"] == "invalid_request_error"
    finally:
        await replica.stop()
        await replies.flush()


@pytest.mark.redis
async def test_on_redis_stopping_a_replica_does_not_block_the_event_loop_on_its_publisher(
    registered_model, redis_url
) -> None:
    """An embedded replica shares its loop with every stream of the server: closing the step publisher
    (joining its writer, reading Redis's last replies) must not hold that loop."""
    replica, _, replies, _ = await _replica_replying_on_redis(redis_url)
    publisher = replica.outbox.step_publisher
    assert publisher is not None
    await replica.start()
    assert replica.is_ready, replica.error
    close_started, loop_ran, waits = threading.Event(), threading.Event(), []
    close = publisher.close

    def slow_close() -> None:
        close_started.set()
        # True once the loop, below, has run meanwhile; on the loop itself this waits out its 5 s.
        waits.append(loop_ran.wait(timeout=5))
        close()

    publisher.close = slow_close
    stopping = asyncio.create_task(replica.stop())
    try:
        async with asyncio.timeout(10):
            while not close_started.is_set():
                await asyncio.sleep(0.01)
        loop_ran.set()
        await stopping
        assert waits == [True]
    finally:
        loop_ran.set()
        await stopping
        await replies.flush()


async def test_an_idle_model_thread_prepares_a_submission_itself_and_a_busy_one_leaves_it_to_the_preparer(
    registered_model,
) -> None:
    """Idle, a request skips the preparing thread's wake-up on its way to its first forward pass; while
    a step runs, the preparing thread tokenizes the next one so that the batch is not held up. Either
    way a bad request gets its error, and a request aborted as it arrives is aborted."""
    replica, layer, replies = await _replica_sending_at_once()
    prepared_on: dict[str, str] = {}
    prepare = replica.preparer.prepare

    def watched(submit: Submit) -> Any:
        prepared_on[submit.request_id] = threading.current_thread().name
        return prepare(submit)

    replica.preparer.prepare = watched  # type: ignore[method-assign]
    accepted = asyncio.Event()
    send = replies.send

    async def watched_send(channel: str, message: dict[str, Any]) -> None:
        await send(channel, message)
        if replies.events("idle"):
            accepted.set()

    replies.send = watched_send  # type: ignore[method-assign]
    try:
        await _model_thread_waiting(replica)
        await _submit(layer, replica, "idle", max_tokens=40)
        await asyncio.wait_for(accepted.wait(), timeout=10)
        await _submit(layer, replica, "busy", max_tokens=2)  # while "idle" is still running
        await asyncio.wait_for(replica.wait_idle(), timeout=30)
        assert prepared_on["idle"] == _model_thread_name(replica)
        assert prepared_on["busy"].endswith("-prep_0")
        _assert_one_whole_stream(replies.events("idle"), num_tokens=40)
        _assert_one_whole_stream(replies.events("busy"), num_tokens=2)

        await _model_thread_waiting(replica)  # idle is declared on the loop, a moment before it waits
        await layer.send(
            replica.channel_name,
            {"type": SUBMIT, "request_id": "bad", "reply_to": INBOX, "input": "x", "params": {"top_p": 7}},
        )
        await _submit(layer, replica, "gone", max_tokens=500)
        await layer.send(replica.channel_name, {"type": ABORT, "request_id": "gone"})
        await asyncio.wait_for(replica.wait_idle(), timeout=30)
        assert prepared_on["bad"] == _model_thread_name(replica)
        assert replies.events("bad")[-1]["error"]["type"] == "invalid_request_error"
        assert len([e for e in replies.events("gone") if "token" in e]) < 500
        stats = replica.engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    finally:
        await replica.stop()


def _model_thread_name(replica: Replica) -> str:
    return f"replica-{replica.ref.version}_0"


async def _model_thread_waiting(replica: Replica) -> None:
    """Until the model thread waits for work with its engine empty. It says so to nobody (a flag under
    the inbox's lock), so this looks every millisecond, for at most 10 s."""
    async with asyncio.timeout(10):
        while True:
            if replica.inbox.is_model_waiting:
                return
            await asyncio.sleep(0.001)


async def test_a_device_that_fails_every_step_and_its_probe_fails_the_replica(
    registered_model, settings
) -> None:
    """A sticky device error (CUDA's illegal memory access, say) fails every call: the replica must not
    stay ready and fail every request routed to it. What it still holds ends as the replica's failure,
    which a gateway retries elsewhere, not the request's."""
    from serving.replica.model_loop import PROBE_AFTER_FAILED_STEPS
    from serving.transport.protocol import ReplicaState

    settings.REPLICA_MAX_NUM_SEQS = 1  # "last" runs alone while "queued" waits behind it
    replica, layer, replies = await _replica_sending_at_once()
    holding, entered, let_go = [False], threading.Event(), threading.Event()

    def device(batch: Any, lora: Any = None) -> Any:
        if holding[0]:  # one pass held, failing, until the test has queued the next two
            holding[0] = False
            entered.set()
            assert let_go.wait(timeout=10)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    replica.engine.runner.execute = device
    try:

        async def taken(send: Any) -> None:
            """Send, and wait until the model thread has taken it (idle is set from the start)."""
            num_queued = replica.inbox.num_queued
            await send
            async with asyncio.timeout(10):
                while replica.inbox.num_queued == num_queued:
                    await asyncio.sleep(0.01)
            await asyncio.wait_for(replica.wait_idle(), timeout=30)

        for i in range(PROBE_AFTER_FAILED_STEPS - 2):
            await taken(_submit(layer, replica, f"r{i}", max_tokens=4))
            assert replies.events(f"r{i}")[-1]["error"]["type"] == "internal_error" and replica.is_ready
            # A pass of the model thread that runs no step (an abort of nothing) is no success.
            await taken(layer.send(replica.channel_name, {"type": ABORT, "request_id": f"gone-{i}"}))
        holding[0] = True
        await _submit(layer, replica, "held", max_tokens=4)
        assert await asyncio.to_thread(entered.wait, 10)
        await _submit(layer, replica, "last", max_tokens=4)
        await _submit(layer, replica, "queued", max_tokens=4)
        async with asyncio.timeout(10):  # both in the inbox, to be taken together once the pass fails
            while len(replica.inbox._submissions) < 2:
                await asyncio.sleep(0.01)
        let_go.set()
        await asyncio.wait_for(replica.wait_engine_ended(), timeout=30)  # run_replica then exits non-zero
        assert replica.state is ReplicaState.FAILED
        assert "failed a probe" in (replica.error or "") and "illegal memory access" in (replica.error or "")
        for request_id in [*(f"r{i}" for i in range(PROBE_AFTER_FAILED_STEPS - 2)), "held", "last"]:
            assert replies.events(request_id)[-1]["error"]["type"] == "internal_error"  # their steps failed
        assert replies.events("queued")[-1]["error"] == {
            "type": "replica_unavailable",
            "message": "the replica's device failed (RuntimeError); try again",
        }
        # The device's own words stay in the log: every tenant with a request in the batch gets them.
        for request_id in [*(f"r{i}" for i in range(PROBE_AFTER_FAILED_STEPS - 2)), "held", "last", "queued"]:
            assert "illegal memory access" not in str(replies.events(request_id))
    finally:
        let_go.set()
        await replica.stop()


async def test_a_request_that_fails_every_step_it_is_in_does_not_fail_a_replica_whose_device_works(
    registered_model,
) -> None:
    """A client retrying a request that always fails (a shape the model cannot take, say): its steps
    fail one after another, but the probe, which holds none of it, passes."""
    from serving.replica.model_loop import PROBE_AFTER_FAILED_STEPS

    replica, layer, replies = await _replica_sending_at_once()
    runner = replica.engine.runner
    execute = runner.execute
    probes = []

    def fails_with_poison(batch: Any, lora: Any = None) -> Any:
        if any(seq.request_id.startswith("poison") for seq in replica.engine.scheduler.running_seqs()):
            raise RuntimeError("the model cannot take this input")
        if batch.num_tokens == 1 and not replica.engine.scheduler.running_seqs():
            probes.append(batch)
        return execute(batch, lora)

    runner.execute = fails_with_poison
    try:
        for i in range(2 * PROBE_AFTER_FAILED_STEPS):
            await _submit(layer, replica, f"poison-{i}", max_tokens=4)
            await asyncio.wait_for(replica.wait_idle(), timeout=30)
            assert replies.events(f"poison-{i}")[-1]["finish_reason"] == "error"
        assert len(probes) == 2 and replica.is_ready
        await _submit(layer, replica, "fine", max_tokens=4)
        await asyncio.wait_for(replica.wait_idle(), timeout=30)
        _assert_one_whole_stream(replies.events("fine"), num_tokens=4)
        assert replica.engine.stats().kv_cache_usage == 0.0  # the probes' blocks given back
    finally:
        await replica.stop()


async def test_requests_waiting_for_a_slot_get_keepalives_when_their_gateway_asks(
    registered_model, settings, monkeypatch
) -> None:
    """One running at a time: r2 and r3 wait behind r1. r2's gateway asked for keepalives and gets them
    between its acceptance and its first token; r3's did not (a gateway older than them would pass one
    on as the stream's end) and gets none."""
    from serving.replica import model_loop as model_loop_module

    settings.REPLICA_MAX_NUM_SEQS = 1
    monkeypatch.setattr(model_loop_module, "KEEPALIVE_S", 0.05)
    replica, layer, replies = await _replica_sending_at_once()
    replica.armed_faults.step_delay_s = 0.02
    try:
        await _submit(layer, replica, "r1", max_tokens=20)
        await _submit(layer, replica, "r2", max_tokens=2, keepalives=True)
        await _submit(layer, replica, "r3", max_tokens=2)
        await asyncio.wait_for(replica.wait_idle(), timeout=30)
        r2 = replies.events("r2")
        first_token = next(i for i, e in enumerate(r2) if "token" in e)
        assert r2[0]["accepted"] and any(e.get("keepalive") for e in r2[1:first_token])
        _assert_one_whole_stream([e for e in r2 if not e.get("keepalive")], num_tokens=2)
        assert not any(e.get("keepalive") for e in replies.events("r3"))
        _assert_one_whole_stream(replies.events("r3"), num_tokens=2)
    finally:
        await replica.stop()


async def test_the_reply_hub_stops_though_its_receive_lost_the_first_cancellation() -> None:
    """A Redis receive can return as if a cancellation had not come (serving/cancelling.py): a hub
    cancelled once would receive on, and a server's shutdown waiting for it would never end."""

    class CancelLosingLayer:
        def __init__(self) -> None:
            self.lost = asyncio.Event()

        async def new_channel(self, prefix: str) -> str:
            return prefix + "x"

        async def receive(self, channel: str) -> dict[str, Any]:
            if not self.lost.is_set():
                try:
                    await asyncio.Event().wait()  # a receive under way when the stop comes
                except asyncio.CancelledError:
                    self.lost.set()  # ... and lost: it returns as if nothing had happened
                    return {"type": "nothing"}
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    layer = CancelLosingLayer()
    hub = ReplyHub(layer)
    await hub.start()
    await asyncio.sleep(0)  # the receive is under way
    stopping = asyncio.ensure_future(hub.stop())
    # asyncio.wait, not wait_for: wait_for's own cancellation at its timeout would cancel the receive a
    # second time, and the stop would seem to have ended by itself.
    done, _ = await asyncio.wait({stopping}, timeout=5)
    assert done == {stopping}, "the stop waits for ever on a receive that lost its cancellation"
    assert layer.lost.is_set()


async def test_a_malformed_submission_is_answered_and_the_replica_serves_on(registered_model) -> None:
    """A submission missing a field the wire requires (its params) gets its error at once, from the loop,
    instead of leaving its gateway to wait out the acceptance timeout; the next one is served."""
    replica, layer, replies = await _replica_sending_at_once()
    try:
        await layer.send(
            replica.channel_name, {"type": SUBMIT, "request_id": "bad", "reply_to": INBOX, "input": "hi"}
        )
        await _submit(layer, replica, "good", max_tokens=3)
        await asyncio.wait_for(replica.wait_idle(), timeout=30)
        (refusal,) = replies.events("bad")
        assert refusal["error"]["type"] == "invalid_request_error"
        assert "malformed submission" in refusal["error"]["message"]
        _assert_one_whole_stream(replies.events("good"), num_tokens=3)
    finally:
        await replica.stop()
