"""The provisioner beyond one machine: a Kubernetes Deployment per model version, its `replicas` set to
the autoscaler's target (rollouts.selectors.wanted_replicas), as docs/architecture.md, "The control plane",
describes.

`manage.py run_provisioner --kubernetes` calls `KubernetesProvisioner.reconcile` every few seconds. It
talks to the API server over HTTP (the in-cluster service account, or a URL and token given), asks
only for apps/v1 Deployments in its namespace that carry its label, and is stateless: a restarted
provisioner reads what runs from the cluster. A Deployment it created is never deleted, only scaled to
0 when its version stops serving, so that a rollback to it scales one number up rather than waiting for
an object to be created and scheduled. Each pod runs `manage.py run_replica` for its version with one
GPU; Kubernetes sends SIGTERM on scale-down, on which a replica drains, and the grace period gives it
time to.

Not run against a real cluster here (none is reachable): the tests drive it against a stand-in API
server (httpx.MockTransport) that answers as the Kubernetes API does for these calls."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import ssl
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (model name, version)
MANAGED_BY = "switchyard-provisioner"
TEMPLATE_HASH = "switchyard/template-hash"
MERGE_PATCH = "application/merge-patch+json"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubernetesError(Exception):
    """The API server refused a call or could not be reached; the pass is retried on the next one."""


@dataclass(frozen=True, slots=True)
class PodTemplate:
    """What every replica pod gets besides its model and version."""

    image: str
    # The registry's artifacts: a ReadWriteMany claim the web pods that register models mount too, at
    # the same path (ARTIFACT_ROOT), since a version's files are found by the path they were stored at.
    artifact_claim: str
    artifact_root: str
    env_from: Sequence[str] = ("switchyard-env",)  # Secrets with DATABASE_URL, REDIS_URL, SECRET_KEY, …
    gpus: int = 1  # nvidia.com/gpu per replica (a replica uses one device); 0: CPU replicas
    drain_grace_s: int = 600  # SIGTERM to SIGKILL: what a replica may take to finish its requests
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.gpus not in (0, 1):
            raise ValueError("a replica uses one device: gpus must be 0 or 1")


def deployment_name(model: str, version: str) -> str:
    """A DNS-1123 name, unique per (model, version) even where the slug of two would match."""
    digest = hashlib.sha256(f"{model}\0{version}".encode()).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9-]+", "-", f"{model}-{version}".lower()).strip("-")[:40].strip("-")
    return f"replica-{slug}-{digest}"


def deployment_manifest(model: str, version: str, replicas: int, template: PodTemplate) -> dict[str, Any]:
    name = deployment_name(model, version)
    # Label values are limited to 63 characters of [A-Za-z0-9._-]; the names live in annotations.
    selector = {"app.kubernetes.io/name": "switchyard-replica", "switchyard/deployment": name}
    labels = {**template.labels, **selector, "app.kubernetes.io/managed-by": MANAGED_BY}
    annotations = {"switchyard/model": model, "switchyard/version": version}
    resources = {"limits": {"nvidia.com/gpu": str(template.gpus)}} if template.gpus else {}
    container = {
        "name": "replica",
        "image": template.image,
        "command": ["python", "manage.py", "run_replica", "--model", model, "--version", version],
        "env": [{"name": "ARTIFACT_ROOT", "value": template.artifact_root}],
        "envFrom": [{"secretRef": {"name": n}} for n in template.env_from],
        "resources": resources,
        "volumeMounts": [{"name": "artifacts", "mountPath": template.artifact_root, "readOnly": True}],
        # A replica parses tenants' tokenizer files and chat templates: it gets no privilege to gain and
        # no capability, and (below) no API token, since it never calls the Kubernetes API. Whether it
        # runs as root is the image's choice (runAsNonRoot would refuse an image that does).
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod_template = {
        "metadata": {"labels": labels, "annotations": annotations},
        "spec": {
            "automountServiceAccountToken": False,
            "containers": [container],
            "volumes": [
                {"name": "artifacts", "persistentVolumeClaim": {"claimName": template.artifact_claim}}
            ],
            "terminationGracePeriodSeconds": template.drain_grace_s,
        },
    }
    # So that a changed image, GPU count or environment reaches Deployments made before the change.
    annotations = {**annotations, TEMPLATE_HASH: _template_hash(pod_template)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {"replicas": replicas, "selector": {"matchLabels": selector}, "template": pod_template},
    }


def _template_hash(pod_template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(pod_template, sort_keys=True).encode()).hexdigest()[:16]


class _ServiceAccountToken(httpx.Auth):
    """The pod's token, read for each request: the kubelet rotates the file."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def auth_flow(self, request: httpx.Request) -> Any:
        request.headers["Authorization"] = f"Bearer {self._path.read_text().strip()}"
        yield request


class DeploymentsApi:
    """The four calls the provisioner makes to the Kubernetes API (apps/v1 Deployments)."""

    def __init__(self, client: httpx.Client, namespace: str) -> None:
        self._client = client
        self._base = f"/apis/apps/v1/namespaces/{namespace}/deployments"

    @classmethod
    def in_cluster(cls, namespace: str | None = None) -> DeploymentsApi:
        """From the pod's service account, as every in-cluster client does."""
        import os

        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        namespace = namespace or (SERVICE_ACCOUNT / "namespace").read_text().strip()
        client = httpx.Client(
            base_url=f"https://{host}:{port}",
            auth=_ServiceAccountToken(SERVICE_ACCOUNT / "token"),
            verify=ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt")),
            timeout=10.0,
        )
        return cls(client, namespace)

    def managed(self) -> dict[str, dict[str, Any]]:
        """name -> Deployment, for those this provisioner manages."""
        body = self._call(
            "GET", self._base, params={"labelSelector": f"app.kubernetes.io/managed-by={MANAGED_BY}"}
        )
        return {item["metadata"]["name"]: item for item in body.get("items", [])}

    def create(self, manifest: dict[str, Any]) -> None:
        self._call("POST", self._base, json=manifest)

    def replace_template(self, name: str, manifest: dict[str, Any]) -> None:
        """The pod template and its hash annotation from `manifest`; replicas as they are."""
        patch = {
            "metadata": {"annotations": {TEMPLATE_HASH: manifest["metadata"]["annotations"][TEMPLATE_HASH]}},
            "spec": {"template": manifest["spec"]["template"]},
        }
        self._call(
            "PATCH", f"{self._base}/{name}", content=json.dumps(patch), headers={"Content-Type": MERGE_PATCH}
        )

    def scale(self, name: str, replicas: int) -> None:
        self._call(
            "PATCH",
            f"{self._base}/{name}/scale",
            content=json.dumps({"spec": {"replicas": int(replicas)}}),
            headers={"Content-Type": MERGE_PATCH},
        )

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise KubernetesError(f"{method} {path}: {exc}") from exc
        if response.status_code >= 400:
            raise KubernetesError(f"{method} {path}: {response.status_code} {response.text[:300]}")
        return response.json() if response.content else {}


@dataclass(slots=True)
class KubernetesProvisioner:
    api: DeploymentsApi
    template: PodTemplate
    models: frozenset[str] | None = None  # only these models' versions; None: every model

    def reconcile(self, targets: Mapping[Key, int]) -> None:
        """One pass: every wanted version's Deployment exists with its target as `replicas` and this
        provisioner's pod template; every other Deployment it made is at 0. A call that fails does not
        stop the others: the pass goes on, then raises KubernetesError naming each failure."""
        wanted = {k: n for k, n in targets.items() if self.models is None or k[0] in self.models}
        existing = self.api.managed()
        names = {deployment_name(*key): key for key in wanted}
        failures: list[str] = []
        for name, key in sorted(names.items()):
            with _noted(failures):
                self._meet(name, key, wanted[key], existing.get(name))
        for name, deployment in sorted(existing.items()):
            model = deployment["metadata"].get("annotations", {}).get("switchyard/model")
            if name in names or (self.models is not None and model not in self.models):
                continue
            if deployment["spec"].get("replicas"):
                with _noted(failures):
                    self.api.scale(name, 0)  # kept, at 0: a rollback to it is one number
                    logger.info("provisioner: %s scaled to 0 (its version no longer serves)", name)
        if failures:
            raise KubernetesError("; ".join(failures))

    def _meet(self, name: str, key: Key, replicas: int, deployment: dict[str, Any] | None) -> None:
        manifest = deployment_manifest(*key, replicas, self.template)
        if deployment is None:
            if replicas > 0:
                self.api.create(manifest)  # a 409 (the name taken by something not ours) is a failure
                logger.info("provisioner: created %s for %s:%s with %d replicas", name, *key, replicas)
            return
        annotations = deployment["metadata"].get("annotations", {})
        if annotations.get(TEMPLATE_HASH) != manifest["metadata"]["annotations"][TEMPLATE_HASH]:
            self.api.replace_template(name, manifest)  # Kubernetes rolls the pods over to it
            logger.info("provisioner: %s takes the current pod template", name)
        if deployment["spec"].get("replicas") != replicas:
            self.api.scale(name, replicas)
            logger.info("provisioner: %s:%s scaled to %d replicas", *key, replicas)

    def shutdown(self, timeout_s: float = 0.0) -> None:
        """Nothing to stop: the cluster keeps the replicas running, and the next provisioner takes over."""


@contextlib.contextmanager
def _noted(failures: list[str]) -> Iterator[None]:
    try:
        yield
    except KubernetesError as exc:
        failures.append(str(exc))
