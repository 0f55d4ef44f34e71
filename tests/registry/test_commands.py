import shutil
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from registry.models import ApiKey, ModelVersion, Tenant
from registry.selectors import tenant_context_for_api_key

pytestmark = pytest.mark.django_db


def _run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_register_model_copies_the_directory_and_prints_the_digest(demo_model_dir: Path, settings) -> None:
    out = _run("register_model", "chat", "v1", "--from", str(demo_model_dir))

    mv = ModelVersion.objects.get(model__name="chat", version="v1")
    assert out.strip().splitlines()[-1] == f"sha256:{mv.sha256}"
    copied = Path(settings.ARTIFACT_ROOT) / "chat" / "v1"
    assert (copied / "model.safetensors").read_bytes() == (demo_model_dir / "model.safetensors").read_bytes()
    assert set(mv.files) >= {"model.safetensors", "config.json", "tokenizer.json"}


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: (d / "model.safetensors").unlink(), r"no \*\.safetensors"),
        (lambda d: (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle"), "pickle-based weights"),
        (lambda d: (d / "modeling_evil.py").write_text("import os"), "custom code"),
    ],
)
def test_register_model_refuses_unsafe_or_incomplete_directories(
    demo_model_dir: Path, tmp_path: Path, settings, setup, message: str
) -> None:
    source = tmp_path / "src"
    shutil.copytree(demo_model_dir, source)
    setup(source)
    with pytest.raises(CommandError, match=message) as excinfo:
        _run("register_model", "chat", "v1", "--from", str(source))
    assert "\n" not in str(excinfo.value)
    assert not ModelVersion.objects.exists()
    root = Path(settings.ARTIFACT_ROOT)
    assert not root.exists() or not any(root.iterdir())


def test_register_model_refuses_an_existing_name_and_version(demo_model_dir: Path, settings) -> None:
    _run("register_model", "chat", "v1", "--from", str(demo_model_dir))
    before = sorted(p.name for p in (Path(settings.ARTIFACT_ROOT)).rglob("*"))
    with pytest.raises(CommandError, match="chat:v1 is already registered"):
        _run("register_model", "chat", "v1", "--from", str(demo_model_dir))
    assert sorted(p.name for p in (Path(settings.ARTIFACT_ROOT)).rglob("*")) == before
    assert ModelVersion.objects.count() == 1


def test_register_model_names_a_new_models_owner_and_a_versions_parent(
    demo_model_dir: Path, settings
) -> None:
    _run("create_tenant", "acme", "--may-deploy")
    _run("create_tenant", "globex", "--may-deploy")
    source = str(demo_model_dir)
    _run("register_model", "acme-chat", "v1", "--from", source, "--owner", "acme")
    _run("register_model", "acme-chat", "v2", "--from", source, "--parent", "v1")
    v1, v2 = ModelVersion.objects.filter(model__name="acme-chat").order_by("version")
    assert v1.model.owner.name == "acme" and v2.parent == v1
    # Another tenant's name on an existing model, an unknown tenant or parent: refused, nothing stored.
    for args, message in (
        (("--owner", "globex"), "not owned by tenant 'globex'"),
        (("--owner", "nobody"), "no tenant 'nobody'"),
        (("--parent", "v9"), "no version acme-chat:v9"),
    ):
        with pytest.raises(CommandError, match=message):
            _run("register_model", "acme-chat", "v3", "--from", source, *args)
    assert ModelVersion.objects.filter(model__name="acme-chat").count() == 2
    assert not (Path(settings.ARTIFACT_ROOT) / "acme-chat" / "v3").exists()


def test_create_tenant_and_api_key_print_a_working_key_on_the_last_line() -> None:
    _run("create_tenant", "acme", "--requests-per-second", "5", "--may-pin")
    out = _run("create_api_key", "--tenant", "acme")

    key = out.strip().splitlines()[-1]
    context = tenant_context_for_api_key(key)
    assert context is not None and context.tenant_name == "acme" and context.may_pin
    assert context.requests_per_second == 5
    assert ApiKey.objects.get().key_hash != key


def test_create_api_key_for_an_unknown_tenant_fails_cleanly() -> None:
    with pytest.raises(CommandError, match="unknown tenant"):
        _run("create_api_key", "--tenant", "nobody")


def test_seed_demo_is_idempotent_and_keeps_one_live_demo_key(settings, tmp_path: Path) -> None:
    settings.STATE_DIR = tmp_path
    first = _run("seed_demo").strip().splitlines()[-1]
    second = _run("seed_demo").strip().splitlines()[-1]

    assert tenant_context_for_api_key(first) is None  # the previous demo key is revoked
    context = tenant_context_for_api_key(second)
    assert context is not None and context.may_pin and context.may_deploy and not context.allowed_model_names
    assert ModelVersion.objects.filter(model__name="demo-chat", version="v1").count() == 1
    assert Tenant.objects.filter(name="demo").count() == 1
    # The README's first rollout works with the demo key: demo-chat is the platform's, granted it.
    assert context.may_deploy_to("demo-chat", owner_id=None)


def test_seed_demo_grants_demo_chat_to_a_demo_tenant_made_before_it_was(settings, tmp_path: Path) -> None:
    settings.STATE_DIR = tmp_path
    _run("seed_demo", "--no-key")
    Tenant.objects.get(name="demo").quota.deployable_models.clear()  # as an older seed_demo left it
    key = _run("seed_demo").strip().splitlines()[-1]
    context = tenant_context_for_api_key(key)
    assert context is not None and context.may_deploy_to("demo-chat", owner_id=None)


def test_seed_demo_rebuilds_a_demo_model_whose_build_was_cut_short(settings, tmp_path: Path) -> None:
    """Weights written, then Ctrl-C before the tokenizer: it was taken for built and registered."""
    settings.STATE_DIR = tmp_path
    settings.ARTIFACT_ROOT = tmp_path / "artifacts"
    (tmp_path / "demo-model").mkdir()
    (tmp_path / "demo-model" / "model.safetensors").write_bytes(b"cut short")
    _run("seed_demo", "--no-key")
    files = ModelVersion.objects.get(model__name="demo-chat", version="v1").files
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(files)
    assert not list(tmp_path.glob(".*.building"))


def test_create_demo_model_writes_safetensors_and_a_tokenizer(tmp_path: Path) -> None:
    out_dir = tmp_path / "m"
    _run("create_demo_model", str(out_dir))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in out_dir.iterdir()}
    assert not list(out_dir.glob("*.bin"))
    with pytest.raises(CommandError, match="not empty"):
        _run("create_demo_model", str(out_dir))


def test_revoke_api_key_by_prefix_or_whole_key_and_the_gateway_refuses_it(make_tenant) -> None:
    from registry.services import api_key_create
    from serving.gateway import auth as gateway
    from serving.gateway.errors import GatewayError

    acme = make_tenant("acme")
    tenant = Tenant.objects.get(name="acme")
    _, second = api_key_create(tenant=tenant)
    assert tenant_context_for_api_key(acme.key) is not None
    with pytest.raises(
        CommandError, match="shorter than a whole key: give the whole key or exactly its first 8"
    ):
        _run("revoke_api_key", acme.key[:12])  # was taken for a whole key: "no live key matches"
    assert f"revoked {acme.key[:8]}… of tenant acme" in _run("revoke_api_key", acme.key[:8])
    assert tenant_context_for_api_key(acme.key) is None
    assert tenant_context_for_api_key(second) is not None  # another key of the tenant stays
    gateway.clear_auth_cache()
    with pytest.raises(GatewayError) as refused:
        gateway.authenticate(f"Bearer {acme.key}")
    assert refused.value.status == 401
    _run("revoke_api_key", second)  # the whole key
    assert tenant_context_for_api_key(second) is None
    with pytest.raises(CommandError, match="no live key matches"):
        _run("revoke_api_key", second)
    with pytest.raises(CommandError, match="first 8 characters"):
        _run("revoke_api_key", "sy-")


def test_a_prefix_two_tenants_share_is_refused_unless_the_tenant_is_named(make_tenant) -> None:
    acme, _ = make_tenant("acme"), make_tenant("other")
    ApiKey.objects.filter(tenant__name="other").update(prefix=acme.key[:8])  # 30 random bits can collide

    def live(tenant: str) -> bool:
        return ApiKey.objects.filter(tenant__name=tenant, revoked_at__isnull=True).exists()

    with pytest.raises(CommandError, match=r"2 live keys start with \S+ \(tenants: acme, other\)"):
        _run("revoke_api_key", acme.key[:8])
    assert live("acme") and live("other")
    _run("revoke_api_key", acme.key[:8], "--tenant", "other")
    assert live("acme") and not live("other")  # acme's key, with the same prefix, stays
