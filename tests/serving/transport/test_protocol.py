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
