"""The records the replica's threads pass between them: where a request's events go (Route), a submission
made ready off the model thread (Arrival), one step's events by inbox with what its metrics need
(StepResult), what the model thread hands the loop (Outgoing); and how a step's output becomes token
events, and an ended request its final event and its metrics sample."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from serving.telemetry.metric_window import SERVICE_TIERS
from serving.telemetry.recorder import AdapterVersion, RequestSample
from serving.transport.protocol import ErrorEvent, Event, FinalEvent, TokenEvent, token_event
from serving.transport.vectors import encode_vectors


@dataclass(slots=True)
class Route:
    """Where a request's events go, and what the replica needs to word its final event."""

    reply_to: str
    submitted_at: float  # wall clock, so a gateway in another process can be compared
    seq: Any = None  # the engine's Sequence, read for its queue wait when it ends
    last_token_at: float | None = None  # monotonic, for inter-token latency
    # Its gateway asked for keepalives (KEEPALIVE_S). A gateway older than them would pass one on to its
    # client as the stream's end: it gets none.
    wants_keepalives: bool = False
    # The engine's tier index (as Arrival.tier), once the model thread takes it: the service tier its
    # metrics are counted under (docs/architecture.md, "Service tiers"). None: not known.
    tier: int | None = None
    adapter: AdapterVersion | None = None  # the LoRA adapter version it is served as: its metrics' version


@dataclass(slots=True)
class Arrival:
    """A submission made ready for the engine off the model thread, or the error that ends it there."""

    request_id: str
    route: Route
    prompt_ids: list[int] | list[list[int]] = field(default_factory=list)  # an encoder's: one per input
    # The tokens the request is charged for: the gateway settles the tenant's tokens/min quota with it.
    num_prompt_tokens: int = 0
    params: Any = None  # the engine's SamplingParams
    tenant: str = "default"
    cache_group: str | None = None
    tier: int = 1  # the engine's tier index (serving.engine.sequence.TIER_NAMES)
    limits: Any = None  # the engine's TenantLimits, None: the replica's defaults
    adapter: Any = None  # the engine's LoraAdapter it runs with (serving/replica/adapters.py); None: the base
    error: ErrorEvent | None = None  # an error event: no engine work; the model thread emits it in order


@dataclass(slots=True)
class Outgoing:
    """What the model thread hands the loop: events to send, and whether the engine was left empty."""

    result: StepResult
    is_engine_empty: bool = False
    num_taken: int = 0  # inbox items the model thread had taken, all told, when it produced this
    delivered: threading.Event | None = None


@dataclass(slots=True)
class StepResult:
    events_by_inbox: dict[str, dict[str, list[Event]]] = field(default_factory=lambda: defaultdict(dict))
    # For the metrics, recorded once the events are out.
    model_time_s: float | None = None  # None: no forward pass
    itl_s: list[float] = field(default_factory=list)
    ended: list[RequestSample] = field(default_factory=list)
    starts_a_stream: bool = False  # it holds an acceptance or a first token

    def add(self, route: Route, request_id: str, event: Event) -> None:
        self.events_by_inbox[route.reply_to].setdefault(request_id, []).append(event)
        if "accepted" in event or event.get("index") == 0:
            self.starts_a_stream = True

    def merge_events(self, other: StepResult) -> None:
        for inbox, items in other.events_by_inbox.items():
            for request_id, events in items.items():
                self.events_by_inbox[inbox].setdefault(request_id, []).extend(events)


def token_events(output: Any) -> list[TokenEvent]:
    """The tokens one step added to a request (an engine's RequestOutput) as token events: the step's new
    text on the first, each with its logprobs where the request asked for them."""
    events = []
    for i, _ in enumerate(output.new_token_ids):
        event = token_event(
            output.new_text if i == 0 else "", output.num_output_tokens - len(output.new_token_ids) + i
        )
        if output.logprobs is not None and i < len(output.logprobs):
            entry = output.logprobs[i]
            event["logprob"] = {
                "token": entry.token,
                "logprob": entry.logprob,
                "top": entry.top,
                "bytes": entry.bytes,
            }
        events.append(event)
    return events


def request_sample(output: Any, route: Route) -> RequestSample:
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
        is_generative=getattr(output, "vectors", None) is None,
        service_tier=service_tier(route),
        adapter=route.adapter,
    )


def service_tier(route: Route) -> str | None:
    """The name of the tier a request was granted (not the one aging lent it), for its metrics."""
    tier = route.tier
    return SERVICE_TIERS[tier] if tier is not None and 0 <= tier < len(SERVICE_TIERS) else None


def error_sample(error_type: str, route: Route, *, num_prompt_tokens: int = 0) -> RequestSample:
    """The sample of a request that ended in an error after it was read, counted under its tier."""
    return RequestSample(
        "error",
        num_prompt_tokens=num_prompt_tokens,
        error_type=error_type,
        service_tier=service_tier(route),
        adapter=route.adapter,
    )


def final_event(output: Any, route: Route) -> FinalEvent:
    ttft = output.first_token_time - output.arrival_time if output.first_token_time is not None else None
    total = (output.finished_time or time.monotonic()) - output.arrival_time
    # From the gateway's submission to the first forward pass that held the request: the replica's part
    # of the time before any model work (receiving, tokenizing, waiting for a step), as TGI's queue time.
    first_scheduled = route.seq.first_scheduled_time if route.seq is not None else None
    queue = first_scheduled - output.arrival_time if first_scheduled is not None else None
    event: FinalEvent = {
        "finish_reason": str(output.finish_reason),
        "usage": {
            "prompt_tokens": output.num_prompt_tokens,
            "completion_tokens": output.num_output_tokens,
            "total_tokens": output.num_prompt_tokens + output.num_output_tokens,
            "cached_prompt_tokens": output.num_cached_prompt_tokens,
        },
        "timings": {
            "queue_s": round(queue, 6) if queue is not None else None,
            "ttft_s": round(ttft, 6) if ttft is not None else None,
            "total_s": round(total, 6),
        },
    }
    vectors = getattr(output, "vectors", None)  # a non-generative model's result
    if vectors is not None:
        rows = encode_vectors(vectors)
        if output.result_field == "scores":  # a classifier's
            event["scores"] = rows
        else:
            event["embeddings"] = rows
        if output.labels is not None:
            event["labels"] = list(output.labels)
    return event


def failure_message(exc: BaseException) -> str:
    """What a client whose request a failed step ended is told: the kind of failure, not its text, which
    may carry the device's memory figures, process ids, shapes or paths (the log has it whole), and
    which every tenant with a request in the batch would see."""
    cause = exc.__cause__ or exc  # engine.StepFailed wraps the forward pass's own exception
    return f"the replica failed on this request's step ({type(cause).__name__}); try again"
