"""A request to a version scaled to zero waits, up to COLD_START_TIMEOUT_S, until a replica started for it
reports ready, as Knative's activator holds a request. The client waits unanswered; if it leaves, the view
is cancelled and so is this wait."""

from __future__ import annotations

import asyncio
import logging

from django.conf import settings

from serving.gateway.data_plane import DataPlane, ReplicaHandle
from serving.gateway.errors import GatewayError

logger = logging.getLogger(__name__)


class ColdStartTimedOut(GatewayError):
    """No replica became ready in time: a failure of the version, which the gateway counts."""


async def wait_for_a_replica(runtime: DataPlane, model_name: str, version: str) -> list[ReplicaHandle]:
    """The version's replicas once one is ready. Raises ColdStartTimedOut, or GatewayError(503) when the
    routing moved the version's traffic away meanwhile."""
    timeout_s = settings.COLD_START_TIMEOUT_S
    logger.info("%s:%s has no replica: waiting for one to start", model_name, version)
    try:
        async with asyncio.timeout(timeout_s):
            replicas = await runtime.wait_for_replica(model_name, version)
    except TimeoutError:
        raise ColdStartTimedOut(
            503,
            f"no replica of {model_name}:{version} became ready within {timeout_s:g} s "
            "(it had none, and one is starting)",
            retry_after_s=5,
        ) from None
    # None: the routing moved its traffic away while it waited, and the split now sends it elsewhere.
    if not replicas:
        raise GatewayError(
            503,
            f"{model_name}:{version} takes no traffic any more (its routing changed while the "
            "request waited for a replica to start): send it again",
            retry_after_s=1,
        )
    return replicas
