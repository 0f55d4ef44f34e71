"""A request in flight on its replica: the gateway's handle from its submission to its last event.

It picks a replica among the version's candidates (least load, past the circuit breaker), sends the
submission (with its admission, where the quota store can do both in one trip), waits for the replica
to accept, retries once elsewhere when the replica fails before the first token, reads the events from
this process's reply hub (checking the replica's liveness while they stop coming), and on close aborts
what has not finished and settles the quota. docs/architecture.md, "A request's path"."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from channels.exceptions import ChannelFull
from django.conf import settings

from serving.cancelling import raise_if_cancelling
from serving.gateway.aborts import send_abort
from serving.gateway.breaker import breaker
from serving.gateway.cold_start import ColdStartTimedOut, wait_for_a_replica
from serving.gateway.data_plane import DataPlane, ReplicaHandle
from serving.gateway.errors import GatewayError, MaybeSent
from serving.gateway.failures import FailureNote
from serving.gateway.quiet_alarm import QuietAlarm
from serving.gateway.quota import Charge, Ticket
from serving.gateway.quota_store import quota_store
from serving.gateway.router import choose_replica
from serving.gateway.text_capture import TextCapture
from serving.transport.protocol import (
    ACCEPT_TIMEOUT_S,
    INACTIVITY_TIMEOUT_S,
    KEY_REVOKED,
    KEY_REVOKED_MESSAGE,
    NO_READY_REPLICA,
    REPLICA_FAILURES,
    REPLICA_LOST,
    REPLICA_TIMEOUT,
    SERVER_SHUTTING_DOWN,
    SLOW_READER,
    SLOW_READER_MESSAGE,
    TOKENS_LOST,
    TOKENS_LOST_MESSAGE,
    EventKind,
    ReplicaState,
    Submit,
    error_event,
    event_kind,
)

logger = logging.getLogger(__name__)

# A stream that hears nothing this long asks whether its replica still beats (a read of the directory's
# 0.25 s cache): a killed replica's streams end at most STALE_AFTER_S + this after its last beat, inside
# the 2 s docs/reliability.md ("Replica failures") promises.
LIVENESS_CHECK_S = 0.25
_rng = random.Random()


class InFlightRequest:
    """An accepted request on its replica: iterate `events()` to the end, or close it to abort."""

    def __init__(
        self,
        runtime: DataPlane,
        ticket: Ticket | None,  # None: admitted by submit(), or never charged (a shadow copy)
        model_name: str,
        version: str,
        submission: dict[str, Any],
        *,
        cold_start: bool = False,  # the version may have no replica: wait for one to start
        counts_failures: bool = False,  # a client's request to a version with traffic (dispatch())
    ) -> None:
        self._runtime = runtime
        self._cold_start_allowed = cold_start
        self._ticket = ticket
        self.model_name = model_name
        self.version = version
        self._submission = submission
        self.request_id = uuid.uuid4().hex
        self._wire_id = self.request_id  # changes on a retry, so late events of the dead try are dropped
        self._queue: asyncio.Queue[dict[str, Any]] = runtime.hub.open(self._wire_id, self._on_backlog)
        self._quiet_alarm = QuietAlarm(LIVENESS_CHECK_S)
        self._reader: asyncio.Task[Any] | None = None  # the task iterating events()
        self.is_cut_off = False  # its client fell too far behind (serving/transport/reply_hub.py)
        self._cut_off_close: asyncio.Task[None] | None = None  # held: the loop keeps only weak refs
        self.replica: ReplicaHandle | None = None
        self.num_prompt_tokens = 0
        self.num_completion_tokens = 0
        self.num_retries = 0
        self.is_finished = False
        self._gave_up = False  # ended by the gateway (its replica went silent): closing still aborts it
        self._is_closed = False
        # A failure of the replica or of finding one: if the request ends in it, no replica counts it,
        # and the gateway counts it in the version's metrics (the judge's).
        self._failure = FailureNote(counts=counts_failures)
        self._first_event: dict[str, Any] | None = None  # an error that arrived in place of acceptance
        self._text = TextCapture()

    def capture_text(self) -> asyncio.Future[str | None]:
        """A future for the whole text once the request ends normally (None if it fails or is aborted)."""
        return self._text.future()

    def end_revoked(self) -> None:
        """Its API key was revoked (key_watch.py): the stream's next event is its final error."""
        self._queue.put_nowait(error_event(KEY_REVOKED, KEY_REVOKED_MESSAGE))

    def response_headers(self) -> dict[str, str]:
        tier = self._submission.get("service_tier") or "default"  # as granted (service_tiers.py)
        headers = {"X-Served-Version": self.version, "X-Request-Id": self.request_id, "X-Service-Tier": tier}
        if self.replica is not None:
            headers["X-Served-Replica"] = self.replica.replica_id
        return headers

    async def submit(self, *, exclude: frozenset[str] = frozenset(), charge: Charge | None = None) -> None:
        """Pick a replica, send, and wait until it accepts. `charge` (a tenant and the tokens to charge
        it): admit the request too, in the same step as the send. Raises GatewayError (400, 429, 503)."""
        try:
            replicas = await self._runtime.candidates(self.model_name, self.version)
        except Exception as exc:  # the replica directory (Redis) unreadable: a 503 to retry, not a 500
            logger.warning("replica directory unreadable (%r): request refused with a 503", exc)
            raise GatewayError(503, "the replica directory could not be read", retry_after_s=1) from exc
        if not any(r.is_ready and r.replica_id not in exclude for r in replicas) and (
            (self._cold_start_allowed and self._runtime.can_cold_start)
            # An embedded replica loading for a version that just got traffic: served once it is up,
            # not refused meanwhile (docs/reliability.md, "Soak").
            or await self._runtime.embedded_replica_coming(self.model_name, self.version)
        ):
            if charge is not None:  # admitted now: a 429 does not wait, and the wait holds its slot
                self._ticket = await quota_store().aadmit(
                    charge.context, tokens=charge.tokens, room_for=charge.room_for
                )
                charge = None
            replicas = await self._cold_start()
        self._raise_if_closed()  # while the directory was read, or a replica started
        candidates = [
            r for r in replicas if r.is_ready and r.replica_id not in exclude and breaker.allows(r.replica_id)
        ]
        replica = choose_replica(candidates, rng=_rng)
        while replica is not None and not breaker.claim(replica.replica_id):
            candidates.remove(replica)  # half-open, and its one trial went to another request meanwhile
            replica = choose_replica(candidates, rng=_rng)
        if replica is None:
            await _refuse_if_over_quota(charge)
            # Not one coming up (a restart): a loading replica that stopped beating is not coming.
            if not any(r.state == ReplicaState.LOADING and r.is_fresh for r in replicas):
                self._failure.note(NO_READY_REPLICA)
            raise GatewayError(503, f"no ready replica for {self.model_name}:{self.version}", retry_after_s=2)
        message = Submit(request_id=self._wire_id, submitted_at=time.time(), **self._submission).to_wire()
        layer = self._runtime.layer
        # Set before the send: a request cancelled during it may have reached the replica, and close()
        # aborts it there. A refusal is known to have sent nothing: a 429 never touches a replica.
        self.replica = replica
        is_trial = breaker.is_open(replica.replica_id)  # claimed while half-open: this is its one trial
        has_verdict = False  # whether the replica's breaker has been told how this went
        try:
            try:
                ticket = await _send(layer, replica.channel_name, message, charge, request_id=self.request_id)
            except MaybeSent:
                raise  # the replica stays set: closing aborts it there
            except GatewayError:
                self.replica = None
                raise
            if ticket is not None:
                self._ticket = ticket
            first = await self._next_event(timeout_s=ACCEPT_TIMEOUT_S)
            if first.get("finish_reason") == "error":
                error = first["error"]
                if error.get("type") == "invalid_request_error":
                    breaker.record_accepted(replica.replica_id, is_trial=is_trial)  # it answered: alive
                    has_verdict = True
                    self.is_finished = True
                    raise GatewayError(
                        400, error.get("message", "invalid request"), served_by=self.response_headers()
                    )
                if error.get("type") not in REPLICA_FAILURES:
                    self._first_event = first  # a request-level failure: the client sees it as a stream error
                    return
                self._failure.note(error.get("type"))
                breaker.record_failure(replica.replica_id, is_trial=is_trial)
                has_verdict = True
                if self.num_retries == 0:
                    await self._retry()
                    return
                raise GatewayError(
                    503, error.get("message", "the replica refused the request"), retry_after_s=2
                )
            breaker.record_accepted(replica.replica_id, is_trial=is_trial)  # a half-open trial passed
            has_verdict = True
        finally:
            if is_trial and not has_verdict:  # it says nothing of the replica: the next request may try
                breaker.release(replica.replica_id)
        if event_kind(first) is not EventKind.ACCEPTED:
            # Its acceptance was lost on the way (published while the reply hub reconnected to Redis):
            # what came first is already the stream, which the client must not lose.
            self._first_event = first
        self.num_prompt_tokens = int(first.get("num_prompt_tokens", 0))

    def _raise_if_closed(self) -> None:
        """Before a retry sends anything: another task may have closed this request while it waited (the
        end of an n-choice stream closes every choice, one perhaps in its retry). Its close aborted what
        it knew of; a try sent after it would run to max_tokens for nobody."""
        if self._is_closed:
            raise GatewayError(503, "the request was closed before its retry was sent")

    def count_failure(self) -> None:
        """The request ends in the replica failure noted on its way (if any): count it, once."""
        self._failure.count_once(self._runtime.failures, self.model_name, self.version)

    async def _cold_start(self) -> list[ReplicaHandle]:
        try:
            return await wait_for_a_replica(self._runtime, self.model_name, self.version)
        except ColdStartTimedOut:
            self._failure.note(NO_READY_REPLICA)
            raise

    async def _retry(self) -> None:
        assert self.replica is not None
        failed = self.replica.replica_id
        # A replica that went silent may be alive and slow: the try it holds would run on beside the retry.
        await self._abort_on(self.replica)
        self._raise_if_closed()
        self._gave_up = False
        self.num_retries += 1
        self._runtime.hub.close(self._wire_id)
        self._wire_id = f"{self.request_id}-{self.num_retries}"
        self._queue = self._runtime.hub.open(self._wire_id, self._on_backlog)
        await self.submit(exclude=frozenset({failed}))

    async def _next_event(self, *, timeout_s: float) -> dict[str, Any]:
        """The next event, checking that the replica still has a heartbeat whenever LIVENESS_CHECK_S
        pass without one (quiet_alarm.py: one timer a quiet spell, not one a token)."""
        assert self.replica is not None
        deadline = time.monotonic() + timeout_s
        while True:
            event = await self._quiet_alarm.next(self._queue)
            if event is not None:
                return event
            is_alive = await self._runtime.is_alive(self.replica)
            raise_if_cancelling()  # the client left during the check: the Redis read may have lost it
            if not is_alive:
                self._gave_up = True
                return error_event(REPLICA_LOST, "the replica serving this request stopped")
            if time.monotonic() > deadline:
                self._gave_up = True
                return error_event(REPLICA_TIMEOUT, "the replica stopped answering")

    def _on_backlog(self) -> bool:
        """The client has stopped reading: its reader is blocked in the server's send() while events pile
        up. Cancelling the reader ends the stream, and its close() aborts the sequence on the replica.
        True: cut off. False while nothing reads yet: the response has not begun (a stream's body, other
        choices of an OpenAI `n` being dispatched), which is no client's doing; what waits is bounded by
        max_tokens, and the reader, once it starts, is held to the cap from its first event on."""
        if self._reader is None:
            return False
        logger.warning(
            "request %s cut off: its client left over %d events unread",
            self.request_id,
            settings.STREAM_MAX_BACKLOG_EVENTS,
        )
        self.is_cut_off = True
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        else:
            self._cut_off_close = asyncio.get_running_loop().create_task(self.close())
        return True

    def set_reader(self, reader: asyncio.Task[Any] | None) -> None:
        """The task that passes this request's events on to its client, cancelled when the client falls
        too far behind: by default the first to iterate events(). Set it where another task does, or
        where the response sends something before it starts reading them."""
        self._reader = reader

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        if self._reader is None:
            self._reader = asyncio.current_task()
        while not self.is_finished:
            # A disconnect that a Redis call on the way here lost (serving/cancelling.py) would let a
            # stream whose tokens keep coming run to max_tokens: _next_event checks only when idle.
            raise_if_cancelling()
            if self.is_cut_off:
                yield error_event(SLOW_READER, SLOW_READER_MESSAGE)
                return
            if self._first_event is not None:
                event, self._first_event = self._first_event, None
            else:
                event = await self._next_event(timeout_s=INACTIVITY_TIMEOUT_S)
            # A keepalive: the replica still holds it (queued, or preempted); wait on.
            if event_kind(event) is EventKind.KEEPALIVE:
                continue
            if event.get("error", {}).get("type") in (SERVER_SHUTTING_DOWN, KEY_REVOKED):
                self._gave_up = True  # the replica still runs it: close() aborts it there
            is_replica_failure = event.get("error", {}).get("type") in REPLICA_FAILURES
            if is_replica_failure and self.replica is not None:
                self._failure.note(event["error"]["type"])
                breaker.record_failure(self.replica.replica_id)
                if self.num_completion_tokens == 0 and self.num_retries == 0:
                    try:
                        await self._retry()
                        continue
                    except GatewayError as exc:
                        # A retry that may have reached its replica is aborted there when this closes:
                        # one sent with no answer (MaybeSent), or one whose replica went silent after
                        # it was sent (_next_event gave up on it).
                        self._gave_up = self._gave_up or isinstance(exc, MaybeSent)
                        event = error_event("replica_unavailable", exc.message)
                self.count_failure()
            if "finish_reason" in event and not self.num_prompt_tokens:
                # Its acceptance was lost: the quota settles on the final event's usage.
                self.num_prompt_tokens = int((event.get("usage") or {}).get("prompt_tokens", 0))
            if _has_lost_tokens(event, num_seen=self.num_completion_tokens):
                logger.warning(
                    "request %s: tokens lost on their way from replica %s (expected index %d, got %r)",
                    self.request_id,
                    self.replica.replica_id if self.replica is not None else None,
                    self.num_completion_tokens,
                    event.get("index", (event.get("usage") or {}).get("completion_tokens")),
                )
                self._gave_up = True  # the replica may still be generating: close() aborts it there
                event = error_event(TOKENS_LOST, TOKENS_LOST_MESSAGE)
            if "token" in event:
                self.num_completion_tokens += 1
                self._text.add(event["token"])
            if "finish_reason" in event:
                self.is_finished = True
                self._text.settle(ok=event["finish_reason"] != "error")
                if event["finish_reason"] != "error" and self.replica is not None:
                    breaker.record_success(self.replica.replica_id)
            yield event

    async def close(self) -> None:
        """Idempotent. A request that has not finished is aborted on its replica, freeing its blocks."""
        if self._is_closed:
            return
        self._is_closed = True
        self._quiet_alarm.cancel()
        self._text.settle(ok=False)  # no-op when it finished normally
        self._runtime.hub.close(self._wire_id)
        num_unread = self._num_unread_tokens()
        try:
            if (not self.is_finished or self._gave_up) and self.replica is not None:
                await self._abort_on(self.replica)
        finally:  # a cancellation during the abort must not keep the slot (its lease renewed for ever)
            ticket, self._ticket = self._ticket, None
            if ticket is not None:
                used = self.num_prompt_tokens + self.num_completion_tokens + num_unread
                await quota_store().arelease(ticket, used_tokens=used)

    def _num_unread_tokens(self) -> int:
        """Tokens that reached this request but not its client (it stopped reading, or left): generated
        all the same, so charged. Those the replica makes before the abort reaches it are not counted."""
        unread = [] if self._first_event is None else [self._first_event]
        while not self._queue.empty():
            unread.append(self._queue.get_nowait())
        return sum("token" in event for event in unread)

    async def _abort_on(self, replica: ReplicaHandle) -> None:
        """Abort the current try on `replica` (serving/gateway/aborts.py)."""
        await send_abort(self._runtime.layer, replica.channel_name, self._wire_id, request_id=self.request_id)


async def _send(
    layer: Any, channel_name: str, message: dict[str, Any], charge: Charge | None, *, request_id: str
) -> Ticket | None:
    """Send a submission; with `charge`, admit it too, in the same step (its ticket). Raises
    GatewayError when nothing was sent (over quota, the channel full), MaybeSent when it may have been."""
    try:
        if charge is None:
            await layer.send(channel_name, message)
            return None
        return await quota_store().aadmit_and_send(
            charge.context,
            tokens=charge.tokens,
            room_for=charge.room_for,
            layer=layer,
            channel=channel_name,
            message=message,
        )
    except GatewayError:
        raise
    except ChannelFull as exc:
        raise GatewayError(503, "the replica's queue is full", retry_after_s=1) from exc
    except Exception as exc:  # the channel layer's server failed mid-send
        # The type only: an encoder's error can quote the message, the client's prompt with it.
        logger.warning("request %s: could not be sent to its replica (%s)", request_id, type(exc).__name__)
        raise MaybeSent(503, "the request could not be sent to its replica", retry_after_s=1) from exc


async def _refuse_if_over_quota(charge: Charge | None) -> None:
    """Over quota is still the answer with nothing to serve the request: 429 before 503."""
    if charge is not None:
        store = quota_store()
        ticket = await store.aadmit(charge.context, tokens=charge.tokens, room_for=charge.room_for)
        await store.arelease(ticket, used_tokens=0)


def _has_lost_tokens(event: dict[str, Any], *, num_seen: int) -> bool:
    """Whether a step before this event never arrived: a token whose index is not the next one, or
    a final event whose usage counts more tokens than came."""
    if "token" in event:
        return event.get("index") != num_seen
    if event.get("finish_reason") not in (None, "error"):
        generated = (event.get("usage") or {}).get("completion_tokens")
        return isinstance(generated, int) and generated > num_seen
    return False


async def close_all(handles: list[InFlightRequest]) -> None:
    """Close every one (aborting what has not finished, releasing its quota), all the way through: a
    close that raises does not stop the others, and a second cancellation of the caller (a slow-reader
    cut-off landing while a disconnect is handled) does not cut the closing short."""
    closing = asyncio.gather(*(handle.close() for handle in handles), return_exceptions=True)
    for handle, outcome in zip(handles, await asyncio.shield(closing), strict=True):
        if isinstance(outcome, BaseException):
            logger.error("request %s: could not close it", handle.request_id, exc_info=outcome)
