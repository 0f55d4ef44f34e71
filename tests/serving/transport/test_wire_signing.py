"""The submission layer's HMAC (serving/transport/wire_signing.py): a message written to a replica's
channel by anyone without the shared secret (a forged tenant or cache group, an abort of another's
request) is dropped before the replica reads it, and counted in the version's metrics."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.replica.metrics_flush import flush_metrics_periodically
from serving.telemetry import metric_window as m
from serving.telemetry.recorder import MetricsRecorder
from serving.transport.protocol import Submit
from serving.transport.wire_signing import ForgedMessage, WireSigner
from tests.serving.conftest import one_trip_layer

CHANNEL = "switchyard.replica.demo-chat.v1.abc"


@given(st.binary(max_size=512), st.integers(min_value=0, max_value=10_000))
def test_any_change_to_a_signed_message_is_caught(body: bytes, where: int) -> None:
    signer = WireSigner("the secret")
    signed = bytearray(signer.sign(body))
    assert signer.unsign(bytes(signed)) == body
    signed[where % len(signed)] ^= 0x01
    with pytest.raises(ForgedMessage):
        signer.unsign(bytes(signed))
    with pytest.raises(ForgedMessage):
        WireSigner("another secret").unsign(signer.sign(body))


@pytest.mark.redis
async def test_a_submission_without_the_secret_is_dropped_and_counted(redis_url: str) -> None:
    replica_side = one_trip_layer(redis_url, signing_key="the secret")
    gateway = one_trip_layer(redis_url, signing_key="the secret")
    attacker = one_trip_layer(redis_url)  # the same Redis, no secret
    attacker.prefix = gateway.prefix = replica_side.prefix
    forged = Submit("r-forged", "inbox", {"max_tokens": 1}, input="x", tenant="victim", cache_group="victim")
    real = Submit("r-real", "inbox", {"max_tokens": 1}, input="x", tenant="acme")
    try:
        await attacker.send(CHANNEL, forged.to_wire())
        await gateway.send(CHANNEL, real.to_wire())
        received = await asyncio.wait_for(replica_side.receive(CHANNEL), timeout=5)
        assert Submit.from_wire(received) == real
        assert replica_side.forged[CHANNEL] == 1
    finally:
        await replica_side.flush()


async def test_the_replica_counts_the_drops_on_its_channel_in_its_metrics(settings) -> None:  # type: ignore[no-untyped-def]
    settings.METRICS_FLUSH_INTERVAL_S = 0.01

    class Layer:
        forged = {CHANNEL: 3, "switchyard.replica.other.v1.def": 5}

    metrics = MetricsRecorder(model_name="demo-chat", version="v1", version_id=0, replica_id="abc")
    metrics.flush = lambda: 0  # type: ignore[method-assign]  # no store here: the count is what is tested
    flushing = asyncio.create_task(flush_metrics_periodically(metrics, layer=Layer(), channel_name=CHANNEL))
    try:
        async with asyncio.timeout(5):
            while metrics.snapshot().totals.counters.get(m.FORGED, 0) == 0:
                await asyncio.sleep(0.01)
    finally:
        flushing.cancel()
    assert metrics.snapshot().totals.counters[m.FORGED] == 3
    assert Layer.forged == {"switchyard.replica.other.v1.def": 5}  # another replica's, left to it
