"""The seeded demo tenant owns a model it can roll out (issue 43: it could deploy only models it owned, and
owned none), and `make serve` runs no replica for that model until it is used: it scales to zero, which
the embedded supervisor honours (serving/replica/on_demand.py)."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.test import Client

from registry.selectors import versions_to_serve
from serving.management.commands.seed_demo import DEMO_OWN_MODEL
from serving.replica.on_demand import started_on_demand

pytestmark = pytest.mark.django_db


def _run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_a_fresh_seed_lets_the_demo_tenant_roll_its_own_model_out(
    settings, tmp_path: Path, make_tenant
) -> None:  # type: ignore[no-untyped-def]
    settings.STATE_DIR = tmp_path
    settings.ARTIFACT_ROOT = tmp_path / "artifacts"
    key = _run("seed_demo").strip().splitlines()[-1]
    # Scaled to zero: its replica comes with its first request, not with `make serve`.
    assert started_on_demand(versions_to_serve()) == {(DEMO_OWN_MODEL, "v1")}
    # The README's first rollout, as written there.
    _run("register_model", DEMO_OWN_MODEL, "v2", "--from", str(tmp_path / "demo-model"))
    response = Client().post(
        "/v1/deployments",
        data=json.dumps({"model": DEMO_OWN_MODEL, "version": "v2"}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.status_code == 202, response.content
    # The candidate's replica is kept up while the deployment is in flight (its canary alias); the
    # incumbent's still comes on demand.
    assert started_on_demand(versions_to_serve()) == {(DEMO_OWN_MODEL, "v1")}
    # Another tenant does not see it.
    other = make_tenant("acme")
    listed = Client().get("/v1/models", headers={"Authorization": f"Bearer {other.key}"}).json()
    assert DEMO_OWN_MODEL not in {m["id"] for m in listed["data"]}


@pytest.mark.django_db(transaction=True)
async def test_a_version_of_a_model_that_scales_to_zero_gets_its_replica_from_its_first_request(
    make_tenant, runtime, demo_model_dir
) -> None:  # type: ignore[no-untyped-def]
    from django.test import AsyncClient

    from registry.models import Model
    from registry.services import model_version_register
    from rollouts.scaling import scaling_bounds_set

    model = await Model.objects.acreate(name="idle-chat")  # scaled to zero before it has a version
    await sync_to_async(scaling_bounds_set)(model=model, min_replicas=0, max_replicas=1)
    await sync_to_async(model_version_register)(name="idle-chat", version="v1", source_dir=demo_model_dir)
    acme = await sync_to_async(make_tenant)("acme")
    # A supervisor pass, as its loop makes one: v1 has all of its model's traffic, and no replica.
    wanted = await sync_to_async(versions_to_serve)()
    on_demand = await sync_to_async(started_on_demand)(wanted)
    assert on_demand == {("idle-chat", "v1")}
    await runtime.supervisor.reconcile(
        [r for r in wanted if r.model_name != "idle-chat"], on_demand=on_demand
    )
    assert ("idle-chat", "v1") not in runtime.replicas
    response = await AsyncClient().post(
        "/v1/models/idle-chat/infer",
        {"input": "hi", "max_tokens": 2},
        content_type="application/json",
        headers=acme.auth,
    )
    assert response.status_code == 200, response.content
    assert runtime.replicas[("idle-chat", "v1")].is_ready
    assert runtime.supervisor.starts_on_demand("idle-chat", "v1")
