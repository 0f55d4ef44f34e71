"""LoRA adapters in the registry (docs/architecture.md, "Adapters on a shared base"): a PEFT directory made
by peft itself is registered against its base version with a digest, by the command and over REST; what
a replica could not serve on that base is refused before anything is stored, in one line."""

from __future__ import annotations

import json
import shutil
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from registry import adapters
from registry.models import Model, ModelVersion
from registry.services import RegistryError, model_version_register
from serving.engine.demo_model import DemoModelSpec, build_demo_model
from tests.lora_adapters import build_peft_adapter
from tests.registry.test_api_writes import everything, refused, send

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    return build_peft_adapter(demo_model_dir, tmp_path_factory.mktemp("adapter") / "lora")


@pytest.fixture(scope="module")
def other_base_adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter of a base with other shapes (hidden size 32)."""
    spec = DemoModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    base = build_demo_model(tmp_path_factory.mktemp("small-base"), spec)
    return build_peft_adapter(base, tmp_path_factory.mktemp("small-adapter") / "lora")


@pytest.fixture
def base(db: None, demo_model_dir: Path) -> ModelVersion:
    return model_version_register(
        name="demo-chat", version="v1", source_dir=demo_model_dir, created_by="test"
    )


def _run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def _stored(settings: Any) -> list[str]:
    root = Path(settings.ARTIFACT_ROOT)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _edited(source: Path, tmp_path: Path, **config: Any) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(source, copy)
    path = copy / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return copy


def test_a_peft_adapter_is_registered_against_its_base_with_a_digest(
    base: ModelVersion, adapter_dir: Path, settings: Any
) -> None:
    out = _run(
        "register_model", "acme-tune", "v1", "--from", str(adapter_dir), "--adapter-of", "demo-chat:v1"
    )

    mv = ModelVersion.objects.get(model__name="acme-tune", version="v1")
    assert mv.adapter_of == base and mv.model.kind == Model.Kind.CAUSAL_LM
    assert out.strip().splitlines()[-1] == f"sha256:{mv.sha256}"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(mv.files)
    copied = Path(mv.artifact_uri)
    assert (copied / "adapter_model.safetensors").read_bytes() == (
        adapter_dir / "adapter_model.safetensors"
    ).read_bytes()
    adapters.verify_adapter_dir(copied, sha256=mv.sha256)  # what a replica checks before reading it
    # An ordinary version: the first of its model is stable with all of the traffic.
    assert mv.aliases.get().name == "stable" and mv.routing_entries.get().weight == 100


def test_the_registry_serves_the_projections_the_engine_does() -> None:
    from serving.engine.lora import TARGET_MODULES

    assert adapters.SERVED_TARGETS == TARGET_MODULES


def test_the_registry_refuses_every_peft_field_the_engine_refuses() -> None:
    """An adapter the registry takes must load on a replica: what the engine refuses at load, the
    registry refuses at registration (bias is the engine's separate check)."""
    from serving.engine.lora import UNSUPPORTED_FIELDS

    assert set(adapters.UNSUPPORTED) == set(UNSUPPORTED_FIELDS) | {"bias"}


def _with_bin(d: Path) -> None:
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_with_bin, "pickle-based weights"),
        (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
        (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x80\x04not safetensors"), "not a valid"),
        ({"r": 8}, r"do not fit rank 8"),
        ({"r": 65}, "rank r=65: must be an integer from 1 to 64"),
        ({"target_modules": ["q_proj", "v_proj", "foo_proj"]}, "target modules foo_proj are not served"),
        ({"target_modules": ["q_proj"]}, "v_proj has LoRA weights but is not among target_modules"),
        ({"use_dora": True}, "use_dora"),
        ({"lora_bias": True}, "lora_bias=True, which replicas do not serve"),  # the engine refuses it too
        ({"lora_alpha": 0}, "lora_alpha=0"),
        ({"peft_type": "IA3"}, "only LORA"),
    ],
)
def test_what_a_replica_could_not_serve_on_the_base_is_refused_before_anything_is_stored(
    base: ModelVersion, adapter_dir: Path, tmp_path: Path, settings: Any, edit: Any, message: str
) -> None:
    if isinstance(edit, dict):
        source = _edited(adapter_dir, tmp_path, **edit)
    else:
        source = tmp_path / "edited"
        shutil.copytree(adapter_dir, source)
        edit(source)
    before = _stored(settings)
    with pytest.raises(CommandError, match=message) as excinfo:
        _run("register_model", "acme-tune", "v1", "--from", str(source), "--adapter-of", "demo-chat:v1")
    assert "\n" not in str(excinfo.value)
    assert not Model.objects.filter(name="acme-tune").exists()
    assert _stored(settings) == before


def test_an_adapter_of_a_base_with_other_shapes_is_refused(
    base: ModelVersion, other_base_adapter_dir: Path, settings: Any
) -> None:
    before = _stored(settings)
    with pytest.raises(CommandError, match=r"q_proj: lora_A \[4, 32\] and lora_B \[32, 4\] do not fit"):
        _run(
            "register_model",
            "acme-tune",
            "v1",
            "--from",
            str(other_base_adapter_dir),
            "--adapter-of",
            "demo-chat:v1",
        )
    assert _stored(settings) == before and not Model.objects.filter(name="acme-tune").exists()


def test_a_missing_base_or_one_of_the_wrong_kind_is_refused(
    base: ModelVersion, adapter_dir: Path, demo_embedding_model_dir: Path, make_tenant: Any, settings: Any
) -> None:
    with pytest.raises(CommandError, match="no base version 'nope:v1'"):
        _run("register_model", "acme-tune", "v1", "--from", str(adapter_dir), "--adapter-of", "nope:v1")
    with pytest.raises(CommandError, match="no base version 'demo-chat'"):
        _run("register_model", "acme-tune", "v1", "--from", str(adapter_dir), "--adapter-of", "demo-chat")
    model_version_register(
        name="embed", version="v1", source_dir=demo_embedding_model_dir, kind=Model.Kind.EMBEDDING
    )
    with pytest.raises(
        CommandError, match="embed:v1 is a embedding model; an adapter's base must be a causal-lm"
    ):
        _run("register_model", "acme-tune", "v1", "--from", str(adapter_dir), "--adapter-of", "embed:v1")
    model_version_register(name="tune", version="v1", source_dir=adapter_dir, adapter_of=base)
    with pytest.raises(CommandError, match="tune:v1 is itself an adapter"):
        _run("register_model", "acme-tune", "v1", "--from", str(adapter_dir), "--adapter-of", "tune:v1")
    # Another tenant's own model is no base to anyone else: answered as not found.
    globex = make_tenant("globex")
    model_version_register(
        name="globex-chat", version="v1", source_dir=Path(base.artifact_uri), owner=globex.tenant
    )
    acme = make_tenant("acme")
    with pytest.raises(CommandError, match="no base version globex-chat:v1"):
        _run(
            "register_model", "acme-tune", "v1", "--from", str(adapter_dir),
            "--adapter-of", "globex-chat:v1", "--owner", "acme",
        )  # fmt: skip
    assert acme.tenant.owned_models.count() == 0
    assert not Model.objects.filter(name="acme-tune").exists()


def test_an_adapter_model_takes_only_adapter_versions_and_a_model_none(
    base: ModelVersion, adapter_dir: Path, demo_model_dir: Path
) -> None:
    model_version_register(name="tune", version="v1", source_dir=adapter_dir, adapter_of=base)
    with pytest.raises(RegistryError, match="tune's versions are LoRA adapters"):
        model_version_register(name="tune", version="v2", source_dir=demo_model_dir)
    with pytest.raises(RegistryError, match="demo-chat's versions are full models"):
        model_version_register(name="demo-chat", version="v2", source_dir=adapter_dir, adapter_of=base)
    second = model_version_register(name="tune", version="v2", source_dir=adapter_dir, adapter_of=base)
    assert second.adapter_of == base and second.routing_entries.get().weight == 0


def test_a_tenant_registers_its_adapter_over_rest_and_another_tenant_cannot_use_its_base(
    client: Client,
    base: ModelVersion,
    adapter_dir: Path,
    demo_model_dir: Path,
    make_tenant: Any,
    settings: Any,
    tmp_path: Path,
) -> None:
    root = tmp_path / "imports"
    shutil.copytree(adapter_dir, root / "lora")
    shutil.copytree(demo_model_dir, root / "chat")
    settings.ARTIFACT_IMPORT_ROOT = root
    acme, globex = make_tenant("acme"), make_tenant("globex")
    body = {"version": "v1", "artifact_dir": "lora", "adapter_of": "demo-chat:v1"}
    response = send(client, "post", "/v1/models/acme-tune/versions", body, **acme.auth)
    assert response.status_code == 201, response.content
    assert (response.json()["owner"], response.json()["adapter_of"]) == ("acme", "demo-chat:v1")
    # acme's own full model, then globex trying to build on it: as if it did not exist.
    send(
        client,
        "post",
        "/v1/models/acme-chat/versions",
        {"version": "v1", "artifact_dir": "chat"},
        **acme.auth,
    )
    before = everything(settings)
    hidden = {"version": "v1", "artifact_dir": "lora", "adapter_of": "acme-chat:v1"}
    message = refused(send(client, "post", "/v1/models/globex-tune/versions", hidden, **globex.auth), 400)
    assert message == "no base version 'acme-chat:v1' (give it as BASE:VERSION)"
    assert everything(settings) == before


def test_run_replica_refuses_an_adapter_version(base: ModelVersion, adapter_dir: Path, settings: Any) -> None:
    model_version_register(name="tune", version="v1", source_dir=adapter_dir, adapter_of=base)
    settings.REDIS_URL = "redis://127.0.0.1:6379/0"  # checked first; nothing connects before the refusal
    with pytest.raises(CommandError, match="tune:v1 is a LoRA adapter: its base version's replicas serve it"):
        call_command("run_replica", "--model", "tune", "--version", "v1")
