"""An adapter version's request is placed on its base's replicas, and names the adapter in its submission
(serving/gateway/adapter_routing.py); every other version's is the runtime's own."""

from __future__ import annotations

from typing import Any

from registry.selectors import AdapterTarget, RoutingSnapshot
from serving.gateway.adapter_routing import AdapterPlacement, placed, with_adapter

SNAPSHOT = RoutingSnapshot(
    model_name="tune",
    kind="causal-lm",
    revision=1,
    weights={"v1": 100},
    aliases={"stable": "v1"},
    versions=frozenset({"v1", "v2"}),
    adapters={"v1": AdapterTarget("chat", "v3", "/store/tune/v1", "ab" * 32, 7)},
)


class Runtime:
    layer, hub, failures, can_cold_start = object(), object(), object(), True

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    async def candidates(self, model_name: str, version: str, *, refresh: bool = False) -> list[Any]:
        self.asked.append((model_name, version))
        return []

    async def wait_for_replica(self, model_name: str, version: str) -> list[Any]:
        self.asked.append((model_name, version))
        return []

    async def embedded_replica_coming(self, model_name: str, version: str) -> bool:
        self.asked.append((model_name, version))
        return True


async def test_an_adapter_versions_replicas_are_its_bases() -> None:
    runtime = Runtime()
    placement = placed(runtime, SNAPSHOT)  # type: ignore[arg-type]
    assert isinstance(placement, AdapterPlacement) and placement.layer is runtime.layer
    await placement.candidates("tune", "v1")
    await placement.wait_for_replica("tune", "v1")
    assert await placement.embedded_replica_coming("tune", "v1")
    await placement.candidates("tune", "v2")  # not an adapter: its own
    await placement.candidates("chat", "v1")  # another model's v1
    assert runtime.asked == [("chat", "v3")] * 3 + [("tune", "v2"), ("chat", "v1")]
    plain = RoutingSnapshot("chat", "causal-lm", 1, {"v1": 100}, {}, frozenset({"v1"}))
    assert placed(runtime, plain) is runtime  # type: ignore[arg-type, comparison-overlap]


def test_the_submission_names_the_adapter_of_the_version_it_goes_to() -> None:
    submission = {"reply_to": "inbox", "params": {}}
    named = with_adapter(submission, SNAPSHOT, "v1")
    assert named == {
        **submission,
        "adapter": "tune:v1",
        "adapter_uri": "/store/tune/v1",
        "adapter_sha256": "ab" * 32,
        "adapter_version_id": 7,
    }
    assert with_adapter(named, SNAPSHOT, "v2") == submission  # a shadow copy to a full version: none
