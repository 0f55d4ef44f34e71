"""A client that leaves is aborted on the replica within two engine steps (docs/reliability.md,
"Disconnects"): the step under way when its abort arrives, and at most the one that had already begun.
20 streams at once on the embedded replica; 10 of them closed at random tokens (seeded). Counted in the
engine's own steps, at the moment each close is made and at the moment the engine frees the sequence."""

from __future__ import annotations

import asyncio
import random

import pytest
from asgiref.sync import sync_to_async

from tests.serving.gateway.test_dispatch import _hello

pytestmark = pytest.mark.django_db(transaction=True)

NUM_STREAMS = 20
NUM_LEAVING = 10


async def test_a_leaving_clients_sequence_is_freed_within_two_engine_steps(make_tenant, runtime) -> None:
    acme = await sync_to_async(make_tenant)("acme", max_concurrent_requests=100, requests_per_second=1000)
    (replica,) = [r for r in runtime.replicas.values() if r.ref.model_name == "demo-chat"]
    engine = replica.engine
    freed_at_step: dict[str, int] = {}
    abort = engine.abort

    def counted_abort(request_id: str) -> object:
        freed_at_step[request_id] = engine.stats().num_steps  # on the model thread, as it frees it
        return abort(request_id)

    engine.abort = counted_abort
    rng = random.Random(7)
    handles = [await _hello(acme, max_tokens=200) for _ in range(NUM_STREAMS)]
    leaving = set(rng.sample(range(NUM_STREAMS), NUM_LEAVING))
    closed_at_step: dict[str, int] = {}

    async def read(i: int) -> None:
        handle = handles[i]
        leave_after = rng.randrange(1, 100) if i in leaving else None
        n = 0
        async for _ in handle.events():
            n += 1
            if leave_after is not None and n >= leave_after:
                closed_at_step[handle._wire_id] = engine.stats().num_steps
                await handle.close()
                return
        await handle.close()

    try:
        await asyncio.wait_for(asyncio.gather(*(read(i) for i in range(NUM_STREAMS))), timeout=120)
        await asyncio.wait_for(replica.wait_idle(), timeout=30)
    finally:
        engine.abort = abort
    steps_late = sorted(freed_at_step[wire_id] - at for wire_id, at in closed_at_step.items())
    print(f"\n{len(steps_late)} clients left; engine steps from close to free: {steps_late}")
    assert len(steps_late) == NUM_LEAVING
    assert max(steps_late) <= 2
    assert engine.stats().kv_cache_usage == 0.0
