"""Shared fixtures: a demo model built once per run, tenants with keys, real Redis when present."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI") == "true"


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    """Outside CI a missing server skips the test with a reason; under CI it is a failure."""
    if not _port_open(host, port):
        message = f"{name} is not reachable at {host}:{port}"
        if IN_CI:
            pytest.fail(f"{message}; CI must start it (.ci/run)")
        pytest.skip(message)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that reaches the database only through a fixture (`db`, or `transactional_db`) gets the
    django_db marker that fixture implies: the Postgres pass selects by the marker (scripts/run-tests),
    and without it the metrics flushes' row locks, say, were only ever tested on SQLite."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("django_db") is None and names & {"db", "transactional_db"}:
            item.add_marker(pytest.mark.django_db(transaction="transactional_db" in names))


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The real pretrained stories260k (Llama, 5 layers, GQA 8/4, vocab 512) where CI keeps it, beside
    the repository; skips when absent (a fresh clone has none)."""
    configured = os.environ.get("SWITCHYARD_STORIES_DIR")
    path = Path(configured) if configured else REPO_ROOT.parent / "shared" / "models" / "stories260k"
    if not any(path.glob("*.safetensors")):
        pytest.skip(f"stories260k not found at {path} (set SWITCHYARD_STORIES_DIR)")
    return path


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from serving.engine.demo_model import DemoModelSpec, build_demo_model

    # Smaller than the served demo model: the same code path, less time per test run.
    spec = DemoModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    return build_demo_model(tmp_path_factory.mktemp("demo-model"), spec)


@pytest.fixture(scope="session")
def demo_embedding_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from serving.engine.demo_model import DemoEmbeddingSpec, build_demo_embedding_model

    spec = DemoEmbeddingSpec(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
    return build_demo_embedding_model(tmp_path_factory.mktemp("demo-embedding-model"), spec)


@pytest.fixture(scope="session")
def demo_classifier_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from serving.engine.demo_model import DemoEmbeddingSpec, build_demo_classifier_model

    spec = DemoEmbeddingSpec(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
    return build_demo_classifier_model(tmp_path_factory.mktemp("demo-classifier-model"), spec)


@pytest.fixture(autouse=True)
def _no_background_key_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key lookup hands its last-use write to a thread of its own (registry.services), which would
    race the test's own queries for the in-memory SQLite database's table locks, or outlive the test.
    tests/registry/test_services.py turns it back on where it is what is tested."""
    from registry import selectors

    monkeypatch.setattr(selectors, "api_key_mark_used", lambda **_: None)


@pytest.fixture(autouse=True)
def _isolated_state(settings: pytest.FixtureRequest, tmp_path: Path) -> Iterator[None]:
    """Each test gets its own artifact store and fresh per-process caches."""
    from registry.auth_throttle import api_key_failures, login_failures
    from serving.gateway import auth as gateway
    from serving.gateway.quota_store import reset_quota_store
    from serving.gateway.router import routing_cache

    settings.ARTIFACT_ROOT = tmp_path / "artifacts"  # type: ignore[attr-defined]
    for clear in (gateway.clear_auth_cache, reset_quota_store, routing_cache.clear):
        clear()
    api_key_failures.clear()  # the suite's clients all come from one address
    login_failures.clear()
    yield
    for clear in (gateway.clear_auth_cache, reset_quota_store, routing_cache.clear):
        clear()


@dataclass
class TenantWithKey:
    tenant: object
    key: str
    context: object  # the gateway's TenantContext for this tenant

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture
def make_tenant(db: None):  # type: ignore[no-untyped-def]
    from registry.selectors import tenant_context
    from registry.services import api_key_create, tenant_create

    def make(name: str = "acme", **quota: object) -> TenantWithKey:
        tenant = tenant_create(name=name, **quota)  # type: ignore[arg-type]
        _, key = api_key_create(tenant=tenant)
        return TenantWithKey(tenant, key, tenant_context(tenant=tenant))

    return make


@pytest.fixture
def registered_model(db: None, demo_model_dir: Path):  # type: ignore[no-untyped-def]
    from registry.services import model_version_register

    return model_version_register(
        name="demo-chat", version="v1", source_dir=demo_model_dir, created_by="test"
    )


@pytest.fixture
def redis_url() -> str:
    require_service("Redis", "127.0.0.1", 6379)
    return "redis://127.0.0.1:6379/15"


@pytest.fixture(autouse=True)
async def _stop_runtime() -> object:
    """A test that started the in-process runtime (replicas, reply hub) stops it on its own loop."""
    yield
    from serving.runtime import shutdown_runtime

    await shutdown_runtime()


@pytest.fixture
async def runtime(registered_model):  # type: ignore[no-untyped-def]
    """The in-process data plane on this test's loop, with its replicas loaded."""
    from serving.runtime import get_runtime

    rt = await get_runtime()
    assert await rt.wait_ready()
    return rt


@pytest.fixture(scope="session", autouse=True)
def _drop_thread_connections(django_db_setup, django_db_blocker):  # type: ignore[no-untyped-def]
    """Async code reads the database from worker threads, each with its own connection; Postgres will
    not drop the test database while they are open, so end them before pytest-django tries."""
    yield
    from django.db import connection

    with django_db_blocker.unblock():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )


def model_rows(name: str = "chat", versions: tuple[str, ...] = ("v1", "v2", "v3")):  # type: ignore[no-untyped-def]
    """Registry rows without artifacts (the control plane never opens one): the first version stable
    with 100% of traffic, later ones at 0%. Needs database access."""
    from registry.models import Model, ModelVersion, RoutingEntry, RoutingTable
    from registry.services import alias_set

    model = Model.objects.create(name=name)
    table = RoutingTable.objects.create(model=model, revision=1)
    for i, version in enumerate(versions):
        mv = ModelVersion.objects.create(
            model=model,
            version=version,
            artifact_uri=f"/nowhere/{name}/{version}",
            sha256="0" * 64,
            size_bytes=0,
            files={},
            created_by="test",
        )
        RoutingEntry.objects.create(table=table, version=mv, weight=100 if i == 0 else 0)
        if i == 0:
            alias_set(model=model, name="stable", version=mv, actor="test", reason="first")
    return model
