"""A replica's model thread: the engine runs here step after step (take the inbox, admit, schedule ->
forward -> sample, hand the events to the outbox, record the step) for as long as it holds work, and sleeps
only when it holds none. The engine is not thread-safe: nothing else touches it (the preparing thread only
reads its tokenizer). It used to be one executor call per step from the event loop, with the sends awaited
in between: on a loaded 2-core machine the model sat idle ~1.4 ms a step for two thread hand-offs and a
Redis round trip (docs/architecture.md, "The engine on a thread of its own").

A version of a non-generative model (an embedding model, a classifier) runs the same loop over an
EncoderEngine (serving/engine/encoder.py): its inputs wait in a dynamic batcher, and the thread sleeps
until the engine says a batch is due (full, or its oldest input has waited its delay) or a new arrival
wakes it. A request's one result is its final event: the vectors in base64."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from serving.replica.faults import ArmedFaults
from serving.replica.inbox import Inbox, Submission
from serving.replica.load_report import LoadReport
from serving.replica.outbox import Outbox
from serving.replica.preparer import Preparer
from serving.replica.queue_timeout import QueueTimeout
from serving.replica.step_result import (
    Arrival,
    Route,
    StepResult,
    error_sample,
    failure_message,
    final_event,
    request_sample,
    token_events,
)
from serving.telemetry.recorder import MetricsRecorder, RequestSample, StepSample
from serving.transport.protocol import (
    INJECTED_FAULT,
    KEEPALIVE_S,
    REPLICA_FAILED,
    REPLICA_UNAVAILABLE,
    accepted_event,
    error_event,
    keepalive_event,
)

logger = logging.getLogger(__name__)

# Failed steps in a row after which the model thread probes its device (Engine.probe): a device that
# fails the probe too is broken (a sticky CUDA error), and the replica fails rather than stay ready and
# fail every request. A request that fails every step it is in fails only its own steps: the probe,
# which holds none of them, passes, and the replica serves on.
PROBE_AFTER_FAILED_STEPS = 3


class DeviceFailed(RuntimeError):
    """The model thread's end when its device fails a probe (PROBE_AFTER_FAILED_STEPS)."""


class ModelLoop:
    def __init__(
        self,
        *,
        inbox: Inbox,
        preparer: Preparer,
        outbox: Outbox,
        metrics: MetricsRecorder,
        load_report: LoadReport,
        faults: ArmedFaults,
        replica_id: str,
    ) -> None:
        self._inbox = inbox
        self._preparer = preparer
        self._outbox = outbox
        self._metrics = metrics
        self._report = load_report
        self._faults = faults
        self._replica_id = replica_id
        self.engine: Any = None  # set once loaded, before run()
        self.routes: dict[str, Route] = {}  # every request the engine holds
        # Monotonic, while a step runs (from taking the inbox to recording it): the watchdog reads it.
        self.step_started_at: float | None = None
        self.is_abandoned = False  # the watchdog took the step for hung (abandon())
        self._keepalive_due = time.monotonic() + KEEPALIVE_S
        self._queue_timeout = QueueTimeout()

    def run(self) -> None:
        """Until stopped: take the inbox, step, hand the events over, record the step's stats and metrics,
        and go straight on to the next step while the loop sends the events."""
        engine = self.engine
        num_taken = 0  # inbox items taken, all told: the outbox compares it with the inbox's num_queued
        num_failed_in_a_row = 0
        while True:
            self.step_started_at = None
            taken = self._inbox.take(engine.seconds_until_ready, self._outbox.is_loop_closed)
            if taken is None:
                return
            self.step_started_at = time.monotonic()
            num_taken += len(taken)
            broken: Exception | None = None  # the device's failure, which the probe confirmed
            # Before the step: no forward pass for requests that are ending.
            ended = self._end_all_if_asked()
            try:
                result = self._step(taken.submissions, taken.aborts)
                if result.model_time_s is not None:  # a forward pass ran, not only admissions or aborts
                    num_failed_in_a_row = 0
            except Exception as exc:
                # A failed forward pass fails the requests in it; the replica keeps serving the others
                # and new ones. A failure anywhere else may have left any request half done: all fail.
                logger.exception("replica %s: engine step failed", self._replica_id)
                # engine.StepFailed names the requests of the failed forward pass; anything else, all.
                result = self.fail(failure_message(exc), getattr(exc, "request_ids", None))
                num_failed_in_a_row += 1
                if num_failed_in_a_row >= PROBE_AFTER_FAILED_STEPS:
                    num_failed_in_a_row = 0
                    broken = self._probe()
            if self.is_abandoned:  # a step the watchdog gave up on came back: its requests have ended
                return
            if ended is not None:
                result.merge_events(ended)
            if broken is not None:
                # The replica's failure, not the requests': a gateway retries those that have no token
                # yet on another replica, and its breaker counts it (dispatch.REPLICA_FAILURES).
                failed = self.fail(
                    f"the replica's device failed ({type(broken).__name__}); try again",  # text: in the log
                    error_type=REPLICA_UNAVAILABLE,
                )
                result.merge_events(failed)
            is_engine_empty = not engine.has_unfinished()
            # Recording fails nothing: the step itself went well, and its requests go on.
            with _logged_failure("replica %s: could not record a step's metrics", self._replica_id):
                if result.ended:  # before the events: a client that saw its stream end finds it counted
                    self._metrics.record(requests=result.ended)
            # Then the tokens: the stats and the step's sample are ~0.1 ms a step no token waits for.
            self._outbox.emit(result)
            with _logged_failure("replica %s: could not record a step's stats", self._replica_id):
                self._account(result)
            if is_engine_empty:  # after the account, so whoever waits for idle reads the final stats
                self._outbox.emit(StepResult(), is_engine_empty=True, num_taken=num_taken)
            if broken is not None:  # its requests have their errors: the thread ends, and the replica fails
                raise DeviceFailed(f"its device failed a probe after failed steps: {broken!r}") from broken

    def fail(
        self, message: str, request_ids: list[str] | None = None, *, error_type: str = "internal_error"
    ) -> StepResult:
        """End `request_ids` (None: every request held) with an error of `error_type`."""
        failed = list(self.routes) if request_ids is None else [r for r in request_ids if r in self.routes]
        return self._end(
            {request_id: self.routes.pop(request_id) for request_id in failed}, message, error_type
        )

    def abandon(self, message: str) -> StepResult:
        """The watchdog's end of a hung step, on the event loop's thread: every request held ends with
        `message` (a gateway retries one that has no token yet elsewhere), and the model thread, should
        its step ever return, returns without a word. The engine is not touched: the hung thread is in
        it. The routes are swapped out whole, not popped one by one, in case that step returns meanwhile.
        (A step that returns in the instant this runs may still emit its events; the gateway drops those
        of a request that has ended.)"""
        self.is_abandoned = True
        routes, self.routes = self.routes, {}
        return self._end(routes, message, REPLICA_UNAVAILABLE, abort=False)

    def _end(
        self, routes: dict[str, Route], message: str, error_type: str, *, abort: bool = True
    ) -> StepResult:
        """Each of `routes` ends with an error event, is counted, and (`abort`) leaves the engine."""
        result, samples = StepResult(), []
        for request_id, route in routes.items():
            result.add(route, request_id, error_event(error_type, message))
            if abort:
                with contextlib.suppress(Exception):
                    self.engine.abort(request_id)
            # replica_unavailable (the device failed, a drain ran out, a step hung) is a rejection the
            # metrics leave to the gateway while the request has no token: it retries it elsewhere. One
            # whose stream it had begun ends in an error its client sees, which the version's error rate
            # must count.
            has_begun = route.last_token_at is not None
            counted_as = REPLICA_FAILED if error_type == REPLICA_UNAVAILABLE and has_begun else error_type
            samples.append(error_sample(counted_as, route))
        self._metrics.record(requests=samples)
        return result

    def _end_all_if_asked(self) -> StepResult | None:
        """Inbox.end_all() (a drain ran past its deadline): every request held ends with its message."""
        message = self._inbox.end_message
        if message is None or not self.routes:
            return None
        logger.warning(
            "replica %s: %s; ending the %d requests it still holds",
            self._replica_id,
            message,
            len(self.routes),
        )
        return self.fail(message, error_type=REPLICA_UNAVAILABLE)

    def _probe(self) -> Exception | None:
        """Engine.probe: None when the device works, else what it raised."""
        try:
            self.engine.probe()
        except Exception as exc:
            logger.error("replica %s: the device failed its probe: %r", self._replica_id, exc)
            return exc
        logger.warning(
            "replica %s: %d steps failed in a row but the device passed its probe: serving on",
            self._replica_id,
            PROBE_AFTER_FAILED_STEPS,
        )
        return None

    def _step(self, submissions: list[Submission], aborts: list[str]) -> StepResult:
        engine = self.engine
        result = StepResult()
        ended: list[RequestSample] = []  # this step's, handed to the result that goes out last
        for submission in submissions:
            arrival = submission if isinstance(submission, Arrival) else self._preparer.prepare(submission)
            self._admit(arrival, result, ended)
        # After the admissions: a request and its abort can come in one inbox (a client that left while
        # its prompt was being prepared), and the abort must find it.
        for request_id in aborts:
            if self.routes.pop(request_id, None) is not None:
                engine.abort(request_id)
                ended.append(RequestSample("abort"))
        self._queue_timeout.expire(engine, self.routes, result, ended)
        if ended:
            # Counted now, before their events go out: a forward pass that fails below replaces this
            # step's result with its failures, and these would be lost from the counts.
            with _logged_failure("replica %s: could not record a step's metrics", self._replica_id):
                self._metrics.record(requests=ended)
            ended = []
        if result.events_by_inbox:
            # One more message per inbox, and only for steps that admit something: sent during the
            # forward pass (not by this thread, which has the pass to start), and the gateway then
            # starts its response while it runs.
            self._outbox.emit(result, soon=True)
            result = StepResult()
        model_time_s: float | None = None
        itl_s: list[float] = []
        if engine.seconds_until_ready() == 0:
            self._report.recent_steps.begin(time.monotonic())
            started = time.perf_counter()
            try:
                if self._faults.step_delay_s:
                    time.sleep(
                        self._faults.step_delay_s
                    )  # injected: a slow model, so it counts as model time
                outputs = engine.step()
            except BaseException:
                self._report.recent_steps.cancel()  # or an idle replica would read as busy with it for ever
                raise
            model_time_s = time.perf_counter() - started
            now = time.monotonic()
            finished: list[str] = []
            for output in outputs:
                route = self.routes.get(output.request_id)
                if route is None:
                    continue
                if output.new_token_ids:
                    if route.last_token_at is not None:
                        itl_s.append(now - route.last_token_at)
                    route.last_token_at = now
                for event in token_events(output):
                    result.add(route, output.request_id, event)
                if output.is_finished:
                    result.add(route, output.request_id, final_event(output, route))
                    ended.append(request_sample(output, route))
                    finished.append(output.request_id)
            # Only once every event of the step is built: should one raise (an encoder's vectors, say),
            # fail() still finds each request of the step, those that finished in it too, and ends it
            # with an error instead of leaving its client to time out.
            for request_id in finished:
                del self.routes[request_id]
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
        for request_id, route in self.routes.items():
            if route.wants_keepalives and request_id not in result.events_by_inbox.get(route.reply_to, {}):
                result.add(route, request_id, keepalive_event())

    def _account(self, result: StepResult) -> None:
        """What the heartbeat reports, and the step's sample."""
        stats = self.engine.stats()
        self._report.account(stats, result.model_time_s, engine=self.engine, ended=len(result.ended))
        if result.model_time_s is None:
            return
        step = StepSample(
            model_time_s=result.model_time_s,
            batch_size=stats.num_scheduled_seqs,
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            kv_cache_usage=stats.kv_cache_usage,
            itl_s=result.itl_s,
            num_adapters=len(stats.adapters_resident) if hasattr(stats, "adapters_resident") else None,
        )
        batch = getattr(self.engine, "last_batch", None)  # an encoder engine's dynamic batch
        if batch is not None:
            step.close_reason, step.fill_time_s = str(batch.reason), batch.fill_time_s
        self._metrics.record(step=step)

    def _admit(self, arrival: Arrival, result: StepResult, ended: list[RequestSample]) -> None:
        engine = self.engine
        request_id, route = arrival.request_id, arrival.route
        route.tier = arrival.tier  # its samples' service tier, from here on (error_sample, request_sample)
        end_message = self._inbox.end_message
        if end_message is not None:  # prepared while the drain ran out: the replica is going away
            result.add(route, request_id, error_event(REPLICA_UNAVAILABLE, end_message))
            ended.append(RequestSample("error", error_type=REPLICA_UNAVAILABLE))
            return
        if arrival.error is not None:
            result.add(route, request_id, arrival.error)
            ended.append(error_sample(arrival.error["error"]["type"], route))
            return
        try:
            engine.add_request(
                request_id,
                arrival.prompt_ids,
                arrival.params,
                tenant_id=arrival.tenant,
                cache_group=arrival.cache_group,
                arrival_time=time.monotonic() - max(0.0, time.time() - route.submitted_at),
                tier=arrival.tier,
                limits=arrival.limits,
                **(
                    {"adapter": arrival.adapter} if arrival.adapter is not None else {}
                ),  # an encoder has none
            )
        except (TypeError, ValueError, KeyError) as exc:
            result.add(route, request_id, error_event("invalid_request_error", str(exc)))
            ended.append(RequestSample("error", error_type="invalid_request_error"))
            return
        except Exception:
            # This request fails alone; raised further it would fail the whole step and drop the
            # acceptances already made in it.
            logger.exception("replica %s: could not admit request %s", self._replica_id, request_id)
            with contextlib.suppress(Exception):
                engine.abort(request_id)
            result.add(route, request_id, error_event("internal_error", "the replica could not admit it"))
            ended.append(error_sample("internal_error", route))
            return
        num_prompt_tokens = arrival.num_prompt_tokens
        result.add(route, request_id, accepted_event(num_prompt_tokens))
        if self._faults.fails_admission():
            engine.abort(request_id)
            result.add(
                route, request_id, error_event(INJECTED_FAULT, "injected fault (fault injection is on)")
            )
            ended.append(error_sample(INJECTED_FAULT, route, num_prompt_tokens=num_prompt_tokens))
            return
        route.seq = engine.sequence(request_id)
        self.routes[request_id] = route


@contextlib.contextmanager
def _logged_failure(message: str, *args: object) -> Iterator[None]:
    try:
        yield
    except Exception:
        logger.exception(message, *args)
