"""Process-wide settings a replica applies when it loads."""

from __future__ import annotations

import sys

import pytest


@pytest.mark.django_db(transaction=True)
async def test_a_replica_shortens_the_gil_switch_interval_so_the_event_loop_is_not_starved(
    registered_model, settings
) -> None:
    from serving.runtime import get_runtime

    default = sys.getswitchinterval()
    settings.REPLICA_GIL_SWITCH_INTERVAL_S = 0.001
    try:
        runtime = await get_runtime()
        assert await runtime.wait_ready()
        assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        sys.setswitchinterval(default)
