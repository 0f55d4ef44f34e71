"""GET /readyz: ready once the database answers and, where the server hosts its replicas (embedded), one is
ready and none is still loading; a gateway in front of replica processes is ready whatever they do."""

from __future__ import annotations

import httpx
import pytest

from serving.gateway.data_plane import ReplicaHandle

pytestmark = pytest.mark.django_db(transaction=True)


def _handle(model: str, state: str, *, is_local: bool = True) -> ReplicaHandle:
    return ReplicaHandle(
        replica_id=f"{model}-{state}",
        model_name=model,
        version="v1",
        channel_name=f"switchyard.replica.{model}.v1.x",
        state=state,
        load=0,
        kv_cache_usage=0.0,
        is_ready=state == "ready",
        is_local=is_local,
    )


@pytest.mark.parametrize(
    ("states", "ready"),
    [
        ({"chat": "ready", "embed": "loading"}, False),  # the chat model would answer 503 meanwhile
        ({"chat": "ready", "embed": "ready"}, True),
        ({"chat": "ready", "embed": "failed"}, True),  # a failed load does not hold the rest back
        ({"chat": "failed"}, False),
        ({}, False),
    ],
)
async def test_ready_only_when_no_replica_is_still_loading(
    monkeypatch, settings, states: dict, ready: bool
) -> None:
    settings.EMBEDDED_REPLICAS = True
    response = await _readyz(
        monkeypatch, settings, [_handle(model, state) for model, state in states.items()]
    )
    assert response.status_code == (200 if ready else 503)
    assert response.json()["ready"] is ready


@pytest.mark.parametrize(
    "handles",
    [
        [],  # every model scaled to zero: requests for them wait at the gateway for a cold start
        [_handle("chat", "ready", is_local=False), _handle("chat", "loading", is_local=False)],  # scaling up
    ],
)
async def test_a_gateway_in_front_of_replica_processes_is_ready_whatever_they_do(
    monkeypatch, settings, handles: list
) -> None:
    settings.EMBEDDED_REPLICAS = False
    settings.METRICS_TOKEN = "scrape"
    response = await _readyz(monkeypatch, settings, handles, headers={"Authorization": "Bearer scrape"})
    assert response.status_code == 200 and response.json()["replicas"] == [
        {
            "model": "chat",
            "version": "v1",
            "state": h.state,
            "replica_id": h.replica_id,
            "load": 0,
            "kv_cache_usage": 0.0,
            "local": False,
        }
        for h in handles
    ]


async def test_the_replica_list_is_for_the_metrics_token_or_staff_not_a_load_balancer(
    monkeypatch, settings
) -> None:
    """It names every model served, tenants' own too: what /metrics keeps to its readers."""
    settings.EMBEDDED_REPLICAS = False
    settings.METRICS_TOKEN = "scrape"
    handles = [_handle("acme-private-ft", "ready", is_local=False)]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        anonymous = await _readyz(monkeypatch, settings, handles, headers=headers)
        assert anonymous.json() == {"ready": True, "database": True, "num_ready_replicas": 1}
    scraper = await _readyz(monkeypatch, settings, handles, headers={"Authorization": "Bearer scrape"})
    assert [r["model"] for r in scraper.json()["replicas"]] == ["acme-private-ft"]


async def test_a_replica_directory_it_cannot_read_is_said_in_json_not_a_500(monkeypatch, settings) -> None:
    """Redis down: a load balancer's probe gets the JSON it always gets, and the gateway stays ready (every
    gateway shares the directory; taking them all out would refuse connections instead of 503s)."""
    import redis.exceptions

    settings.EMBEDDED_REPLICAS = False
    unreachable = redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379")
    response = await _readyz(monkeypatch, settings, [], directory_error=unreachable)
    assert response.status_code == 200
    assert response.json() == {
        "ready": True,
        "database": True,
        "num_ready_replicas": 0,
        "replica_directory": False,
    }


async def _readyz(  # type: ignore[no-untyped-def]
    monkeypatch,
    settings,
    handles: list,
    headers: dict | None = None,
    directory_error: Exception | None = None,
) -> httpx.Response:
    from config.asgi import application
    from serving.edge import probes as api

    class Runtime:
        async def all_replicas(self) -> list[ReplicaHandle]:
            if directory_error is not None:
                raise directory_error
            return handles

        def local_replicas(self) -> list[ReplicaHandle]:
            return [h for h in handles if h.is_local]

    async def get_runtime() -> Runtime:
        return Runtime()

    monkeypatch.setattr(api, "get_runtime", get_runtime)
    settings.ALLOWED_HOSTS = ["localhost"]
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        return await client.get("/readyz", headers=headers or {})


async def test_a_flood_of_probes_asks_the_database_once_a_second(monkeypatch, settings) -> None:
    """/readyz answers anyone: a probe per request, each on a new connection, let a flood load the
    database and the worker threads that key lookups wait for."""
    import asyncio

    from config.asgi import application
    from serving.edge import probes as api

    probes = []

    def database_ok() -> bool:
        probes.append(1)
        return True

    class Runtime:
        async def all_replicas(self) -> list[ReplicaHandle]:
            return []

    async def get_runtime() -> Runtime:
        return Runtime()

    monkeypatch.setattr(api, "_database_ok", database_ok)
    monkeypatch.setattr(api, "get_runtime", get_runtime)
    monkeypatch.setattr(api, "_DATABASE_PROBE_S", 60.0)  # however slowly the 40 requests go through
    settings.EMBEDDED_REPLICAS, settings.ALLOWED_HOSTS = False, ["localhost"]
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        first = await asyncio.gather(*(client.get("/readyz") for _ in range(20)))
        then = await asyncio.gather(*(client.get("/readyz") for _ in range(20)))
    assert {r.json()["database"] for r in [*first, *then]} == {True}
    assert len(probes) == 1


async def test_a_probe_the_database_does_not_answer_reads_as_down_within_seconds(
    monkeypatch, settings
) -> None:
    """A partition holds a connect for its timeouts (15 s and more); a load balancer's probe must not."""
    import threading

    from serving.edge import probes as api

    answer = threading.Event()

    def hanging() -> bool:
        answer.wait(10)
        return True

    monkeypatch.setattr(api, "_database_ok", hanging)
    monkeypatch.setattr(api, "_DATABASE_PROBE_WAIT_S", 0.2)
    settings.EMBEDDED_REPLICAS = False
    try:
        response = await _readyz(monkeypatch, settings, [])
        assert response.status_code == 503 and response.json()["database"] is False
    finally:
        answer.set()
