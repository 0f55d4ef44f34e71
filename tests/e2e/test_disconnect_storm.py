"""A disconnect storm on a real server (docs/reliability.md, "Disconnects"): 100 streams at once, half
SSE and half WebSocket, of which 10%, 30% or 50% leave at a random token, and a few stop reading without
leaving. Afterwards no KV block is held and nothing waits or runs on the replica, and every stream that
stayed got every token (indices without a gap, as many as its usage says)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx
import pytest
import websockets

from tests.e2e.conftest import METRICS_TOKEN, LiveServer

pytestmark = pytest.mark.live_server_process

NUM_STREAMS = 100
MAX_TOKENS = 48
BODY = {"input": "once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0}


async def _sse(
    client: httpx.AsyncClient, key: str, leave_at: int | None, stall: bool
) -> list[dict[str, Any]] | None:
    events: list[dict[str, Any]] = []
    body = {**BODY, "stream": True}
    async with client.stream(
        "POST", "/v1/models/demo-chat/infer", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if leave_at is not None and len(events) > leave_at:
                return None  # leaving the block closes the connection mid-stream
            if stall and len(events) == 1:
                await asyncio.sleep(3)  # stops reading for a while; the server buffers or cuts it off
    return events


async def _ws(url: str, key: str, leave_at: int | None, stall: bool) -> list[dict[str, Any]] | None:
    events: list[dict[str, Any]] = []
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as socket:
        await socket.send(json.dumps({"type": "infer", **BODY}))
        while True:
            message = json.loads(await asyncio.wait_for(socket.recv(), timeout=60))
            events.append(message)
            if message["type"] != "token":
                return events
            if leave_at is not None and len(events) > leave_at:
                return None  # leaving the block closes the socket mid-stream
            if stall and len(events) == 1:
                await asyncio.sleep(3)


@pytest.fixture(scope="module")
def storm_key(platform_server: LiveServer) -> str:
    """A tenant whose quota lets the whole storm in at once (the demo key's allows 50 a second)."""
    return platform_server.tenant_key("storm", max_concurrent=1000)


def _replicas(client: httpx.Client) -> list[dict[str, Any]]:
    replicas = client.get("/readyz", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).json()["replicas"]
    return [r for r in replicas if r["model"] == "demo-chat"]


@pytest.mark.parametrize("share_leaving", [0.1, 0.3, 0.5])
def test_a_disconnect_storm_leaks_nothing_and_the_rest_get_every_token(
    platform_server: LiveServer, storm_key: str, share_leaving: float
) -> None:
    rng = random.Random(int(share_leaving * 100))
    key, ws_url = (
        storm_key,
        platform_server.url.replace("http://", "ws://") + "/v1/models/demo-chat/stream",
    )
    plans = [
        (
            i % 2 == 0,
            rng.randrange(1, MAX_TOKENS - 1) if rng.random() < share_leaving else None,
            rng.random() < 0.05,
        )
        for i in range(NUM_STREAMS)
    ]

    async def storm() -> list[list[dict[str, Any]] | None]:
        limits = httpx.Limits(max_connections=NUM_STREAMS + 2)
        async with httpx.AsyncClient(base_url=platform_server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(
                *(
                    _sse(client, key, leave_at, stall) if is_sse else _ws(ws_url, key, leave_at, stall)
                    for is_sse, leave_at, stall in plans
                )
            )

    started = time.monotonic()
    results = asyncio.run(storm())
    ended = time.monotonic()
    with httpx.Client(base_url=platform_server.url, timeout=10) as client:
        deadline = time.monotonic() + 30
        while (
            any(r["load"] or r["kv_cache_usage"] for r in _replicas(client)) and time.monotonic() < deadline
        ):
            time.sleep(0.05)  # the replica's state is polled: no event says the last abort landed
        idle_after_s = time.monotonic() - ended
        replicas = _replicas(client)
    stayed = [events for events in results if events is not None]
    for events in stayed:
        tokens = [e for e in events if e.get("type", "token") == "token" and "index" in e]
        final = events[-1]
        assert final.get("finish_reason") in ("length", "stop"), final
        assert [t["index"] for t in tokens] == list(range(len(tokens)))
        assert len(tokens) == final["usage"]["completion_tokens"]
    print(
        f"\n{NUM_STREAMS} streams, {len(results) - len(stayed)} left ({share_leaving:.0%} planned), "
        f"{sum(stall for *_, stall in plans)} stalled: storm {ended - started:.1f} s, replica idle "
        f"{idle_after_s:.2f} s after, KV {[r['kv_cache_usage'] for r in replicas]}"
    )
    assert all(r["load"] == 0 and r["kv_cache_usage"] == 0 for r in replicas), replicas
    assert len(stayed) == sum(leave_at is None for _, leave_at, _ in plans)
