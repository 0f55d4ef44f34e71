import random

import pytest

from registry.selectors import RoutingSnapshot
from serving.gateway.errors import GatewayError
from serving.gateway.router import RoutingCache, choose_replica, choose_version, split_model_name


def _snapshot(**overrides: object) -> RoutingSnapshot:
    fields: dict[str, object] = {
        "model_name": "chat",
        "kind": "causal-lm",
        "revision": 3,
        "weights": {"v1": 90, "v2": 10},
        "aliases": {"stable": "v1", "canary": "v2"},
        "versions": frozenset({"v1", "v2", "v3"}),
    }
    fields.update(overrides)
    return RoutingSnapshot(**fields)  # type: ignore[arg-type]


def test_pin_then_alias_then_weighted_split() -> None:
    rng = random.Random(0)
    assert choose_version(_snapshot(), pin="v3", alias="stable", rng=rng) == "v3"
    assert choose_version(_snapshot(), pin=None, alias="canary", rng=rng) == "v2"
    assert split_model_name("chat@canary") == ("chat", "canary")
    with pytest.raises(GatewayError) as excinfo:
        choose_version(_snapshot(), pin="v9", alias=None, rng=rng)
    assert excinfo.value.status == 404


def test_a_90_10_split_lands_within_statistical_bounds() -> None:
    rng = random.Random(1234)
    draws = [choose_version(_snapshot(), pin=None, alias=None, rng=rng) for _ in range(2000)]
    # Binomial(2000, 0.1): mean 200, sd 13.4; +-4 sd.
    assert 146 <= draws.count("v2") <= 254


class _Replica:
    def __init__(self, load: int, ready: bool = True) -> None:
        self.load, self.is_ready = load, ready


def test_replica_choice_skips_unready_and_prefers_the_less_loaded_of_two() -> None:
    rng = random.Random(0)
    idle, busy, down = _Replica(0), _Replica(50), _Replica(0, ready=False)
    picks = [choose_replica([idle, busy, down], rng=rng) for _ in range(200)]
    assert down not in picks
    assert picks.count(idle) == 200  # with two healthy replicas both are always sampled
    assert choose_replica([down], rng=rng) is None


@pytest.mark.django_db
def test_routing_cache_sees_a_change_after_revalidation_and_keeps_the_last_good_table(
    registered_model, monkeypatch
) -> None:
    from registry.services import model_version_register, routing_table_set

    cache = RoutingCache(revalidate_s=0.0)
    assert cache.get("demo-chat").weights == {"v1": 100}  # type: ignore[union-attr]
    model_version_register(name="demo-chat", version="v2", source_dir=registered_model.artifact_uri)
    routing_table_set(model=registered_model.model, weights={"v1": 50, "v2": 50})
    assert cache.get("demo-chat").weights == {"v1": 50, "v2": 50}  # type: ignore[union-attr]

    def database_down(**kwargs: object) -> None:
        raise ConnectionError("database unreachable")

    monkeypatch.setattr("serving.gateway.router.routing_revision", database_down)
    monkeypatch.setattr("serving.gateway.router.routing_snapshot", database_down)
    assert cache.get("demo-chat").weights == {"v1": 50, "v2": 50}  # type: ignore[union-attr]
    with pytest.raises(GatewayError) as excinfo:
        cache.get("never-seen")
    assert excinfo.value.status == 503


def _cache_on_a_clock(monkeypatch) -> tuple[list[float], RoutingCache]:  # type: ignore[no-untyped-def]
    """A routing cache revalidating every 0.5 s of a clock the test moves (clock[0]), demo-chat read."""
    from serving.gateway import router

    clock = [1000.0]
    monkeypatch.setattr(router.time, "monotonic", lambda: clock[0])
    cache = RoutingCache(revalidate_s=0.5)
    cache.get("demo-chat")
    return clock, cache


@pytest.mark.django_db
def test_while_the_database_is_down_a_table_is_tried_again_once_a_period(
    registered_model, monkeypatch
) -> None:
    clock, cache = _cache_on_a_clock(monkeypatch)
    tries = []

    def database_down(**kwargs: object) -> None:
        tries.append(clock[0])
        raise ConnectionError("database unreachable")

    monkeypatch.setattr("serving.gateway.router.routing_revision", database_down)
    monkeypatch.setattr("serving.gateway.router.routing_snapshot", database_down)
    for step in range(20):  # a request every 0.05 s for a second
        clock[0] = 1000.6 + step * 0.05
        assert cache.get("demo-chat").weights == {"v1": 100}  # type: ignore[union-attr]
    assert len(tries) == 2  # at 1000.6 and half a second on, not twenty times


@pytest.mark.django_db
def test_tables_in_use_are_revalidated_ahead_so_requests_route_from_memory(
    registered_model, monkeypatch
) -> None:
    from registry.services import model_version_register, routing_table_set
    from serving.gateway import router

    clock, cache = _cache_on_a_clock(monkeypatch)
    assert cache.due_for_refresh() == []  # just read
    clock[0] += 0.3  # past half the period, not yet stale: a request would still use it as it is
    assert cache.get_fresh("demo-chat")[0]
    model_version_register(name="demo-chat", version="v2", source_dir=registered_model.artifact_uri)
    routing_table_set(model=registered_model.model, weights={"v1": 10, "v2": 90})
    assert cache.due_for_refresh() == ["demo-chat"]
    cache.refresh(cache.due_for_refresh())

    def database_down(**kwargs: object) -> None:
        raise AssertionError("a fresh table must not be read from the database")

    monkeypatch.setattr("serving.gateway.router.routing_revision", database_down)
    monkeypatch.setattr("serving.gateway.router.routing_snapshot", database_down)
    clock[0] += 0.3  # 0.6 s after the first read: without the early refresh this one would be stale
    is_fresh, snapshot = cache.get_fresh("demo-chat")
    assert is_fresh and snapshot is not None and snapshot.weights == {"v1": 10, "v2": 90}
    clock[0] += router.REFRESH_WHILE_USED_S  # nobody asked for it since: no background reads
    assert cache.due_for_refresh() == []


@pytest.mark.django_db
def test_a_database_that_hangs_past_the_period_is_not_asked_again_by_the_next_request(
    registered_model, monkeypatch
) -> None:
    """The failure took 0.7 s (a connect that hangs, then fails): the last good table serves for a period
    from the failure, not from its start, which would make every request wait out the hang in turn."""
    clock, cache = _cache_on_a_clock(monkeypatch)
    tries = []

    def hangs_then_fails(**kwargs: object) -> None:
        tries.append(clock[0])
        clock[0] += 0.7
        raise ConnectionError("database unreachable")

    monkeypatch.setattr("serving.gateway.router.routing_revision", hangs_then_fails)
    monkeypatch.setattr("serving.gateway.router.routing_snapshot", hangs_then_fails)
    clock[0] = 1000.6
    assert cache.get("demo-chat").weights == {"v1": 100}  # type: ignore[union-attr]
    clock[0] += 0.05
    assert cache.get_fresh("demo-chat") == (True, cache.get("demo-chat"))
    assert len(tries) == 1


@pytest.mark.django_db
def test_while_one_read_of_a_table_hangs_the_other_requests_route_on_the_last_good_table(
    registered_model, monkeypatch
) -> None:
    """A database that hangs without an error (a network partition) holds the one thread revalidating
    the table; every other request routes at once on the table it is checking, instead of joining it in
    the hang until the worker threads run out."""
    import threading

    clock, cache = _cache_on_a_clock(monkeypatch)
    entered, release = threading.Event(), threading.Event()
    reads = []

    def hangs(**kwargs: object) -> None:
        reads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(30)
        raise ConnectionError("database unreachable")

    monkeypatch.setattr("serving.gateway.router.routing_revision", hangs)
    monkeypatch.setattr("serving.gateway.router.routing_snapshot", hangs)
    clock[0] = 1000.6  # stale: the next request revalidates
    first = threading.Thread(target=cache.get, args=("demo-chat",), name="first")
    first.start()
    try:
        assert entered.wait(30)
        for _ in range(5):
            assert cache.get("demo-chat").weights == {"v1": 100}  # type: ignore[union-attr]
    finally:
        release.set()
        first.join(30)
    assert reads == ["first"]


@pytest.mark.django_db
def test_names_of_no_model_take_no_lasting_place_in_the_cache(registered_model, monkeypatch) -> None:
    """Any client may ask for any name (a 404 each): they are not revalidated in the background, and
    past MAX_ENTRIES they make way, while the real model's table stays."""
    from serving.gateway import router

    monkeypatch.setattr(router, "MAX_ENTRIES", 50)
    clock, cache = _cache_on_a_clock(monkeypatch)
    for i in range(200):
        assert cache.get(f"nope-{i}") is None
    clock[0] += 0.3  # past half the period: what is in use is due for an early read
    assert cache.due_for_refresh() == ["demo-chat"]
    assert len(cache._entries) <= 50
    assert cache.get_fresh("demo-chat")[1] is not None
