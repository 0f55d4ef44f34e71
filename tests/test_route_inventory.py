"""Every HTTP and WebSocket route the platform serves names the test that shows what another tenant, or a
signed-in user who is not staff, gets there (docs/reliability.md, "Tenant isolation"). A new route fails
this test until its case is written and named here; a name here whose test is gone fails it too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from django.urls import URLPattern, URLResolver, get_resolver

from config.routing import websocket_urlpatterns
from tests.conftest import REPO_ROOT

OWNERSHIP = "tests/registry/test_model_ownership.py::"
NOT_FOUND_ANYWHERE = OWNERSHIP + "test_another_tenants_model_is_not_found_on_any_endpoint_before_any_replica"
NOT_LISTED = OWNERSHIP + "test_another_tenants_model_is_not_listed_nor_found"
NO_RIGHT = "tests/rollouts/test_api.py::test_callers_without_the_right_get_403_and_change_nothing"
STAFF_FEEDS = "tests/dashboard/test_consumers.py::"
REGISTRY_WRITES = "tests/registry/test_api_writes.py::"
STAFF_ONLY = (
    REGISTRY_WRITES + "test_tenants_and_non_staff_users_get_403_on_the_staff_endpoints_and_change_nothing"
)
TRAFFIC = (
    "tests/rollouts/test_traffic_api.py::test_another_tenants_model_is_not_found_for_its_aliases_or_traffic"
)

# Route -> the test that shows its isolation; None (with the reason) where no tenant's data is there.
HTTP_CASES: dict[str, str | None] = {
    "": None,  # the landing page: links, no tenant's data
    "healthz": None,  # liveness: no tenant's data
    "readyz": "tests/serving/edge/test_readiness.py::"
    "test_the_replica_list_is_for_the_metrics_token_or_staff_not_a_load_balancer",
    "metrics": "tests/serving/telemetry/test_metrics.py::"
    "test_metrics_are_for_staff_and_the_scrape_token_only",
    "v1/schema": None,  # the API's description, the same for everyone
    "v1/models/<str:model>/infer": NOT_FOUND_ANYWHERE,
    "v1/completions": NOT_FOUND_ANYWHERE,
    "v1/chat/completions": NOT_FOUND_ANYWHERE,
    "v1/embeddings": NOT_FOUND_ANYWHERE,
    "v1/models": NOT_LISTED,
    "v1/models/<str:model>": NOT_LISTED,
    # GET lists, POST registers: another tenant's model is not found for either.
    "v1/models/<str:model>/versions": REGISTRY_WRITES
    + "test_another_tenants_model_is_not_found_for_reading_or_registering_versions",
    "v1/models/<str:model>/aliases/<str:alias>": TRAFFIC,
    "v1/models/<str:model>/traffic": TRAFFIC,
    "v1/tenants": STAFF_ONLY,
    "v1/tenants/<str:tenant>/quota": STAFF_ONLY,
    "v1/tenants/<str:tenant>/api-keys": STAFF_ONLY,
    "v1/tenants/<str:tenant>/api-keys/<str:prefix>/revoke": STAFF_ONLY,
    # GET lists, POST creates: a tenant lists only its own and granted models' deployments, unnamed.
    "v1/deployments": "tests/rollouts/test_deployment_list.py::"
    "test_a_tenant_lists_only_the_deployments_of_models_it_may_deploy",
    "v1/deployments/<int:deployment_id>": NO_RIGHT,
    "v1/deployments/<int:deployment_id>/rollback": NO_RIGHT,
    "v1/deployments/<int:deployment_id>/promote": NO_RIGHT,
    "admin/": "tests/dashboard/test_views.py::test_signed_in_non_staff_users_get_403",
    "dashboard/": "tests/dashboard/test_views.py::test_signed_in_non_staff_users_get_403",
    "favicon.ico": None,  # a redirect to a static file
}
WEBSOCKET_CASES: dict[str, str | None] = {
    "v1/models/<str:model>/stream": OWNERSHIP + "test_another_tenants_model_is_not_found_over_a_websocket",
    "dashboard/ws/models/<str:model>/": STAFF_FEEDS + "test_anonymous_and_non_staff_are_refused",
    "dashboard/ws/overview/": STAFF_FEEDS + "test_the_overview_feed_is_for_staff_only",
    "(?s)^.*$": None,  # the unrouted fallback: a 404, nothing else (tests/e2e/test_edge_limits.py)
}


def _http_routes(patterns: list[Any], prefix: str = "") -> Iterator[str]:
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver) and route in ("admin/", "dashboard/"):
            yield route  # whole sites behind the staff login, each shown by one case
        elif isinstance(pattern, URLResolver):
            yield from _http_routes(pattern.url_patterns, route)
        elif isinstance(pattern, URLPattern):
            yield route


def _exists(case: str) -> bool:
    path, _, name = case.partition("::")
    tree = ast.parse((REPO_ROOT / path).read_text())
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name for node in tree.body
    )


def test_every_http_route_has_a_tenant_isolation_case() -> None:
    assert sorted(set(_http_routes(get_resolver().url_patterns))) == sorted(HTTP_CASES)


def test_every_websocket_route_has_a_tenant_isolation_case() -> None:
    assert sorted(str(p.pattern) for p in websocket_urlpatterns) == sorted(WEBSOCKET_CASES)


def test_every_case_named_is_a_test_that_exists() -> None:
    missing = [
        case for case in (*HTTP_CASES.values(), *WEBSOCKET_CASES.values()) if case and not _exists(case)
    ]
    assert missing == []
