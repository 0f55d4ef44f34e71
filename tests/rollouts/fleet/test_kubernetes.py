"""The Kubernetes provisioner, against a stand-in API server (httpx.MockTransport): the one boundary
here that cannot run for real, as no cluster is reachable. The stand-in answers the three calls as the
Kubernetes API does: list with a label selector, create (409 if the name exists), and a merge patch of
the scale subresource."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from rollouts.fleet.kubernetes import (
    MANAGED_BY,
    DeploymentsApi,
    KubernetesError,
    KubernetesProvisioner,
    PodTemplate,
    deployment_name,
)

BASE = "/apis/apps/v1/namespaces/serving/deployments"


class ApiServer:
    def __init__(self) -> None:
        self.deployments: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail_next: int | None = None  # a status code to answer the next call with

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.method, request.url.path))
        if self.fail_next is not None:
            status, self.fail_next = self.fail_next, None
            return httpx.Response(status, json={"kind": "Status", "message": "unavailable"})
        path = request.url.path
        if request.method == "GET" and path == BASE:
            key, _, value = request.url.params["labelSelector"].partition("=")
            items = [d for d in self.deployments.values() if d["metadata"]["labels"].get(key) == value]
            return httpx.Response(200, json={"kind": "DeploymentList", "items": items})
        if request.method == "POST" and path == BASE:
            body = json.loads(request.content)
            name = body["metadata"]["name"]
            if name in self.deployments:
                return httpx.Response(409, json={"kind": "Status", "reason": "AlreadyExists"})
            self.deployments[name] = body
            return httpx.Response(201, json=body)
        if request.method == "PATCH" and not path.endswith("/scale"):  # a merge patch of the Deployment
            assert request.headers["Content-Type"] == "application/merge-patch+json"
            deployment = self.deployments[path.removeprefix(BASE + "/")]
            patch = json.loads(request.content)
            deployment["metadata"]["annotations"].update(patch["metadata"]["annotations"])
            deployment["spec"]["template"] = patch["spec"]["template"]
            return httpx.Response(200, json=deployment)
        if request.method == "PATCH" and path.endswith("/scale"):
            assert request.headers["Content-Type"] == "application/merge-patch+json"
            name = path.removeprefix(BASE + "/").removesuffix("/scale")
            if name not in self.deployments:
                return httpx.Response(404, json={"kind": "Status", "reason": "NotFound"})
            self.deployments[name]["spec"]["replicas"] = json.loads(request.content)["spec"]["replicas"]
            return httpx.Response(200, json={"kind": "Scale"})
        return httpx.Response(405)

    def replicas(self) -> dict[str, int]:
        """model:version -> replicas, of every Deployment the provisioner made."""
        out = {}
        for deployment in self.deployments.values():
            annotations = deployment["metadata"].get("annotations", {})
            if "switchyard/model" in annotations:
                key = f"{annotations['switchyard/model']}:{annotations['switchyard/version']}"
                out[key] = deployment["spec"]["replicas"]
        return out


@pytest.fixture
def server() -> ApiServer:
    return ApiServer()


def _provisioner(server: ApiServer, image: str = "switchyard:1", **options: Any) -> KubernetesProvisioner:
    client = httpx.Client(transport=httpx.MockTransport(server.handle), base_url="https://k8s")
    template = PodTemplate(image=image, artifact_claim="artifacts", artifact_root="/srv/artifacts")
    return KubernetesProvisioner(DeploymentsApi(client, "serving"), template, **options)


def test_each_version_gets_a_deployment_scaled_to_its_target_and_a_retired_one_goes_to_zero(
    server: ApiServer,
) -> None:
    provisioner = _provisioner(server)
    provisioner.reconcile({("chat", "v1"): 2, ("chat", "v2"): 1, ("embed", "v1"): 0})
    assert server.replicas() == {"chat:v1": 2, "chat:v2": 1}  # a target of 0 creates nothing
    provisioner.reconcile({("chat", "v1"): 3, ("chat", "v2"): 1})
    assert server.replicas() == {"chat:v1": 3, "chat:v2": 1}
    assert [c for c in server.calls if c[0] == "PATCH"] == [
        ("PATCH", f"{BASE}/{deployment_name('chat', 'v1')}/scale")
    ]
    provisioner.reconcile({("chat", "v1"): 3})  # v2 rolled back: kept at 0, not deleted
    assert server.replicas() == {"chat:v1": 3, "chat:v2": 0}
    num_calls = len(server.calls)
    provisioner.reconcile({("chat", "v1"): 3})
    assert len(server.calls) == num_calls + 1  # met: one list, nothing written


def test_the_pod_runs_its_versions_replica_with_a_gpu_the_shared_environment_and_time_to_drain(
    server: ApiServer,
) -> None:
    _provisioner(server).reconcile({("Chat_Model.large", "2024-06"): 1})
    (deployment,) = server.deployments.values()
    name = deployment["metadata"]["name"]
    assert name == deployment_name("Chat_Model.large", "2024-06")
    assert name.startswith("replica-chat-model-large-2024-06-") and len(name) <= 63
    assert deployment["metadata"]["labels"]["app.kubernetes.io/managed-by"] == MANAGED_BY
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["command"][-4:] == ["--model", "Chat_Model.large", "--version", "2024-06"]
    assert container["image"] == "switchyard:1"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert container["envFrom"] == [{"secretRef": {"name": "switchyard-env"}}]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 600  # SIGTERM drains; this long to do it
    # the registry's files, at the path they were stored under
    assert container["env"] == [{"name": "ARTIFACT_ROOT", "value": "/srv/artifacts"}]
    assert container["volumeMounts"] == [
        {"name": "artifacts", "mountPath": "/srv/artifacts", "readOnly": True}
    ]
    assert pod["spec"]["volumes"] == [
        {"name": "artifacts", "persistentVolumeClaim": {"claimName": "artifacts"}}
    ]
    # It parses tenants' tokenizer files: no API token, no privilege to gain, no capability.
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    with pytest.raises(ValueError, match="gpus must be 0 or 1"):
        PodTemplate(image="x", artifact_claim="a", artifact_root="/a", gpus=2)


def test_names_stay_apart_where_their_slugs_would_meet() -> None:
    assert deployment_name("chat", "v1.0") != deployment_name("chat", "v1-0")


def test_another_provisioners_models_and_unmanaged_deployments_are_left_alone(server: ApiServer) -> None:
    _provisioner(server).reconcile({("chat", "v1"): 1, ("embed", "v1"): 1})
    _provisioner(server, models=frozenset({"chat"})).reconcile({("chat", "v1"): 2})
    assert server.replicas() == {"chat:v1": 2, "embed:v1": 1}  # embed is not this one's to scale down
    server.deployments["web"] = {"metadata": {"name": "web", "labels": {}}, "spec": {"replicas": 3}}
    _provisioner(server).reconcile({("chat", "v1"): 2, ("embed", "v1"): 1})
    assert server.deployments["web"]["spec"]["replicas"] == 3  # not labelled as ours: never listed


def test_a_new_image_reaches_the_deployments_made_before_it(server: ApiServer) -> None:
    _provisioner(server).reconcile({("chat", "v1"): 2})
    _provisioner(server, image="switchyard:2").reconcile({("chat", "v1"): 2})
    (deployment,) = server.deployments.values()
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "switchyard:2"
    assert deployment["spec"]["replicas"] == 2
    writes = len([c for c in server.calls if c[0] != "GET"])
    _provisioner(server, image="switchyard:2").reconcile({("chat", "v1"): 2})
    assert len([c for c in server.calls if c[0] != "GET"]) == writes  # the same template: no patch


def test_a_name_taken_by_something_else_fails_that_version_only(server: ApiServer) -> None:
    taken = deployment_name("chat", "v1")
    server.deployments[taken] = {"metadata": {"name": taken, "labels": {}}, "spec": {"replicas": 1}}
    with pytest.raises(KubernetesError, match="409"):
        _provisioner(server).reconcile({("chat", "v1"): 1, ("embed", "v1"): 1})
    assert server.replicas() == {"embed:v1": 1}  # the other version was not held up by it


def test_an_api_server_that_refuses_raises_and_the_next_pass_catches_up(server: ApiServer) -> None:
    provisioner = _provisioner(server)
    server.fail_next = 503
    with pytest.raises(KubernetesError, match="503"):
        provisioner.reconcile({("chat", "v1"): 1})
    assert server.deployments == {}
    provisioner.reconcile({("chat", "v1"): 1})
    assert server.replicas() == {"chat:v1": 1}
