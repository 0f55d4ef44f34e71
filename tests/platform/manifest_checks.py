"""What the Kubernetes manifests (platform/kubernetes/) must agree on, as functions that list problems.

Each check reads the manifests as loaded YAML documents and the facts they must agree with (the names
config/settings.py reads, the image's Dockerfile and entry point, the provisioner's labels and defaults)
and returns one sentence per disagreement: the tests assert none for the real manifests, and some for
copies broken on purpose, so that each check is seen to catch what it is for."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tests.conftest import REPO_ROOT

Doc = dict[str, Any]
KUBERNETES = REPO_ROOT / "platform" / "kubernetes"
BASE = KUBERNETES / "base"
OVERLAY = KUBERNETES / "overlays" / "example"
WORKLOAD_KINDS = {"Deployment", "Job"}
# Settings a replica must see, which the provisioner passes to replica pods only through the Secret.
REQUIRED_SECRET_KEYS = {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"}


# --- loading ---------------------------------------------------------------------------------------


def load_yaml(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def base_documents() -> list[Doc]:
    """The base's resources as its kustomization lists them (its only transformer adds a label)."""
    kustomization = load_yaml(BASE / "kustomization.yaml")[0]
    return [doc for name in kustomization["resources"] for doc in load_yaml(BASE / name)]


def listed_files(directory: Path) -> set[Path]:
    """Every file a kustomization in `directory` names, as a resource or a patch."""
    kustomization = load_yaml(directory / "kustomization.yaml")[0]
    names = [r for r in kustomization.get("resources", []) if (directory / r).is_file()]
    names += [p["path"] for p in kustomization.get("patches", []) if "path" in p]
    return {(directory / name).resolve() for name in names}


def render(directory: Path) -> list[Doc]:
    """`kubectl kustomize directory`: what `kubectl apply -k` would send."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise FileNotFoundError("kubectl")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=True
    )
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


# --- the facts the manifests must agree with --------------------------------------------------------


def settings_names(path: Path = REPO_ROOT / "config" / "settings.py") -> set[str]:
    """The environment variables config/settings.py reads: os.environ.get/[]/getenv and _env_bool."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            if func in {"os.environ.get", "os.getenv", "_env_bool"}:
                names.add(str(node.args[0].value))
        elif (
            isinstance(node, ast.Subscript)
            and ast.unparse(node.value) == "os.environ"
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.ctx, ast.Load)
        ):
            names.add(str(node.slice.value))
    return names


@dataclass(frozen=True)
class Image:
    """What the Dockerfile and its entry point say."""

    exposed_ports: set[int]
    uid: int
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: str
    roles: set[str]  # the entry point's first-argument choices
    default_port: int  # the entry point's PORT
    placeholder: str  # the value it refuses to start with
    healthz_path: str


def read_image(
    dockerfile: Path = REPO_ROOT / "Dockerfile",
    entrypoint_script: Path = REPO_ROOT / "scripts" / "image-entrypoint",
) -> Image:
    instructions: dict[str, list[str]] = {}
    # Continuation lines joined, comments dropped: one instruction per entry.
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")),
    )
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            instructions.setdefault(keyword.upper(), []).append(rest.strip())
    script = entrypoint_script.read_text()
    roles = {
        role.strip()
        for label in re.findall(r"^ {4}([a-z_][a-z_ |]*)\)\s*$", script, re.MULTILINE)
        for role in label.split("|")
    }
    healthz = re.search(r"http://127\.0\.0\.1:\$PORT(/\w+)", script)
    return Image(
        exposed_ports={int(p) for rest in instructions.get("EXPOSE", []) for p in rest.split()},
        uid=int(instructions["USER"][-1].split(":")[0]),
        entrypoint=json.loads(instructions["ENTRYPOINT"][-1]),
        cmd=json.loads(instructions["CMD"][-1]),
        healthcheck=instructions["HEALTHCHECK"][-1],
        roles=roles,
        default_port=int(_line_value(r'^PORT="\$\{PORT:-(\d+)\}"', script)),
        placeholder=_line_value(r'^PLACEHOLDER="([^"]+)"', script),
        healthz_path=healthz.group(1) if healthz else "",
    )


def _line_value(pattern: str, text: str) -> str:
    found = re.search(pattern, text, re.MULTILINE)
    if found is None:
        raise ValueError(f"scripts/image-entrypoint has no line matching {pattern}")
    return found.group(1)


def provisioner_defaults() -> dict[str, Any]:
    """run_provisioner's option defaults (--env-secret, --artifact-claim, ...)."""
    from rollouts.management.commands.run_provisioner import Command

    defaults: dict[str, Any] = vars(Command().create_parser("manage.py", "run_provisioner").parse_args([]))
    return defaults


def replica_pod_labels() -> dict[str, str]:
    """The labels the provisioner gives every replica pod it makes."""
    from rollouts.fleet.kubernetes import PodTemplate, deployment_manifest

    template = PodTemplate(image="x", artifact_claim="c", artifact_root="/a")
    return dict(deployment_manifest("m", "v1", 1, template)["spec"]["template"]["metadata"]["labels"])


# --- walking the documents --------------------------------------------------------------------------


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: list[Doc], kind: str, name: str) -> Doc | None:
    return next((d for d in of_kind(docs, kind) if d["metadata"]["name"] == name), None)


def pod_templates(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for doc in docs:
        if doc["kind"] in WORKLOAD_KINDS:
            yield f"{doc['kind']} {doc['metadata']['name']}", doc["spec"]["template"]


def containers(docs: list[Doc]) -> Iterator[tuple[str, Doc, Doc]]:
    """(where, container, pod spec) for every container and init container of every workload."""
    for where, template in pod_templates(docs):
        spec = template["spec"]
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            yield f"{where}/{container['name']}", container, spec


def _data(doc: Doc) -> dict[str, str]:
    return {**doc.get("data", {}), **doc.get("stringData", {})}


def config_value(docs: list[Doc], key: str) -> str | None:
    for doc in [*of_kind(docs, "ConfigMap"), *of_kind(docs, "Secret")]:
        if key in _data(doc):
            return str(_data(doc)[key])
    return None


def _option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args[:-1] else None


# --- the checks -------------------------------------------------------------------------------------


def schema_problems(docs: list[Doc], kubernetes_version: str) -> list[str]:
    """Each document against the Kubernetes OpenAPI schema (strict: no field the API does not know)."""
    import kubernetes_validate

    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            problems.append(f"{doc['kind']} {doc['metadata'].get('name')}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(exc.message)
    return problems


def env_problems(docs: list[Doc], settings: set[str]) -> list[str]:
    """The Secret's and ConfigMap's keys are settings; every reference names one that exists."""
    problems = []
    stores = {("Secret", d["metadata"]["name"]): set(_data(d)) for d in of_kind(docs, "Secret")}
    stores |= {("ConfigMap", d["metadata"]["name"]): set(_data(d)) for d in of_kind(docs, "ConfigMap")}
    for (kind, name), keys in stores.items():
        problems += [f"{kind} {name}: {key} is not read by config/settings.py" for key in keys - settings]
    for where, container, _ in containers(docs):
        for source in container.get("envFrom", []):
            for ref, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
                if ref in source and (kind, source[ref]["name"]) not in stores:
                    problems.append(f"{where}: envFrom names {kind} {source[ref]['name']}, which is not here")
        for variable in container.get("env", []):
            if variable["name"] not in settings:
                problems.append(f"{where}: env {variable['name']} is not read by config/settings.py")
            for ref, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                selector = variable.get("valueFrom", {}).get(ref)
                if selector and selector["key"] not in stores.get((kind, selector["name"]), set()):
                    problems.append(
                        f"{where}: {variable['name']} from {kind} {selector['name']}: no such key"
                    )
    return problems


def secret_problems(docs: list[Doc], image: Image, defaults: dict[str, Any]) -> list[str]:
    """The Secret the provisioner hands replica pods exists and holds what a replica needs; in the base,
    its credentials are the placeholder the image's entry point refuses to start with."""
    secret_name = defaults["env_secret"]
    for _, container, _ in containers(docs):
        if container.get("args", [""])[0] == "run_provisioner":
            secret_name = _option(container["args"], "--env-secret") or secret_name
    secret = named(docs, "Secret", secret_name)
    if secret is None:
        return [f"no Secret {secret_name}, the environment the provisioner gives replica pods"]
    missing = REQUIRED_SECRET_KEYS - set(_data(secret))
    problems = [f"Secret {secret_name}: no {key} (replicas need it)" for key in sorted(missing)]
    if image.placeholder not in str(_data(secret).get("SECRET_KEY", "")):
        problems.append(f"Secret {secret_name}: SECRET_KEY is not the placeholder {image.placeholder!r}")
    return problems


def container_problems(docs: list[Doc], image: Image, defaults: dict[str, Any]) -> list[str]:
    """One image everywhere, run through its entry point with one of its commands, as its user, on the
    port it exposes; the provisioner's replicas run that image and mount the claim where the web pods do."""
    problems = []
    images = {container["image"] for _, container, _ in containers(docs)}
    if len(images) != 1:
        problems.append(f"the workloads run different images: {sorted(images)}")
    for where, container, spec in containers(docs):
        if "command" in container:
            problems.append(f"{where}: a command replaces the image's entry point (use args)")
        args = container.get("args", image.cmd)
        if args[0] not in image.roles:
            problems.append(f"{where}: {args[0]!r} is not a command of scripts/image-entrypoint")
        context = spec.get("securityContext", {})
        if context.get("runAsUser") != image.uid or context.get("runAsNonRoot") is not True:
            problems.append(f"{where}: not runAsNonRoot as the image's user {image.uid}")
        for port in container.get("ports", []):
            if port.get("name") == "http" and port["containerPort"] not in image.exposed_ports:
                problems.append(
                    f"{where}: port {port['containerPort']} is not the image's {image.exposed_ports}"
                )
        if args[0] == "run_provisioner":
            if _option(args, "--image") != container["image"]:
                problems.append(
                    f"{where}: --image {_option(args, '--image')} is not its own {container['image']}"
                )
            claim = _option(args, "--artifact-claim") or defaults["artifact_claim"]
            pvc = named(docs, "PersistentVolumeClaim", claim)
            if pvc is None or "ReadWriteMany" not in pvc["spec"].get("accessModes", []):
                problems.append(f"{where}: no ReadWriteMany claim {claim} (--artifact-claim)")
    if image.default_port not in image.exposed_ports:
        problems.append(f"the entry point's PORT {image.default_port} is not EXPOSEd")
    artifact_root = config_value(docs, "ARTIFACT_ROOT")
    claim = defaults["artifact_claim"]
    mounted = False
    for where, template in pod_templates(docs):
        spec = template["spec"]
        volumes = {
            v["name"]
            for v in spec.get("volumes", [])
            if v.get("persistentVolumeClaim", {}).get("claimName") == claim
        }
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] in volumes and mount["mountPath"] != artifact_root:
                    problems.append(
                        f"{where}: {claim} at {mount['mountPath']}, not ARTIFACT_ROOT {artifact_root}"
                    )
                mounted |= mount["name"] in volumes and not mount.get("readOnly", False)
    if not mounted:  # where models are registered, their files are written
        problems.append(f"no pod mounts {claim} writable at ARTIFACT_ROOT")
    for name in ("switchyard-beat", "switchyard-provisioner"):  # exactly one, even during an upgrade
        deployment = named(docs, "Deployment", name)
        if deployment is None:
            problems.append(f"no Deployment {name}")
        elif (
            deployment["spec"].get("replicas") != 1
            or deployment["spec"].get("strategy", {}).get("type") != "Recreate"
        ):
            problems.append(f"Deployment {name}: not replicas 1 with strategy Recreate")
    return problems


def probe_problems(docs: list[Doc], resolve_name: Callable[[str], str | None], image: Image) -> list[str]:
    """Probes reach a port the container opens, at the paths the URLconf gives /healthz and /readyz,
    with a Host header Django allows; the image's HEALTHCHECK checks the same /healthz."""
    problems = []
    allowed = (config_value(docs, "ALLOWED_HOSTS") or "").split(",")
    wanted = {"livenessProbe": "healthz", "startupProbe": "healthz", "readinessProbe": "readyz"}
    for where, container, _ in containers(docs):
        ports = {p.get("name") for p in container.get("ports", [])} | {
            p["containerPort"] for p in container.get("ports", [])
        }
        for kind, url_name in wanted.items():
            probe = container.get(kind, {}).get("httpGet")
            if probe is None:
                continue
            if probe["port"] not in ports:
                problems.append(f"{where}: {kind} port {probe['port']} is not one of its ports")
            if resolve_name(probe["path"]) != url_name:
                problems.append(f"{where}: {kind} {probe['path']} is not the {url_name} view")
            hosts = [h["value"] for h in probe.get("httpHeaders", []) if h["name"].lower() == "host"]
            if not hosts or hosts[0] not in allowed:
                problems.append(f"{where}: {kind} sends Host {hosts}, which ALLOWED_HOSTS {allowed} refuses")
        if container.get("args", image.cmd)[0] == "serve" and "readinessProbe" not in container:
            problems.append(f"{where}: the web process has no readiness probe")
    if resolve_name(image.healthz_path) != "healthz" or "healthcheck" not in image.healthcheck:
        problems.append(f"the image's HEALTHCHECK does not check /healthz ({image.healthcheck})")
    return problems


def service_problems(docs: list[Doc]) -> list[str]:
    """Services and PodDisruptionBudgets select pods that exist; a Service's target is a port they open."""
    problems = []
    templates = [(where, t["metadata"].get("labels", {}), t) for where, t in pod_templates(docs)]
    for doc in of_kind(docs, "Deployment"):
        own = doc["spec"]["selector"]["matchLabels"]
        if not own.items() <= doc["spec"]["template"]["metadata"]["labels"].items():
            problems.append(f"Deployment {doc['metadata']['name']}: its selector misses its own pods")
    for kind in ("Service", "PodDisruptionBudget"):
        for doc in of_kind(docs, kind):
            # A Service selects by labels; a PodDisruptionBudget by a label selector.
            selector: dict[str, str] = doc["spec"]["selector"]
            if kind != "Service":
                selector = doc["spec"]["selector"]["matchLabels"]
            matched = [t for _, labels, t in templates if selector.items() <= labels.items()]
            if not matched:
                problems.append(f"{kind} {doc['metadata']['name']}: selects no pods")
            if kind != "Service":
                continue
            opened = {
                v
                for t in matched
                for c in t["spec"]["containers"]
                for p in c.get("ports", [])
                for v in (p.get("name"), p["containerPort"])
            }
            for port in doc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                if target not in opened:
                    problems.append(f"Service {doc['metadata']['name']}: targetPort {target} is not opened")
    return problems


def network_policy_problems(docs: list[Doc], replica_labels: dict[str, str]) -> list[str]:
    """Replica pods take no ingress and reach out only to Redis, Postgres (the Secret's ports) and DNS."""
    policies = [
        p for p in of_kind(docs, "NetworkPolicy")
        if p["spec"]["podSelector"].get("matchLabels", {}).items() <= replica_labels.items()
    ]  # fmt: skip
    if not policies:
        return [f"no NetworkPolicy selects the replica pods ({replica_labels})"]
    problems = []
    for policy in policies:
        name, spec = policy["metadata"]["name"], policy["spec"]
        if not {"Ingress", "Egress"} <= set(spec.get("policyTypes", [])):
            problems.append(f"NetworkPolicy {name}: policyTypes must hold Ingress and Egress")
        if spec.get("ingress"):
            problems.append(f"NetworkPolicy {name}: replicas must accept no ingress")
        allowed = {
            (p.get("protocol", "TCP"), p.get("port"))
            for rule in spec.get("egress", [])
            for p in rule.get("ports", [])
        }
        if any(not rule.get("ports") for rule in spec.get("egress", [])):
            problems.append(f"NetworkPolicy {name}: an egress rule open on every port")
        expected = {("UDP", 53), ("TCP", 53)}  # DNS: the service names in the URLs
        for key, default_port in (("REDIS_URL", 6379), ("DATABASE_URL", 5432)):
            url = config_value(docs, key)
            port = (urlsplit(url).port if url else None) or default_port
            expected.add(("TCP", port))
            if ("TCP", port) not in allowed:
                problems.append(f"NetworkPolicy {name}: no egress to {key}'s port {port}")
        if allowed - expected:
            problems.append(
                f"NetworkPolicy {name}: egress beyond Redis, Postgres and DNS: {sorted(allowed - expected)}"
            )
    return problems
