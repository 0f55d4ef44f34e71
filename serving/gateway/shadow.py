"""Shadow traffic: a copy of some requests goes to a candidate version, whose output nobody sees.

The routing table names the candidate and a percentage (registry.services.routing_mirror_set, set by a
shadow deployment). For that share of the requests served by any other version, the gateway submits
the same request to a candidate replica once the primary is accepted, runs it to the end and throws the
text away. The candidate's replica records its latency and errors like any request, which is what the
rollout judge compares; when the request is reproducible (greedy, or seeded) the gateway also tells
that replica whether its text matched the primary's, where its token events first differ and what share
of them agree (serving/gateway/shadow_diff.py), and the replica counts it (shadow.compared, shadow.matched
and the histograms shadow_agreement, shadow_first_divergence in its metrics). With sampled prompt
logging on, some copies that differ are kept, redacted, for staff to read.

A mirror never holds up or fails the primary: it is not charged to the tenant's quota, it is skipped
when this process already has MAX_IN_FLIGHT copies running (not counting those done and waiting for
their primary's text), and any failure is only logged. Skips bias the comparison (the candidate then
sees less concurrency than the incumbent), so they are counted, per model and version, in /metrics
(switchyard_shadow_copies_total{outcome="skipped"})."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from serving.cancelling import cancel_and_wait
from serving.gateway.data_plane import DataPlane
from serving.gateway.errors import GatewayError
from serving.gateway.in_flight import InFlightRequest, close_all
from serving.gateway.results import collect
from serving.gateway.shadow_diff import compare, keep_pair, should_keep, tokens_of
from serving.telemetry.shadow_copies import count_shadow_copy
from serving.transport.protocol import ShadowResult

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 32
PRIMARY_WAIT_S = 300.0  # how long a finished mirror waits for its primary's text before giving up
CANCEL_WAIT_S = 5.0  # how long a shutdown waits for its mirrors to end

_in_flight: set[asyncio.Task[None]] = set()
# Those whose copy has ended and that only wait for their primary's text to compare: no slot of
# MAX_IN_FLIGHT (a long or slowly read primary would otherwise keep new copies out, and leave the
# candidate a sample of short requests).
_waiting: set[asyncio.Task[None]] = set()


def is_comparable(params: dict[str, Any]) -> bool:
    """Two versions can be expected to write the same text only when sampling is reproducible."""
    return float(params.get("temperature", 1.0) or 0.0) == 0.0 or params.get("seed") is not None


def should_mirror(mirror: tuple[str, int] | None, served_version: str, rng: random.Random) -> bool:
    if mirror is None or mirror[0] == served_version:
        return False
    return rng.random() * 100 < mirror[1]


def start_mirror(
    primary: InFlightRequest, *, runtime: DataPlane, version: str, submission: dict[str, Any]
) -> bool:
    """Run a copy of `primary` on `version` in the background. False when skipped (too many running)."""
    if len(_in_flight) - len(_waiting) >= MAX_IN_FLIGHT:
        count_shadow_copy(primary.model_name, version, "skipped")
        return False
    count_shadow_copy(primary.model_name, version, "started")
    params = submission.get("params", {})
    comparable = is_comparable(params)
    primary_text = primary.capture_text() if comparable else None
    if "logprobs" in params:  # nobody reads the copy's
        submission = {**submission, "params": {k: v for k, v in params.items() if k != "logprobs"}}
    task = asyncio.get_running_loop().create_task(
        _run(
            runtime,
            primary.model_name,
            version,
            submission,
            primary_text,
            primary_of=(primary.version, primary.request_id),
        ),
        name=f"mirror-{primary.request_id}",
    )
    _in_flight.add(task)
    task.add_done_callback(_in_flight.discard)
    task.add_done_callback(_waiting.discard)
    return True


async def _run(
    runtime: DataPlane,
    model_name: str,
    version: str,
    submission: dict[str, Any],
    primary_text: asyncio.Future[str | None] | None,
    *,
    primary_of: tuple[str, str] | None = None,  # the primary's version and request id
) -> None:
    # Counted as the primaries are: in a shadow deployment the judge reads only these.
    handle = InFlightRequest(runtime, None, model_name, version, submission, counts_failures=True)
    captured = handle.capture_text() if primary_text is not None else None  # its token events
    try:
        await handle.submit()
        text, final = await collect(handle)
    except GatewayError as exc:
        if exc.status == 503:
            handle.count_failure()
        logger.info("shadow copy to %s:%s not served: %s", model_name, version, exc.message)
        return
    except Exception:
        logger.exception("shadow copy to %s:%s failed", model_name, version)
        return
    finally:
        # All the way through: a shutdown's second cancellation (cancel_all) must not cut its abort to
        # the candidate short, or the copy would run on there for nobody.
        await close_all([handle])
    if primary_text is None or final.get("finish_reason") == "error" or handle.replica is None:
        return
    task = asyncio.current_task()
    if task in _in_flight:
        _waiting.add(task)
    try:
        async with asyncio.timeout(PRIMARY_WAIT_S):
            expected = await primary_text
    except TimeoutError:
        return
    if expected is None:  # the primary failed or its client went away: nothing to compare
        return
    expected_tokens = tokens_of(expected)
    candidate_tokens = tokens_of(captured.result()) if captured is not None and captured.done() else None
    diff = None
    if expected_tokens is not None and candidate_tokens is not None:
        diff = compare(expected_tokens, candidate_tokens)
    result = ShadowResult(text == expected)
    if diff is not None:
        result = ShadowResult(text == expected, diff.first_divergence, diff.agreement)
    try:
        await runtime.layer.send(handle.replica.channel_name, result.to_wire())
    except Exception:
        logger.warning("shadow result for %s:%s not delivered", model_name, version, exc_info=True)
    if diff is not None and (diff.diverged or text != expected) and primary_of is not None and should_keep():
        try:
            await keep_pair(
                model_name=model_name,
                version=version,
                primary_version=primary_of[0],
                request_id=primary_of[1],
                submission=submission,
                primary_text=str(expected),
                candidate_text=text,
                diff=diff,
            )
        except Exception:
            logger.warning("shadow diff pair for %s:%s not kept", model_name, version, exc_info=True)


async def wait_idle() -> None:
    """Until every mirror this process started has ended (tests)."""
    while _in_flight:
        await asyncio.wait(set(_in_flight))


async def cancel_all() -> None:
    """Cancel every mirror of this loop and wait for them to end (runtime shutdown): each aborts its
    copy on the candidate as it closes. A mirror whose cancellation a Redis call lost is cancelled
    again (serving/cancelling.py); one still running after CANCEL_WAIT_S is left, and logged."""
    loop = asyncio.get_running_loop()
    tasks = [t for t in _in_flight if t.get_loop() is loop]
    if not tasks:
        return
    try:
        async with asyncio.timeout(CANCEL_WAIT_S):
            await cancel_and_wait(tasks)
    except TimeoutError:
        running = sorted(t.get_name() for t in tasks if not t.done())
        logger.warning("shadow copies still running at shutdown: %s", ", ".join(running))
