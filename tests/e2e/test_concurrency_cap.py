"""A tenant's concurrency cap under a burst, on a real server (docs/reliability.md, "Load"): 200 requests
at once from one key whose quota allows 10 in flight. The replica's load (its queue and batch, read from
/readyz every few milliseconds during the burst) never passes 10, the rest are refused 429 with
Retry-After, and the cap is used, not only enforced."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.conftest import METRICS_TOKEN, LiveServer

pytestmark = pytest.mark.live_server_process

NUM_REQUESTS = 200
CAP = 10


def test_two_hundred_at_once_never_puts_more_than_the_cap_on_the_replica(platform_server: LiveServer) -> None:
    key = platform_server.tenant_key("burst", max_concurrent=CAP)

    async def burst() -> tuple[list[int], list[str], int]:
        loads: list[int] = []
        done = asyncio.Event()
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 2)
        async with httpx.AsyncClient(base_url=platform_server.url, timeout=120, limits=limits) as client:

            async def watch() -> None:
                auth = {"Authorization": f"Bearer {METRICS_TOKEN}"}
                while not done.is_set():
                    replicas = (await client.get("/readyz", headers=auth)).json()["replicas"]
                    loads.append(sum(r["load"] for r in replicas if r["model"] == "demo-chat"))
                    await asyncio.sleep(0.005)

            async def one() -> httpx.Response:
                body = {"input": "once upon a time", "max_tokens": 64, "temperature": 0}
                return await client.post(
                    "/v1/models/demo-chat/infer", json=body, headers={"Authorization": f"Bearer {key}"}
                )

            watching = asyncio.create_task(watch())
            responses = await asyncio.gather(*(one() for _ in range(NUM_REQUESTS)))
            done.set()
            await watching
        retry_afters = [r.headers.get("Retry-After", "") for r in responses if r.status_code == 429]
        return [r.status_code for r in responses], retry_afters, max(loads)

    statuses, retry_afters, peak_load = asyncio.run(burst())
    print(
        f"\n{NUM_REQUESTS} at once, cap {CAP}: peak replica load {peak_load}, "
        f"served {statuses.count(200)}, refused 429 {statuses.count(429)}"
    )
    assert set(statuses) <= {200, 429}
    assert peak_load <= CAP
    assert statuses.count(200) >= CAP and statuses.count(429) > 0
    assert all(value.isdigit() for value in retry_afters)
