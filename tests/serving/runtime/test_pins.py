"""A request pinned to a registered version without traffic (the README's `X-Version-Pin: v2` right after
registering v2) is served: the embedded supervisor starts a replica for it and the request waits, instead
of a 503 for ever (docs/architecture.md, "Replicas kept warm")."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async

pytestmark = pytest.mark.django_db(transaction=True)


async def test_a_pin_to_a_version_without_traffic_is_served_by_a_replica_started_for_it(
    make_tenant, runtime, demo_model_dir
) -> None:  # type: ignore[no-untyped-def]
    from django.test import AsyncClient

    from registry.services import model_version_register

    await sync_to_async(model_version_register)(name="demo-chat", version="v2", source_dir=demo_model_dir)
    pinner = await sync_to_async(make_tenant)("pinner", may_pin=True)
    assert ("demo-chat", "v2") not in runtime.replicas
    response = await AsyncClient().post(
        "/v1/models/demo-chat/infer",
        {"input": "hi", "max_tokens": 2},
        content_type="application/json",
        headers={**pinner.auth, "X-Version-Pin": "v2"},
    )
    assert response.status_code == 200, response.content
    assert response.headers["X-Served-Version"] == "v2"
    assert runtime.replicas[("demo-chat", "v2")].is_ready  # and kept, while used (REPLICA_KEEP_WARM_S)
    # Its traffic is still nobody's: the unpinned requests go to v1 as before.
    unpinned = await AsyncClient().post(
        "/v1/models/demo-chat/infer", {"input": "hi", "max_tokens": 2}, content_type="application/json",
        headers=pinner.auth,
    )  # fmt: skip
    assert unpinned.headers["X-Served-Version"] == "v1"
