from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from registry import artifacts
from registry.models import AliasEvent, ApiKey, ModelVersion, RoutingTable
from registry.selectors import routing_snapshot, tenant_context_for_api_key
from registry.services import (
    AlreadyExists,
    RegistryError,
    alias_set,
    api_key_create,
    model_version_register,
    routing_mirror_set,
    routing_table_set,
    tenant_create,
)

pytestmark = pytest.mark.django_db


def test_first_version_is_stable_with_all_traffic_and_later_ones_start_at_zero(demo_model_dir: Path) -> None:
    v1 = model_version_register(name="chat", version="v1", source_dir=demo_model_dir)
    v2 = model_version_register(name="chat", version="v2", source_dir=demo_model_dir, parent=v1)

    snapshot = routing_snapshot(model_name="chat")
    assert snapshot is not None
    assert snapshot.weights == {"v1": 100}
    assert snapshot.aliases == {"stable": "v1"}
    assert snapshot.versions == {"v1", "v2"}
    assert v2.parent == v1
    assert Path(v2.artifact_uri).is_dir()


def test_model_version_refuses_changes_to_its_artifact(registered_model: ModelVersion) -> None:
    registered_model.sha256 = "0" * 64
    with pytest.raises(ValidationError, match=r"immutable.*sha256"):
        registered_model.save()
    registered_model.refresh_from_db()
    registered_model.artifact_uri = "/elsewhere"
    with pytest.raises(ValidationError, match="artifact_uri"):
        registered_model.save()
    registered_model.refresh_from_db()
    registered_model.created_by = "someone else"  # who registered it is part of the record too
    with pytest.raises(ValidationError, match="created_by"):
        registered_model.save()


def test_alias_moves_are_logged_with_who_from_and_to(demo_model_dir: Path) -> None:
    v1 = model_version_register(name="chat", version="v1", source_dir=demo_model_dir, created_by="alice")
    v2 = model_version_register(name="chat", version="v2", source_dir=demo_model_dir)
    revision_before = RoutingTable.objects.get(model=v1.model).revision

    alias_set(model=v1.model, name="stable", version=v2, actor="bob", reason="promote")
    alias_set(model=v1.model, name="stable", version=v2, actor="bob")  # no move, no event

    events = list(
        AliasEvent.objects.filter(alias__name="stable").values_list(
            "from_version__version", "to_version__version", "actor", "reason"
        )
    )
    assert events == [(None, "v1", "alice", "first version registered"), ("v1", "v2", "bob", "promote")]
    assert RoutingTable.objects.get(model=v1.model).revision == revision_before + 1


def test_alias_refuses_a_version_of_another_model(demo_model_dir: Path) -> None:
    a = model_version_register(name="a", version="v1", source_dir=demo_model_dir)
    b = model_version_register(name="b", version="v1", source_dir=demo_model_dir)
    with pytest.raises(RegistryError, match="belongs to b"):
        alias_set(model=a.model, name="stable", version=b, actor="x")


def test_routing_change_bumps_the_revision_and_must_sum_to_100(demo_model_dir: Path) -> None:
    v1 = model_version_register(name="chat", version="v1", source_dir=demo_model_dir)
    model_version_register(name="chat", version="v2", source_dir=demo_model_dir)
    before = RoutingTable.objects.get(model=v1.model).revision

    table = routing_table_set(model=v1.model, weights={"v1": 90, "v2": 10})
    assert table.revision == before + 1
    assert routing_snapshot(model_name="chat").weights == {"v1": 90, "v2": 10}  # type: ignore[union-attr]

    for bad in ({"v1": 90, "v2": 20}, {"v1": 100, "v9": 0}, {"v1": 50.5, "v2": 49.5}, {"v1": 101, "v2": -1}):
        with pytest.raises(RegistryError):
            routing_table_set(model=v1.model, weights=bad)  # type: ignore[arg-type]
    assert RoutingTable.objects.get(model=v1.model).revision == before + 1
    routing_table_set(model=v1.model, weights={"v2": 100})
    assert routing_snapshot(model_name="chat").weights == {"v2": 100}  # type: ignore[union-attr]


def test_mirroring_is_part_of_the_routing_table_and_refuses_bad_input(demo_model_dir: Path) -> None:
    v1 = model_version_register(name="chat", version="v1", source_dir=demo_model_dir)
    v2 = model_version_register(name="chat", version="v2", source_dir=demo_model_dir)
    other = model_version_register(name="other", version="v1", source_dir=demo_model_dir)
    before = RoutingTable.objects.get(model=v1.model).revision

    routing_mirror_set(model=v1.model, version=v2, pct=20)
    snapshot = routing_snapshot(model_name="chat")
    assert snapshot is not None and snapshot.mirror == ("v2", 20)
    assert snapshot.revision == before + 1
    assert snapshot.weights == {"v1": 100}  # mirroring moves no traffic

    for version, pct in ((other, 20), (v2, 0), (v2, 101), (v2, True)):
        with pytest.raises(RegistryError):
            routing_mirror_set(model=v1.model, version=version, pct=pct)  # type: ignore[arg-type]
    assert routing_snapshot(model_name="chat").mirror == ("v2", 20)  # type: ignore[union-attr]
    routing_mirror_set(model=v1.model, version=None)
    assert routing_snapshot(model_name="chat").mirror is None  # type: ignore[union-attr]


def test_a_mirror_version_gets_a_replica_without_traffic_or_alias(demo_model_dir: Path) -> None:
    from registry.selectors import versions_with_traffic

    v1 = model_version_register(name="chat", version="v1", source_dir=demo_model_dir)
    v2 = model_version_register(name="chat", version="v2", source_dir=demo_model_dir)
    assert {r.version for r in versions_with_traffic()} == {"v1"}
    routing_mirror_set(model=v1.model, version=v2, pct=10)
    assert {r.version for r in versions_with_traffic()} == {"v1", "v2"}


def test_api_keys_are_stored_only_as_hash_and_prefix() -> None:
    tenant = tenant_create(name="acme")
    api_key, raw_key = api_key_create(tenant=tenant)

    stored = ApiKey.objects.get(pk=api_key.pk)
    assert raw_key not in {stored.key_hash, stored.prefix, stored.name}
    assert stored.prefix == raw_key[:8] and len(stored.key_hash) == 64
    assert tenant_context_for_api_key(raw_key).tenant_name == "acme"  # type: ignore[union-attr]
    assert tenant_context_for_api_key(raw_key[:-1] + ("A" if raw_key[-1] != "A" else "B")) is None
    assert tenant_context_for_api_key(raw_key[:8]) is None


def test_a_revoked_key_or_inactive_tenant_no_longer_authenticates() -> None:
    from django.utils import timezone

    tenant = tenant_create(name="acme")
    api_key, raw_key = api_key_create(tenant=tenant)
    ApiKey.objects.filter(pk=api_key.pk).update(revoked_at=timezone.now())
    assert tenant_context_for_api_key(raw_key) is None
    _, raw_key2 = api_key_create(tenant=tenant)
    tenant.is_active = False
    tenant.save()
    assert tenant_context_for_api_key(raw_key2) is None


def test_tenant_names_are_unique() -> None:
    tenant_create(name="acme")
    with pytest.raises(AlreadyExists):
        tenant_create(name="acme")


def test_a_name_ending_in_a_newline_is_refused() -> None:
    """A regex's $ matches before a final newline: "acme\\n" was a valid name, and a model so named was
    registered (a directory of that name in the artifact store) that the gateway could never serve."""
    with pytest.raises(RegistryError, match="invalid tenant name"):
        tenant_create(name="acme\n")


def test_loading_refuses_an_artifact_whose_files_changed(registered_model: ModelVersion) -> None:
    path = Path(registered_model.artifact_uri)
    artifacts.verify(path, expected_files=registered_model.files, expected_sha256=registered_model.sha256)
    with (path / "config.json").open("a") as f:
        f.write(" ")
    with pytest.raises(artifacts.ArtifactDigestMismatch, match=r"config\.json.*refusing to load"):
        artifacts.verify(path, expected_files=registered_model.files, expected_sha256=registered_model.sha256)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("model.safetensors.index.json", {"weight_map": {"lm_head.weight": "../other/v1/model.safetensors"}}),
        ("model.safetensors.index.json", {"weight_map": {"lm_head.weight": "/srv/models/x.safetensors"}}),
        ("modules.json", [{"idx": 0, "name": "1", "path": "../../pooling", "type": "x"}]),
        ("model.safetensors.index.json", {"weight_map": {"lm_head.weight": ".model-2.safetensors"}}),
        ("modules.json", [{"idx": 0, "name": "1", "path": "./.pooling", "type": "x"}]),
    ],
)
def test_a_file_naming_another_outside_the_artifact_is_refused(
    demo_model_dir: Path, tmp_path: Path, name: str, content: object
) -> None:
    """transformers joins a sharded checkpoint's weight_map onto the directory (and the encoder a
    modules.json's paths): a name outside it would load weights no digest covers."""
    import json
    import shutil

    source = tmp_path / "model"
    shutil.copytree(demo_model_dir, source)
    (source / name).write_text(json.dumps(content))
    with pytest.raises(artifacts.ArtifactError, match=r"outside the artifact|hidden file no digest covers"):
        model_version_register(name="chat", version="v1", source_dir=source)
    assert not ModelVersion.objects.exists()


def test_loading_refuses_an_artifact_that_holds_a_symbolic_link(registered_model: ModelVersion) -> None:
    """A link put in after registration is followed by the loader to whatever it names at load time."""
    path = Path(registered_model.artifact_uri)
    (path / "sneaky.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(artifacts.ArtifactError, match="symbolic links"):
        artifacts.verify(path, expected_files=registered_model.files, expected_sha256=registered_model.sha256)


def test_a_named_prefix_cache_group_never_joins_a_tenants_own() -> None:
    """Tenants in one group share prefix-cache blocks, and so can time each other's prompts: a group
    typed as another tenant's default name must not make one."""
    from registry.selectors import tenant_context

    alone = tenant_create(name="alone")
    mimic = tenant_create(name="mimic")
    mimic.prefix_cache_group = f"tenant:{alone.pk}"
    mimic.save()
    assert tenant_context(tenant=alone).cache_group != tenant_context(tenant=mimic).cache_group
    partner = tenant_create(name="partner")
    partner.prefix_cache_group = f"tenant:{alone.pk}"
    partner.save()
    assert tenant_context(tenant=partner).cache_group == tenant_context(tenant=mimic).cache_group


def test_the_admin_revokes_keys_one_way(admin_client: object) -> None:
    """revoked_at is not a field staff can clear; the list's action revokes."""
    tenant = tenant_create(name="acme")
    api_key, raw_key = api_key_create(tenant=tenant)
    page = admin_client.get(f"/admin/registry/apikey/{api_key.pk}/change/")  # type: ignore[attr-defined]
    assert page.status_code == 200 and 'name="revoked_at' not in page.content.decode()
    response = admin_client.post(  # type: ignore[attr-defined]
        "/admin/registry/apikey/", {"action": "revoke", "_selected_action": [api_key.pk]}
    )
    assert response.status_code == 302
    assert tenant_context_for_api_key(raw_key) is None


@pytest.mark.django_db(transaction=True)  # the write is another thread's, which must see the key
def test_a_keys_use_is_recorded_off_the_lookups_way_at_most_once_a_minute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading
    from datetime import timedelta

    from django.db import DatabaseError
    from django.utils import timezone

    from registry import selectors, services

    monkeypatch.setattr(selectors, "api_key_mark_used", services.api_key_mark_used)  # off elsewhere
    monkeypatch.setattr(services, "_use_marked_at", {})
    tenant = tenant_create(name="acme")
    key, raw = api_key_create(tenant=tenant)
    gate, write = threading.Event(), services._write_use

    def held(*args: object) -> None:  # a database slow to take the write (SQLite's lock)
        assert gate.wait(timeout=10)
        write(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(services, "_write_use", held)
    before = timezone.now()
    assert tenant_context_for_api_key(raw) is not None  # answered while the write waits
    key.refresh_from_db()
    assert key.last_used_at is None
    gate.set()
    services._use_writer.submit(lambda: None).result(timeout=10)  # one writer: after the mark
    key.refresh_from_db()
    assert key.last_used_at is not None and key.last_used_at >= before

    # Within the minute, by the stored time or by this process's own: nothing is handed over.
    assert services.api_key_mark_used(api_key=key) is None
    later = key.last_used_at + timedelta(minutes=1)
    assert services.api_key_mark_used(api_key=key, now=later) is None
    # A minute on for both, it is; and a database that refuses the write loses only the mark.
    monkeypatch.setattr(services, "_use_marked_at", {})

    def refused(*args: object, **kwargs: object) -> int:
        raise DatabaseError("attempt to write a readonly database")

    monkeypatch.setattr(type(services.ApiKey.objects.all()), "update", refused)
    written = services.api_key_mark_used(api_key=key, now=later)
    assert written is not None and written.result(timeout=10) is None


@pytest.mark.django_db(transaction=True)  # the other write is another thread's, on its own connection
def test_other_writes_go_through_while_a_registration_copies_its_artifact(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large model's copy and hashing take minutes. Inside the registration's transaction they held
    SQLite's one write lock: a rollback or a judge tick meanwhile waited 20 s, then failed."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    from registry.models import Tenant

    copy, written = artifacts.stage_copy, []

    def slow_copy(source_dir: Path, root: Path) -> object:
        def write() -> None:
            try:
                tenant_create(name="during-the-copy")
            finally:
                connection.close()

        with ThreadPoolExecutor(1) as pool:
            pool.submit(write).result(timeout=60)
        written.append(True)
        return copy(source_dir, root)

    monkeypatch.setattr(artifacts, "stage_copy", slow_copy)
    model_version_register(name="chat", version="v1", source_dir=demo_model_dir)
    assert written and Tenant.objects.filter(name="during-the-copy").exists()
    assert routing_snapshot(model_name="chat").weights == {"v1": 100}  # type: ignore[union-attr]


@pytest.mark.django_db(transaction=True)
def test_a_version_registered_by_someone_else_during_the_copy_is_refused_and_leaves_no_files(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch, settings: object
) -> None:
    """The checks run again once the copy is done: it ran outside the transaction."""
    copy = artifacts.stage_copy

    def copy_while_another_registers(source_dir: Path, root: Path) -> object:
        monkeypatch.setattr(artifacts, "stage_copy", copy)
        model_version_register(name="chat", version="v1", source_dir=demo_model_dir, created_by="first")
        return copy(source_dir, root)

    monkeypatch.setattr(artifacts, "stage_copy", copy_while_another_registers)
    with pytest.raises(AlreadyExists):
        model_version_register(name="chat", version="v1", source_dir=demo_model_dir, created_by="second")
    assert ModelVersion.objects.get(model__name="chat", version="v1").created_by == "first"
    root = Path(settings.ARTIFACT_ROOT)  # type: ignore[attr-defined]
    assert [p.name for p in root.iterdir() if p.name.startswith(".staging-")] == []


@pytest.mark.django_db(transaction=True)
def test_a_new_model_registered_by_two_at_once_gets_both_versions(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Postgres both registrations can check before either commits: the second's insert of the new
    model then waits and fails on the unique name. It was an IntegrityError (a traceback in
    register_model); it is checked again and its version added to the model the first created."""
    from registry import services

    copy, check = artifacts.stage_copy, services._check_registrable
    stale_checks = []

    def copy_while_another_registers(source_dir: Path, root: Path) -> object:
        monkeypatch.setattr(artifacts, "stage_copy", copy)
        model_version_register(name="chat", version="v1", source_dir=demo_model_dir, created_by="first")
        return copy(source_dir, root)

    def check_read_before_the_other_committed(**kwargs: object) -> object:
        if kwargs["version"] == "v2" and len(stale_checks) < 2:
            stale_checks.append(kwargs)
            return None  # the model did not exist yet when this read
        return check(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(artifacts, "stage_copy", copy_while_another_registers)
    monkeypatch.setattr(services, "_check_registrable", check_read_before_the_other_committed)
    v2 = model_version_register(name="chat", version="v2", source_dir=demo_model_dir, created_by="second")
    assert len(stale_checks) == 2  # before the copy, and in the first try of the transaction
    assert sorted(ModelVersion.objects.filter(model__name="chat").values_list("version", flat=True)) == [
        "v1",
        "v2",
    ]
    assert Path(v2.artifact_uri).is_dir()
    assert routing_snapshot(model_name="chat").weights == {"v1": 100}  # type: ignore[union-attr]


@pytest.mark.django_db(transaction=True)
def test_an_artifact_moved_by_a_registration_whose_commit_failed_is_removed(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch, settings: object
) -> None:
    """The move into place is the transaction's last step; a commit failing after it left the files with
    no rows, and every later registration of the version was refused as already in the store."""
    from django.db import OperationalError, transaction

    from registry import services

    record = services._record_version

    def commit_fails(**kwargs: object) -> object:
        with transaction.atomic():  # the real one's becomes a savepoint of this, rolled back below
            record(**kwargs)
            raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(services, "_record_version", commit_fails)
    with pytest.raises(OperationalError):
        model_version_register(name="chat", version="v1", source_dir=demo_model_dir)
    assert not (Path(settings.ARTIFACT_ROOT) / "chat" / "v1").exists()  # type: ignore[attr-defined]
    monkeypatch.setattr(services, "_record_version", record)
    assert model_version_register(name="chat", version="v1", source_dir=demo_model_dir).version == "v1"


@pytest.mark.django_db(transaction=True)
def test_a_registration_refused_for_a_directory_it_did_not_move_leaves_that_directory(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch, settings: object
) -> None:
    """Another registration of the version has moved its files into place and not yet committed (its rows
    are not visible): this one is refused, and must not take those files with it."""
    copy = artifacts.stage_copy
    final_dir = Path(settings.ARTIFACT_ROOT) / "chat" / "v1"  # type: ignore[attr-defined]

    def copy_while_another_moves_its_files_in(source_dir: Path, root: Path) -> object:
        staged = copy(source_dir, root)
        final_dir.mkdir(parents=True)
        (final_dir / "config.json").write_text("{}")  # the other's, committed a moment later
        return staged

    monkeypatch.setattr(artifacts, "stage_copy", copy_while_another_moves_its_files_in)
    with pytest.raises(AlreadyExists, match="already exists in the artifact store"):
        model_version_register(name="chat", version="v1", source_dir=demo_model_dir)
    assert (final_dir / "config.json").exists()
