"""serving.throttle: a warning an outage would log once per request, logged once per interval."""

from serving.throttle import Throttle


def test_due_once_then_not_again_within_its_interval() -> None:
    throttle = Throttle(interval_s=3600.0)
    assert [throttle.is_due() for _ in range(3)] == [True, False, False]
    unthrottled = Throttle(interval_s=0.0)
    assert [unthrottled.is_due() for _ in range(2)] == [True, True]
