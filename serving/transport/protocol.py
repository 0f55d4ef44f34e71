"""The wire between gateway and replica: every message's name, every error type, the timing contract.

Both sides import this module and nothing of each other (docs/architecture.md, "The wire protocol").
It imports the standard library only, so a gateway process that reads it loads no torch and a replica
that reads it loads no gateway. The wire itself is JSON; a reader ignores fields it does not know,
because a rolling upgrade mixes versions of both sides.
"""

from __future__ import annotations

import enum
from typing import Any

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
# Only in the version's metrics, never in an event:
NO_READY_REPLICA = "no_ready_replica"
REPLICA_FAILED = "replica_failed"  # a request that met replica_unavailable once its stream had begun

# Failures of the replica, not of the request: retried elsewhere (before the first token) and counted
# by the circuit breaker. A request-level error (a model failure, an injected fault) is neither:
# retrying it would hide a bad version from the metrics the rollout judge reads.
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


def error_event(error_type: str, message: str) -> dict[str, Any]:
    """A final event that ends a request in an error, as both sides word it."""
    return {"finish_reason": "error", "error": {"type": error_type, "message": message}}


def step_message(items: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
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
