"""LoRA adapters on their base's replicas (docs/architecture.md, "Adapters on a shared base"). An adapter
version is an ordinary version of its model in routing (traffic split, alias, pin, shadow): once one is
chosen, its request goes to its base version's replicas with the adapter named in the submission, and the
replica loads the adapter on first use. The request stays the adapter's everywhere else: its
X-Served-Version, its failures and its metrics are the adapter version's."""

from __future__ import annotations

from typing import Any

from registry.selectors import RoutingSnapshot
from serving.gateway.data_plane import DataPlane, ReplicaHandle
from serving.gateway.failures import GatewayFailures
from serving.transport.reply_hub import ReplyHub

# The submission's fields that name an adapter (serving/transport/protocol.py's Submit).
ADAPTER_FIELDS = ("adapter", "adapter_uri", "adapter_sha256", "adapter_version_id")


def with_adapter(submission: dict[str, Any], snapshot: RoutingSnapshot, version: str) -> dict[str, Any]:
    """The submission for `version` of the snapshot's model: naming the adapter when it is one, and no
    adapter otherwise (a shadow copy of an adapter's request to a full version, say)."""
    plain = {k: v for k, v in submission.items() if k not in ADAPTER_FIELDS}
    target = snapshot.adapters.get(version)
    if target is None:
        return plain
    return {
        **plain,
        "adapter": f"{snapshot.model_name}:{version}",
        "adapter_uri": target.artifact_uri,
        "adapter_sha256": target.sha256,
        "adapter_version_id": target.version_id,
    }


def placed(runtime: DataPlane, snapshot: RoutingSnapshot) -> DataPlane:
    """The data plane a request of the snapshot's model is placed through: its adapter versions' replicas
    are their bases'."""
    return AdapterPlacement(runtime, snapshot) if snapshot.adapters else runtime


class AdapterPlacement:
    """A DataPlane that finds, waits for and asks to start the base's replicas for an adapter version of
    one model, and is the runtime itself for everything else."""

    def __init__(self, runtime: DataPlane, snapshot: RoutingSnapshot) -> None:
        self._runtime = runtime
        self._model_name = snapshot.model_name
        self._bases = {v: (t.base_model, t.base_version) for v, t in snapshot.adapters.items()}
        self.layer: Any = runtime.layer
        self.hub: ReplyHub = runtime.hub
        self.failures: GatewayFailures = runtime.failures

    @property
    def can_cold_start(self) -> bool:
        return self._runtime.can_cold_start

    def replicas_of(self, model_name: str, version: str) -> tuple[str, str]:
        """The version whose replicas serve `model_name:version`: its base, for an adapter."""
        if model_name == self._model_name and version in self._bases:
            return self._bases[version]
        return model_name, version

    async def candidates(
        self, model_name: str, version: str, *, refresh: bool = False
    ) -> list[ReplicaHandle]:
        return await self._runtime.candidates(*self.replicas_of(model_name, version), refresh=refresh)

    async def wait_for_replica(self, model_name: str, version: str) -> list[ReplicaHandle]:
        return await self._runtime.wait_for_replica(*self.replicas_of(model_name, version))

    async def embedded_replica_coming(self, model_name: str, version: str) -> bool:
        return await self._runtime.embedded_replica_coming(*self.replicas_of(model_name, version))

    async def is_alive(self, handle: ReplicaHandle) -> bool:
        return await self._runtime.is_alive(handle)
