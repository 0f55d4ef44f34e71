"""The wire's own rules: the limits the edge checks are the engine's, and its records keep their shape."""

from serving.engine import sequence
from serving.transport import protocol


def test_the_limits_the_edge_checks_are_the_engines() -> None:
    # A request the edge let through with more would be refused by the replica, after its quota was
    # charged and a replica was chosen; one the edge refused the engine could have served.
    assert protocol.MAX_LOGPROBS == sequence.MAX_LOGPROBS
    assert protocol.MAX_LOGIT_BIAS == sequence.MAX_LOGIT_BIAS


def test_an_error_event_is_a_final_event_in_the_documented_shape() -> None:
    assert protocol.error_event(protocol.SLOW_READER, "too slow") == {
        "finish_reason": "error",
        "error": {"type": "slow_reader", "message": "too slow"},
    }


def test_a_step_message_groups_events_by_request() -> None:
    message = protocol.step_message({"a": [{"token": "x", "index": 0}], "b": [{"keepalive": True}]})
    assert message == {
        "type": "replica.step",
        "items": [
            {"request_id": "a", "events": [{"token": "x", "index": 0}]},
            {"request_id": "b", "events": [{"keepalive": True}]},
        ],
    }


def test_max_tokens_none_runs_to_the_room_left_within_the_limit() -> None:
    assert protocol.max_tokens_for(7, room=100, limit=50) == 7  # asked for: as asked
    assert protocol.max_tokens_for(None, room=100, limit=50) == 50
    assert protocol.max_tokens_for(None, room=30, limit=50) == 30
    assert protocol.max_tokens_for(None, room=-5, limit=50) == 1  # never less than one token


def test_the_timing_contract_holds() -> None:
    assert protocol.KEEPALIVE_S < protocol.INACTIVITY_TIMEOUT_S
    assert protocol.HEARTBEAT_INTERVAL_S < protocol.STALE_AFTER_S


def test_a_submission_reads_back_as_it_was_sent_and_ignores_fields_it_does_not_know() -> None:
    sent = protocol.Submit(
        request_id="abc-1",
        submitted_at=1.5,
        reply_to="switchyard.inbox.x",
        params={"max_tokens": None, "temperature": 0.0},
        messages=[{"role": "user", "content": "hi"}],
        tenant="acme",
        cache_group="acme",
        keepalives=True,
        service_tier="flex",
        max_running=2,
        kv_share=0.5,
    )
    wire = sent.to_wire()
    assert wire["type"] == "replica.submit"
    # A newer gateway's field: an older replica reads the rest.
    assert protocol.Submit.from_wire({**wire, "speculative_hint": 3}) == sent
    # An older gateway's submission (no tier, no caps): the default tier and the replica's own caps.
    older = {k: v for k, v in wire.items() if k not in ("service_tier", "max_running", "kv_share")}
    read = protocol.Submit.from_wire(older)
    assert (read.service_tier, read.max_running, read.kv_share) == ("default", None, None)


def test_an_abort_and_a_shadow_result_keep_their_wire_shape() -> None:
    # Replicas of the previous release read these keys: the shape is the contract.
    assert protocol.Abort("abc").to_wire() == {"type": "replica.abort", "request_id": "abc"}
    assert protocol.ShadowResult(True).to_wire() == {"type": "replica.shadow_result", "matched": True}
    assert (
        protocol.Abort.from_wire({"type": "replica.abort", "request_id": "abc", "extra": 1}).request_id
        == "abc"
    )


def test_every_event_is_told_apart_by_its_keys() -> None:
    kinds = {
        protocol.EventKind.ACCEPTED: protocol.accepted_event(7),
        protocol.EventKind.TOKEN: protocol.token_event("hi", 0),
        protocol.EventKind.KEEPALIVE: protocol.keepalive_event(),
        protocol.EventKind.FINAL: {"finish_reason": "stop", "usage": {}},
        protocol.EventKind.ERROR: protocol.error_event(protocol.REPLICA_LOST, "gone"),
    }
    assert {kind: protocol.event_kind(event) for kind, event in kinds.items()} == {k: k for k in kinds}
    assert protocol.accepted_event(7) == {"accepted": True, "num_prompt_tokens": 7}
    assert protocol.token_event("", 3) == {"token": "", "index": 3}
