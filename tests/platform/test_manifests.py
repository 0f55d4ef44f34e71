"""The Kubernetes manifests (platform/kubernetes/), offline: every one against the Kubernetes schemas
(kubernetes-validate ships them), and the names they share checked against each other, the image
(Dockerfile, scripts/image-entrypoint), config/settings.py and the provisioner. The base is read as its
files; the example overlay is rendered with `kubectl kustomize`, as `kubectl apply -k` would send it.
Each check is also run on a copy broken on purpose, which it must catch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.urls import Resolver404, resolve

from tests.conftest import REPO_ROOT
from tests.platform import manifest_checks as checks
from tests.platform.manifest_checks import Doc

# The oldest Kubernetes the manifests are for (policy/v1 PodDisruptionBudgets, Pod Security labels):
# the base is checked against it, the rendered overlay (the base's resources, transformed) against the
# newest whose schemas kubernetes-validate ships. Each document's check reads the schemas anew (~0.1 s).
OLDEST_KUBERNETES = "1.30"


def _url_name(path: str) -> str | None:
    try:
        name: str | None = resolve(path).url_name
        return name
    except Resolver404:
        return None


@pytest.fixture(scope="module")
def base() -> list[Doc]:
    return checks.base_documents()


@pytest.fixture(scope="module")
def overlay() -> list[Doc]:
    try:
        return checks.render(checks.OVERLAY)
    except FileNotFoundError:
        pytest.skip("kubectl is not installed: the overlay is rendered with `kubectl kustomize`")


@pytest.fixture(scope="module")
def image() -> checks.Image:
    return checks.read_image()


@pytest.fixture(scope="module")
def settings_names() -> set[str]:
    return checks.settings_names()


@pytest.fixture(scope="module")
def defaults() -> dict[str, Any]:
    return checks.provisioner_defaults()


def _all_checks(
    docs: list[Doc], image: checks.Image, settings_names: set[str], defaults: dict[str, Any]
) -> list[str]:
    return [
        *checks.env_problems(docs, settings_names),
        *checks.secret_problems(docs, image, defaults),
        *checks.container_problems(docs, image, defaults),
        *checks.probe_problems(docs, _url_name, image),
        *checks.service_problems(docs),
        *checks.network_policy_problems(docs, checks.replica_pod_labels()),
    ]


# --- the real manifests ------------------------------------------------------------------------------


def test_every_yaml_file_is_a_kustomization_or_listed_in_one() -> None:
    listed = checks.listed_files(checks.BASE) | checks.listed_files(checks.OVERLAY)
    files = {p.resolve() for p in checks.KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files - listed == set()  # a manifest no kustomization names would never be applied


def test_the_base_matches_the_kubernetes_schemas(base: list[Doc]) -> None:
    assert checks.schema_problems(base, OLDEST_KUBERNETES) == []


def test_the_rendered_overlay_matches_the_kubernetes_schemas(overlay: list[Doc]) -> None:
    from kubernetes_validate.utils import latest_version

    assert checks.schema_problems(overlay, latest_version()) == []


def test_the_base_agrees_with_itself_the_image_and_the_settings(
    base: list[Doc], image: checks.Image, settings_names: set[str], defaults: dict[str, Any]
) -> None:
    assert _all_checks(base, image, settings_names, defaults) == []


def test_the_rendered_overlay_agrees_with_itself_the_image_and_the_settings(
    overlay: list[Doc], image: checks.Image, settings_names: set[str], defaults: dict[str, Any]
) -> None:
    # The overlay renames the image, so this also checks that its replacement gave the provisioner's
    # --image the same one.
    assert {c["image"] for _, c, _ in checks.containers(overlay)} == {"registry.example.com/switchyard:1.0.0"}
    assert _all_checks(overlay, image, settings_names, defaults) == []


def test_every_process_of_the_platform_has_its_workload(base: list[Doc]) -> None:
    commands = {c.get("args", ["serve"])[0] for _, c, _ in checks.containers(base)}
    assert {"serve", "worker", "beat", "run_provisioner", "migrate"} <= commands


def test_the_image_facts_are_read(image: checks.Image) -> None:
    """The parsing the checks rely on found what the Dockerfile and the entry point say."""
    assert image.exposed_ports == {8000} and image.default_port == 8000
    assert image.uid != 0
    assert image.cmd == ["serve"] and image.entrypoint == ["/app/scripts/image-entrypoint"]
    assert (REPO_ROOT / "scripts" / "image-entrypoint").stat().st_mode & 0o111
    assert {"serve", "run_replica", "worker", "beat", "run_provisioner", "migrate", "demo"} <= image.roles
    assert image.healthz_path == "/healthz"


# --- the checks catch what they are for -----------------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[list[Doc]], None]:
    """A mutation: `value` at `path` ("Kind/name:key.key.0.key") of a copy of the documents."""
    where, _, keys = path.partition(":")
    kind, name = where.split("/")

    def mutate(docs: list[Doc]) -> None:
        node: Any = checks.named(docs, kind, name)
        *parents, last = [int(k) if k.isdigit() else k for k in keys.split(".")]
        for key in parents:
            node = node[key]
        node[last] = value

    return mutate


WEB = "Deployment/switchyard-web:spec.template.spec.containers.0"
BROKEN = {
    "a Secret key settings do not read": (
        _set("Secret/switchyard-env:stringData.DATABSE_URL", "postgres://x"),
        "DATABSE_URL is not read",
    ),
    "a ConfigMap key settings do not read": (
        _set("ConfigMap/switchyard-config:data.SWITCHYARD_SERVE_STATICS", "1"),
        "is not read by",
    ),
    "envFrom a Secret that is not there": (
        _set(f"{WEB}.envFrom.0.secretRef.name", "switchyard-secrets"),
        "which is not here",
    ),
    "a readiness probe on a path with no view": (
        _set(f"{WEB}.readinessProbe.httpGet.path", "/ready"),
        "readyz",
    ),
    "liveness on readiness' path": (_set(f"{WEB}.livenessProbe.httpGet.path", "/readyz"), "healthz view"),
    "a probe Host that ALLOWED_HOSTS refuses": (
        _set(f"{WEB}.readinessProbe.httpGet.httpHeaders.0.value", "10.0.0.1"),
        "ALLOWED_HOSTS",
    ),
    "a renamed container port": (_set(f"{WEB}.ports.0.name", "web"), "is not"),
    "a port the image does not expose": (_set(f"{WEB}.ports.0.containerPort", 8080), "is not the image's"),
    "a command the entry point does not have": (_set(f"{WEB}.args.0", "runserver"), "not a command"),
    "a command that bypasses the entry point": (_set(f"{WEB}.command", ["python"]), "entry point"),
    "another image": (_set(f"{WEB}.image", "switchyard:old"), "different images"),
    "root": (
        _set("Deployment/switchyard-worker:spec.template.spec.securityContext.runAsUser", 0),
        "runAsNonRoot",
    ),
    "replicas made from another image": (
        _set("Deployment/switchyard-provisioner:spec.template.spec.containers.0.args.3", "other"),
        "--image",
    ),
    "two beats": (_set("Deployment/switchyard-beat:spec.replicas", 2), "Recreate"),
    "the artifacts mounted away from ARTIFACT_ROOT": (
        _set(f"{WEB}.volumeMounts.1.mountPath", "/artifacts"),
        "ARTIFACT_ROOT",
    ),
    "the artifacts read-only where models are registered": (
        _set(f"{WEB}.volumeMounts.1.readOnly", True),
        "writable",
    ),
    "a Service aimed at no port": (
        _set("Service/switchyard-web:spec.ports.0.targetPort", "api"),
        "targetPort",
    ),
    "a budget over no pods": (
        _set("PodDisruptionBudget/switchyard-web:spec.selector.matchLabels", {"app": "web"}),
        "selects no pods",
    ),
    "replicas open to ingress": (_set("NetworkPolicy/switchyard-replicas:spec.ingress", [{}]), "no ingress"),
    "replicas' Redis on another port": (
        _set("Secret/switchyard-env:stringData.REDIS_URL", "redis://redis:6380/0"),
        "REDIS_URL's port 6380",
    ),
    "a policy that misses the replica pods": (
        _set("NetworkPolicy/switchyard-replicas:spec.podSelector.matchLabels", {"app": "replica"}),
        "no NetworkPolicy",
    ),
    "a real-looking SECRET_KEY in the base": (
        _set("Secret/switchyard-env:stringData.SECRET_KEY", "hunter2"),
        "placeholder",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_copy_fails(
    case: str, base: list[Doc], image: checks.Image, settings_names: set[str], defaults: dict[str, Any]
) -> None:
    mutate, expected = BROKEN[case]
    docs = copy.deepcopy(base)
    mutate(docs)
    problems = _all_checks(docs, image, settings_names, defaults)
    assert any(expected in problem for problem in problems), problems


def test_a_broken_copy_fails_the_schema_check(base: list[Doc]) -> None:
    docs = copy.deepcopy(base)
    _set(f"{WEB}.readinessProbe.httpGet.paht", "/readyz")(docs)  # a field the API does not know
    _set("Deployment/switchyard-beat:spec.replicas", "one")(docs)
    problems = checks.schema_problems(docs, OLDEST_KUBERNETES)
    assert len(problems) == 2 and "paht" in problems[0] and "'one'" in problems[1], problems


def test_settings_names_are_read_from_the_settings_module(tmp_path: Path) -> None:
    settings = tmp_path / "settings.py"
    settings.write_text(
        "import os\nA = os.environ.get('A')\nB = _env_bool('B', False)\nC = os.environ['C']\n"
        "os.environ.setdefault('D', '1')\n"
    )
    assert checks.settings_names(settings) == {"A", "B", "C"}
