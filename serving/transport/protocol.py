"""The wire between gateway and replica: every message's name, every error type, the timing contract.

Both sides import this module and nothing of each other (docs/architecture.md, "The wire protocol").
It imports the standard library only, so a gateway process that reads it loads no torch and a replica
that reads it loads no gateway. The wire itself is JSON; a reader ignores fields it does not know,
because a rolling upgrade mixes versions of both sides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, Literal, NotRequired, TypedDict

# Message types on the channel layers.
SUBMIT = "replica.submit"  # gateway -> replica: a request (to switchyard.replica.<model>.<version>.<id>)
ABORT = "replica.abort"  # gateway -> replica: stop a request, free its KV blocks
SHADOW_RESULT = "replica.shadow_result"  # gateway -> replica: how a mirrored copy compared
STEP_MESSAGE = "replica.step"  # replica -> gateway inbox: one step's events for that inbox's requests


class ReplicaState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


# Error types a final event carries (error.type). The replica's own:
INVALID_REQUEST = "invalid_request_error"
INTERNAL_ERROR = "internal_error"
REPLICA_UNAVAILABLE = "replica_unavailable"  # a request the replica cannot serve (draining, not ready)
INJECTED_FAULT = "injected_fault"
# Made by the gateway when the replica's events stop coming or cannot be delivered:
REPLICA_LOST = "replica_lost"
REPLICA_TIMEOUT = "replica_timeout"
SLOW_READER = "slow_reader"
SLOW_READER_MESSAGE = "the client fell too far behind the stream"
# Steps lost between replica and gateway (Redis pub/sub drops what it publishes while a subscriber
# reconnects, docs/architecture.md "Silent loss"): the text has a hole, so the stream ends in an error
# rather than "stop" with words missing. Not the version's fault: neither the breaker nor the judge
# counts it.
TOKENS_LOST = "tokens_lost"
TOKENS_LOST_MESSAGE = "part of the response was lost on its way from the replica"
# The gateway's process is stopping and its drain ran out: streams still open end with this (the
# replica's sequence is aborted). Not the version's fault either.
SERVER_SHUTTING_DOWN = "server_shutting_down"
SERVER_SHUTTING_DOWN_MESSAGE = "the server is shutting down; send the request again"
# The API key behind a stream was revoked while it ran (serving/gateway/key_watch.py); as a 401's type.
KEY_REVOKED = "authentication_error"
KEY_REVOKED_MESSAGE = "the API key was revoked"
# Only in the version's metrics, never in an event:
NO_READY_REPLICA = "no_ready_replica"
REPLICA_FAILED = "replica_failed"  # a request that met replica_unavailable once its stream had begun

# Failures of the replica, not of the request: retried elsewhere (before the first token) and counted
# by the circuit breaker. A request-level error (a model failure, an injected fault) is neither:
# retrying it would hide a bad version from the metrics the rollout judge reads.
# A request that waited past the replica's queue timeout for a first seat (REPLICA_QUEUE_TIMEOUT_S): the
# replica is overloaded, not broken, so it is no replica failure (no retry elsewhere, no breaker).
QUEUE_TIMEOUT = "queue_timeout"
REPLICA_FAILURES = frozenset({REPLICA_LOST, REPLICA_UNAVAILABLE, REPLICA_TIMEOUT})

# Limits the gateway's edge checks before anything is sent, so that a replica never refuses a request
# for them; the engine keeps its own copies (it imports nothing of the project), and
# tests/serving/transport/test_protocol.py holds the two equal.
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 300  # tokens one request may bias, as OpenAI's logit_bias

# The timing contract, kept together because each bound is set against another.
# A replica sends a request it holds an event at least this often, a keepalive when it has no token
# (waiting for a slot, or preempted), well under the gateway's inactivity timeout, after which the
# gateway ends a request it has heard nothing of as lost.
KEEPALIVE_S = 15.0
INACTIVITY_TIMEOUT_S = 60.0
# How long the gateway waits for a replica to accept a submission before it tries another.
ACCEPT_TIMEOUT_S = 30.0
# Heartbeats: how often a replica writes one, and when a reader stops trusting the last.
HEARTBEAT_INTERVAL_S = 0.5
STALE_AFTER_S = 1.5


def replica_channel_prefix(model_name: str, version: str) -> str:
    """The prefix of every channel name of a version's replicas; a replica appends its id."""
    return f"switchyard.replica.{model_name}.{version}."


# --- a request's events, in a step message -----------------------------------------------------------
# Each is its own wire form (JSON objects told apart by their keys: event_kind), so the records are
# TypedDicts: the type checker holds both sides to one shape, and nothing is converted on the way.


class AcceptedEvent(TypedDict):
    accepted: Literal[True]
    num_prompt_tokens: int


class KeepaliveEvent(TypedDict):
    keepalive: Literal[True]


class TokenLogprob(TypedDict):
    token: str
    logprob: float
    top: list[Any]
    bytes: list[int] | None


class TokenEvent(TypedDict):
    token: str  # a step's later tokens carry "": its text came with the first
    index: int
    logprob: NotRequired[TokenLogprob]  # only for a request that asked for logprobs


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_prompt_tokens: int


class Timings(TypedDict):
    queue_s: float | None
    ttft_s: float | None
    total_s: float


class FinalEvent(TypedDict):
    finish_reason: str  # stop, length (never "error": that is an ErrorEvent)
    usage: Usage
    timings: Timings
    # A non-generative model's result: base64 float32 rows (serving/transport/vectors.py), with a
    # classifier's labels.
    embeddings: NotRequired[list[str]]
    scores: NotRequired[list[str]]
    labels: NotRequired[list[str]]


class ErrorDetail(TypedDict):
    type: str
    message: str


class ErrorEvent(TypedDict):
    finish_reason: Literal["error"]
    error: ErrorDetail


Event = AcceptedEvent | KeepaliveEvent | TokenEvent | FinalEvent | ErrorEvent


def error_event(error_type: str, message: str) -> ErrorEvent:
    """A final event that ends a request in an error, as both sides word it."""
    return {"finish_reason": "error", "error": {"type": error_type, "message": message}}


def step_message(items: dict[str, list[Event]]) -> dict[str, Any]:
    """One step's events, grouped by request id, as one message to one inbox."""
    return {"type": STEP_MESSAGE, "items": [{"request_id": r, "events": e} for r, e in items.items()]}


def max_tokens_for(requested: int | None, *, room: int, limit: int) -> int:
    """The tokens a request may generate: what it asked for, or, asked for none (None: to the end of the
    context, as OpenAI's), the room it has, at most `limit` (settings.MAX_TOKENS_LIMIT) and at least one.
    The gateway's room is the tenant's minute budget less the input (what admission charges); the
    replica's is the model's context less the prompt (where generation stops)."""
    if requested is not None:
        return requested
    return max(1, min(limit, room))


# --- the messages as typed records (docs/architecture.md, "The wire protocol") ---------------------------
# Each has its wire form (`to_wire`, a JSON-ready dict) and is read back with `from_wire`, which ignores
# fields it does not know: a rolling upgrade mixes versions of both sides.


@dataclass(frozen=True, slots=True)
class Submit:
    """A request for a replica. Exactly one of input (a text), messages (a chat) or inputs (an encoder's
    texts); params are the sampling fields as the edge checked them (max_tokens None: to the end of the
    context)."""

    request_id: str  # "<id>", or "<id>-<retry>" for a retry's try
    reply_to: str  # the gateway process's inbox
    params: dict[str, Any]
    # Wall clock, so that a gateway in another process can be compared; 0: not said (the replica's arrival)
    submitted_at: float = 0.0
    input: str | None = None
    messages: list[dict[str, Any]] | None = None
    inputs: list[str] | None = None
    tenant: str = "default"
    cache_group: str | None = None
    keepalives: bool = False  # the gateway understands keepalive events
    # The tier the gateway granted (priority, default, flex) and the tenant's caps inside a replica from
    # its quota (None: the replica's own): docs/architecture.md, "Service tiers".
    service_tier: str = "default"
    max_running: int | None = None
    kv_share: float | None = None
    # A LoRA adapter version served on this replica's base (docs/architecture.md, "Adapters on a shared
    # base"): "model:version", its directory and digest (checked before it is read), and its version's id,
    # under which its requests' metrics are recorded. None: the base itself.
    adapter: str | None = None
    adapter_uri: str | None = None
    adapter_sha256: str | None = None
    adapter_version_id: int | None = None
    # A chat's tools in OpenAI's function format, for its chat template (apply_chat_template(tools=…));
    # None: no tools. Whether the output must be calls crosses as params' response_format.
    tools: list[dict[str, Any]] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"type": SUBMIT, **_fields_of(self)}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Submit:
        return cls(**_known(cls, wire))


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop a request and free its KV blocks; a no-op for one the replica no longer holds."""

    request_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": ABORT, "request_id": self.request_id}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Abort:
        return cls(str(wire["request_id"]))


@dataclass(frozen=True, slots=True)
class ShadowResult:
    """Whether a mirrored copy's text matched its primary's (only for reproducible sampling), and how far:
    the index of the first token where the two differ (None: they do not) and the share of positions of
    the shorter output that agree. An older gateway sends `matched` alone; both are then None."""

    matched: bool
    first_divergence: int | None = None
    agreement: float | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": SHADOW_RESULT, "matched": self.matched}
        if self.agreement is not None:
            wire["agreement"] = self.agreement
            wire["first_divergence"] = self.first_divergence
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ShadowResult:
        agreement, divergence = wire.get("agreement"), wire.get("first_divergence")
        if not isinstance(agreement, int | float) or isinstance(agreement, bool) or not 0 <= agreement <= 1:
            agreement = None
        if not isinstance(divergence, int) or isinstance(divergence, bool) or divergence < 0:
            divergence = None
        return cls(bool(wire.get("matched")), divergence, None if agreement is None else float(agreement))


class EventKind(enum.StrEnum):
    """What a replica's event is. On the wire they are told apart by their keys, which old gateways and
    replicas rely on; `event_kind` reads that."""

    ACCEPTED = "accepted"
    TOKEN = "token"
    KEEPALIVE = "keepalive"
    FINAL = "final"
    ERROR = "error"


def event_kind(event: Event | dict[str, Any]) -> EventKind:
    if event.get("finish_reason") == "error":
        return EventKind.ERROR
    if "finish_reason" in event:
        return EventKind.FINAL
    if event.get("accepted"):
        return EventKind.ACCEPTED
    if event.get("keepalive"):
        return EventKind.KEEPALIVE
    return EventKind.TOKEN


def accepted_event(num_prompt_tokens: int) -> AcceptedEvent:
    """The replica has the request; the tokens its prompt counts (what the tenant's quota settles)."""
    return {"accepted": True, "num_prompt_tokens": num_prompt_tokens}


def keepalive_event() -> KeepaliveEvent:
    """The replica still holds the request (queued for a slot, or preempted) and has no token for it."""
    return {"keepalive": True}


def token_event(text: str, index: int) -> TokenEvent:
    """Token `index` of the output; a step's later tokens carry "" (its text came with the first)."""
    return {"token": text, "index": index}


def _fields_of(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in fields(record)}


def _known(cls: type, wire: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in wire.items() if k in names}
