"""The inbox between a replica's threads: whatever the interleaving of arrivals, preparations and takes,
the model thread gets every submission once, in the order they arrived, and every abort after the
submissions taken with it (serving/replica/inbox.py)."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from serving.replica.inbox import Inbox
from serving.replica.step_result import Arrival, Route
from serving.transport.protocol import Submit


def _submit(request_id: str) -> Submit:
    return Submit(request_id=request_id, reply_to="inbox", params={})


def _arrival(request_id: str) -> Arrival:
    return Arrival(request_id, Route("inbox", 0.0))


def _never_due() -> float | None:
    return None


def _closed() -> bool:
    return False


def _request_id(item: Arrival | Submit) -> str:
    return item.request_id


@given(st.lists(st.sampled_from(["arrive", "prepare", "take", "model_waits"]), max_size=60))
def test_the_model_thread_takes_every_submission_once_and_in_arrival_order(steps: list[str]) -> None:
    """One thread plays all three roles in the order drawn; preparing finishes arrivals oldest first, as
    the one preparing thread does."""
    inbox = Inbox()
    arrived: list[str] = []
    preparing: list[str] = []
    taken: list[str] = []
    for step in steps:
        if step == "arrive":
            request_id = f"r{len(arrived)}"
            arrived.append(request_id)
            if not inbox.count_in(_submit(request_id)):
                preparing.append(request_id)
        elif step == "prepare" and preparing:
            inbox.put(_arrival(preparing.pop(0)), None)
        elif step == "take" and inbox.num_pending - len(preparing) > 0:
            got = inbox.take(_never_due, _closed)
            assert got is not None
            taken += [_request_id(item) for item in got.submissions]
        elif step == "model_waits":
            inbox._is_model_waiting = True  # what take() sets while it sleeps on an empty engine
    while preparing:
        inbox.put(_arrival(preparing.pop(0)), None)
    inbox._is_model_waiting = False
    if inbox.num_pending:
        got = inbox.take(_never_due, _closed)
        assert got is not None
        taken += [_request_id(item) for item in got.submissions]
    assert taken == arrived
    assert inbox.num_pending == 0 and inbox.num_queued == len(arrived)


def test_an_arrival_the_preparer_refused_is_counted_out() -> None:
    inbox = Inbox()
    assert inbox.count_in(_submit("r1")) is False
    inbox.count_out()
    assert (inbox.num_pending, inbox.num_queued) == (0, 0)


def test_stop_and_end_all_wake_a_sleeping_model_thread() -> None:
    inbox = Inbox()
    results: list[object] = []
    sleeping = threading.Thread(target=lambda: results.append(inbox.take(_never_due, _closed)))
    sleeping.start()
    inbox.end_all("the drain ran out")
    sleeping.join(timeout=5)
    assert not sleeping.is_alive() and len(results[0]) == 0  # type: ignore[arg-type]
    assert inbox.end_message == "the drain ran out"
    sleeping = threading.Thread(target=lambda: results.append(inbox.take(_never_due, _closed)))
    sleeping.start()
    inbox.stop()
    sleeping.join(timeout=5)
    assert not sleeping.is_alive() and results[1] is None
