"""The dashboard's pages: who may see them, what they show, and the two kinds of action."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.test import Client

from tests.dashboard.conftest import PASSWORD

pytestmark = pytest.mark.django_db


def _pages(deployment_id: int) -> list[str]:
    return [
        "/dashboard/",
        "/dashboard/models/chat/",
        "/dashboard/models/chat/?range=1h",
        "/dashboard/rollouts/",
        f"/dashboard/deployments/{deployment_id}/",
        "/dashboard/tenants/",
        "/dashboard/audit/",
        "/dashboard/audit/?object_type=alias&actor=x&since=2026-01-01T00:00",
    ]


def _config(response: Any) -> dict[str, Any]:
    match = re.search(
        r'<script id="dashboard-config" type="application/json">(.*?)</script>', response.text, re.S
    )
    assert match, "the model page embeds its data"
    return json.loads(match.group(1))


# --- access --------------------------------------------------------------------------------------------


def test_anonymous_visitors_are_sent_to_the_login_page(client: Client, deployment: Any) -> None:
    for url in _pages(deployment.pk):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/admin/login/?next=/dashboard/"), url


def test_signed_in_non_staff_users_get_403(client: Client, make_user: Any, deployment: Any) -> None:
    client.force_login(make_user("mallory", is_staff=False))
    for url in _pages(deployment.pk):
        assert client.get(url).status_code == 403, url
    admin = client.get("/admin/registry/apikey/")  # the admin sends a user who is not staff to its login
    assert admin.status_code == 302 and admin["Location"].startswith("/admin/login/")


def test_staff_see_every_page(staff_client: Client, chat_with_traffic: Any, deployment: Any) -> None:
    for url in _pages(deployment.pk):
        response = staff_client.get(url)
        assert response.status_code == 200, url
        assert '<script src="http' not in response.text  # nothing from a CDN
    assert staff_client.get("/dashboard/models/nope/").status_code == 404
    assert staff_client.get("/dashboard/deployments/999999/").status_code == 404


def test_the_admin_login_form_leads_to_the_dashboard(client: Client, make_user: Any) -> None:
    make_user("admin")
    response = client.post(
        "/admin/login/?next=/dashboard/",
        {"username": "admin", "password": PASSWORD, "next": "/dashboard/"},
    )
    assert response.status_code == 302 and response["Location"] == "/dashboard/"
    assert client.get("/dashboard/").status_code == 200


# --- plotly.js from the plotly package ------------------------------------------------------------------


def test_plotly_js_comes_from_the_plotly_package_through_static_files(
    staff_client: Client, chat: Any
) -> None:
    from django.contrib.staticfiles import finders

    from dashboard.finders import PLOTLY_JS_PATH, PlotlyJsFinder

    found = finders.find(PLOTLY_JS_PATH)
    assert found and found.replace("\\", "/").endswith("plotly/package_data/plotly.min.js")
    assert finders.find("dashboard/vendor/other.js") is None
    ((path, storage),) = PlotlyJsFinder().list([])  # what collectstatic copies, and where
    assert f"{storage.prefix}/{path}" == PLOTLY_JS_PATH
    html = staff_client.get("/dashboard/models/chat/").text
    assert re.search(r'<script src="/static/dashboard/vendor/plotly\.min\.js\?v=[\w.]+"></script>', html)


# --- pages ---------------------------------------------------------------------------------------------


def test_overview_shows_versions_traffic_replicas_and_fleet_kv(
    staff_client: Client, chat_with_traffic: Any
) -> None:
    html = staff_client.get("/dashboard/").text
    assert 'data-version="v1"' in html and "100%" in html
    assert "state-ready" in html and "state-loading" in html  # the fake fleet: v1 ready, v2 loading
    assert "25.0%" in html  # fleet KV use: the mean over ready replicas (v2 is still loading)
    assert "5.00%" in html  # v1's error rate over the last minute: 1 of 20
    assert "5 waiting for a batch slot" in html  # queue depths 1 + 4 (the loads are 3 + 4)


def test_overview_follows_its_live_feed(staff_client: Client, chat: Any) -> None:
    html = staff_client.get("/dashboard/").text
    match = re.search(r'<script id="overview-config" type="application/json">(.*?)</script>', html, re.S)
    assert match, "the overview embeds where its live feed is"
    live = json.loads(match.group(1))
    assert live["ws_path"] == "/dashboard/ws/overview/"
    assert live["deployment_url"] == "/dashboard/deployments/0/"
    assert re.search(r'<script src="/static/dashboard/overview\.js"></script>', html)
    assert 'id="live-status"' in html and 'data-model="chat"' in html


def test_model_page_charts_one_series_per_version(staff_client: Client, chat_with_traffic: Any) -> None:
    config = _config(staff_client.get("/dashboard/models/chat/"))
    assert config["range"] == {"key": "15m", "label": "15 min", "span_s": 900, "step_s": 15}
    assert config["charted"] == ["v1", "v2"]  # v2 has no traffic now, but it has data in the range
    assert set(config["points"]) == {"v1", "v2"}
    for version, ttft_ms, num_requests in (("v1", 100.0, 20), ("v2", 400.0, 10)):
        with_data = [p for p in config["points"][version] if p["n"]]
        assert [p["n"] for p in with_data] == [num_requests]  # never the other version's requests
        (point,) = with_data
        assert point["ttft"][2] == pytest.approx(ttft_ms, rel=0.02)  # p99, from this version alone
        assert point["queue_wait"][2] == pytest.approx(ttft_ms / 2, rel=0.02)
        assert point["err_pct"] == pytest.approx(100.0 / num_requests)
        assert point["batch"][3] == 2  # two steps of batch size 4
    assert config["last_minute"]["v1"]["num_requests"] == 20
    assert [c["id"] for c in config["charts"]] == [
        "ttft",
        "tpot",
        "queue_wait",
        "model_time",
        "req_s",
        "err_pct",
    ]
    assert [r["version"] for r in config["replicas"]] == ["v1", "v2"]
    assert config["ws_path"] == "/dashboard/ws/models/chat/?range=15m&versions=v1%2Cv2"


def test_model_page_shows_time_to_fill_a_batch_slot_per_version(
    staff_client: Client, chat_with_traffic: Any
) -> None:
    response = staff_client.get("/dashboard/models/chat/")
    assert "Time to fill a batch slot = queue wait" in response.text
    assert 'data-chart="fill"' in response.text and 'data-chart="batch"' in response.text
    config = _config(response)
    labels = config["fill_bins"]
    (v1,), (v2,) = ([p["fill"] for p in config["points"][v] if p["n"]] for v in ("v1", "v2"))
    v1_bins, v2_bins = dict(zip(labels, v1, strict=True)), dict(zip(labels, v2, strict=True))
    # v1's 20 requests waited 50 ms each, v2's 10 waited 200 ms: each version's own distribution.
    assert v1_bins["25-50 ms"] + v1_bins["50-100 ms"] == sum(v1) == 20  # 50 ms is a bin's bound
    assert v2_bins["0.1-0.25 s"] == sum(v2) == 10


def test_replicas_show_their_queue_depth_not_their_load(staff_client: Client, chat: Any) -> None:
    response = staff_client.get("/dashboard/models/chat/")
    config = _config(response)
    assert [(r["version"], r["queue_depth"], r["running"]) for r in config["replicas"]] == [
        ("v1", 1, 2),
        ("v2", 4, 0),
    ]
    assert "Queue depth per replica" in response.text and "waiting for a batch slot" in response.text
    cells = re.findall(r'data-field="queue_depth">(\d+)<', response.text)
    assert cells == ["1", "4"]
    # How long a replica's steps take; a replica still loading has run none.
    assert [r["step_ms"] for r in config["replicas"]] == [12.5, None]
    assert re.findall(r'data-field="step_ms">([^<]*)<', response.text) == ["12.5 ms", "—"]


def test_a_model_with_many_versions_charts_its_stable_one_however_old(staff_client: Client) -> None:
    """Only the newest versions' points were read, then every active one looked up: a 500."""
    from tests.conftest import model_rows

    model_rows("many", tuple(f"v{i}" for i in range(1, 31)))  # v1 stable, with all the traffic
    response = staff_client.get("/dashboard/models/many/")
    assert response.status_code == 200
    config = _config(response)
    assert "v1" in config["charted"] and config["points"]["v1"]


def test_model_page_ranges(staff_client: Client, chat: Any) -> None:
    for key, step_s in (("5m", 5), ("1h", 60), ("24h", 900), ("bogus", 15)):
        config = _config(staff_client.get(f"/dashboard/models/chat/?range={key}"))
        assert config["range"]["step_s"] == step_s
    assert _config(staff_client.get("/dashboard/models/chat/"))["charted"] == ["v1"]  # no data: active only


def test_rollout_page_shows_steps_traffic_verdicts_and_buttons(staff_client: Client, deployment: Any) -> None:
    from rollouts.judge_tick import deployment_judge
    from tests.rollouts.conftest import FakeMetrics

    response = staff_client.get("/dashboard/models/chat/rollout/")
    assert response.status_code == 302 and response["Location"] == f"/dashboard/deployments/{deployment.pk}/"
    provisioning = staff_client.get(response["Location"]).text
    # The candidate may have no replica yet: nothing to promote, but it can be called off.
    assert "Promote v2" not in provisioning and "Roll back to v1" in provisioning
    assert "it has not ramped, so chat's routing stays as it is" in provisioning  # the confirm says so
    deployment_judge(deployment=deployment, read_window=FakeMetrics())  # the candidate is up: ramping
    html = staff_client.get(response["Location"]).text
    assert 'data-role="candidate"' in html and 'data-role="incumbent"' in html
    assert "Promote v2" in html and "Roll back to v1" in html
    assert html.count('name="csrfmiddlewaretoken"') >= 3  # promote, rollback, log out
    assert "Roll back: send 100% of chat's traffic to v1 now?" in html
    assert "50%" in html and "100%" in html  # the steps


def test_rollout_page_without_deployments(staff_client: Client, chat: Any) -> None:
    response = staff_client.get("/dashboard/models/chat/rollout/")
    assert response.status_code == 200 and "no deployments" in response.text


# --- promote and rollback ------------------------------------------------------------------------------


def _csrf_client(make_user: Any, *, is_staff: bool = True) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("operator" if is_staff else "mallory", is_staff=is_staff))
    return client


def _token(client: Client, url: str) -> str:
    html = client.get(url).text
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert match
    return match.group(1)


def test_rollback_needs_a_csrf_token(make_user: Any, deployment: Any) -> None:
    client = _csrf_client(make_user)
    url = f"/dashboard/deployments/{deployment.pk}/rollback"
    assert client.post(url).status_code == 403
    deployment.refresh_from_db()
    assert deployment.state == "provisioning"


def test_rollback_and_promote_need_staff(client: Client, make_user: Any, deployment: Any) -> None:
    mallory = Client()
    mallory.force_login(make_user("mallory", is_staff=False))
    for action in ("rollback", "promote"):
        url = f"/dashboard/deployments/{deployment.pk}/{action}"
        assert client.post(url)["Location"].startswith("/admin/login/")
        assert mallory.post(url).status_code == 403
    deployment.refresh_from_db()
    assert deployment.state == "provisioning"


def test_rollback_calls_the_rollouts_service(make_user: Any, deployment: Any, monkeypatch: Any) -> None:
    from registry.selectors import routing_snapshot
    from rollouts import services

    calls = []
    real = services.deployment_rollback
    monkeypatch.setattr(
        services, "deployment_rollback", lambda **kwargs: calls.append(kwargs) or real(**kwargs)
    )
    client = _csrf_client(make_user)
    page = f"/dashboard/deployments/{deployment.pk}/"
    token = _token(client, page)
    assert client.get(f"{page}rollback").status_code == 405  # POST only
    response = client.post(f"{page}rollback", {"csrfmiddlewaretoken": token, "reason": "too slow"})
    assert response.status_code == 302 and response["Location"] == page
    assert [(c["deployment"].pk, c["actor"], c["reason"]) for c in calls] == [
        (deployment.pk, "staff:operator", "too slow")
    ]
    deployment.refresh_from_db()
    assert deployment.state == "rolled_back"
    assert routing_snapshot(model_name="chat").weights == {"v1": 100}
    html = client.get(page).text
    assert "rolled back" in html.lower() and "Roll back to" not in html  # no buttons once it has ended
    assert 'id="rollback-timing"' in html and "no routing edit" in html  # it had not ramped
    row = re.search(r'data-role="candidate">.*?data-field="traffic">(\d+)%', html, re.S)
    assert row and row.group(1) == "0"
    # A second rollback is refused by the service, shown as a message, not an error page.
    again = client.post(f"{page}rollback", {"csrfmiddlewaretoken": token}, follow=True)
    assert again.status_code == 200 and "cannot roll back" in again.text


def test_promote_calls_the_rollouts_service(make_user: Any, deployment: Any) -> None:
    from registry.selectors import routing_snapshot
    from rollouts.judge_tick import deployment_judge
    from tests.rollouts.conftest import FakeMetrics

    client = _csrf_client(make_user)
    page = f"/dashboard/deployments/{deployment.pk}/"
    # Still provisioning, the candidate may have no replica: refused, with the reason on the page.
    refused = client.post(f"{page}promote", {"csrfmiddlewaretoken": _token(client, page)}, follow=True)
    assert "no ready replica yet" in refused.content.decode()
    deployment.refresh_from_db()
    assert deployment.state == "provisioning"
    deployment_judge(deployment=deployment, read_window=FakeMetrics())  # the candidate is up: ramping
    response = client.post(f"{page}promote", {"csrfmiddlewaretoken": _token(client, page)})
    assert response.status_code == 302
    deployment.refresh_from_db()
    assert deployment.state == "promoted"
    snapshot = routing_snapshot(model_name="chat")
    assert snapshot.weights == {"v2": 100} and snapshot.aliases["stable"] == "v2"
    assert deployment.events.last().actor == "staff:operator"


# --- tenants and API keys ------------------------------------------------------------------------------


def _usage_cell(html: str, field: str) -> str:
    match = re.search(rf'data-field="{field}">(.*?)</td>', html, re.S)
    assert match, field
    return re.sub(r"<[^>]+>", "", match.group(1)).strip()


def test_tenants_page_shows_usage_against_quota(staff_client: Client, make_tenant: Any) -> None:
    from serving.gateway.quota_memory import MemoryQuotaStore
    from serving.gateway.quota_store import reset_quota_store

    store = MemoryQuotaStore(lambda: 1000.0)  # a stopped clock: nothing refills during the test
    reset_quota_store(store)
    acme = make_tenant("acme", requests_per_second=7, tokens_per_minute=12345, max_concurrent_requests=3)
    store.admit(acme.context, tokens=1000)
    store.admit(acme.context, tokens=1500)
    html = staff_client.get("/dashboard/tenants/").text
    assert "acme" in html and "12345" in html and ">7<" in html and ">3<" in html
    assert _usage_cell(html, "in_flight") == "2 / 3"
    assert _usage_cell(html, "requests_drawn") == "2 / 7"
    assert _usage_cell(html, "tokens_drawn") == "2500 / 12345"
    assert 'aria-valuenow="66.7"' in html  # the in-flight bar: 2 of 3
    assert re.search(r'data-field="num_refused_429">0<', html)
    assert "counted by this server process" in html


@pytest.mark.redis
def test_tenants_page_shows_each_tenants_service_tier_objectives_and_caps(
    staff_client: Client, make_tenant: Any
) -> None:
    make_tenant(
        "acme", max_service_tier="priority", ttft_objective_ms=400, max_running_sequences=4, kv_share=0.25
    )
    make_tenant("plain")  # the defaults: no objective, the replica's own caps
    html = staff_client.get("/dashboard/tenants/").text

    def shown(field: str) -> list[str]:
        return [
            re.sub(r"\s+", " ", cell).strip()
            for cell in re.findall(rf'data-field="{field}">(.*?)</span>', html)
        ]

    assert shown("max_service_tier") == ["priority", "default"]
    assert shown("ttft_objective_ms") == ["400 ms", "none"]
    assert shown("tpot_objective_ms") == ["none", "none"]
    assert shown("max_running_sequences") == ["4", "the replica's default"]
    assert shown("kv_share") == ["0.25", "the replica's default"]


def test_tenants_page_reads_usage_from_redis(
    staff_client: Client, make_tenant: Any, redis_url: str, settings: Any
) -> None:
    from serving.gateway.quota_store import quota_store, reset_quota_store

    settings.REDIS_URL = redis_url
    reset_quota_store()
    store = quota_store()
    store.clear()  # type: ignore[attr-defined]
    try:
        acme = make_tenant("acme", requests_per_second=0.001, tokens_per_minute=60, max_concurrent_requests=5)
        store.admit(acme.context, tokens=30)
        html = staff_client.get("/dashboard/tenants/").text
    finally:
        store.clear()  # type: ignore[attr-defined]
    assert _usage_cell(html, "in_flight") == "1 / 5"
    assert _usage_cell(html, "requests_drawn") == "1 / 1"  # the burst of a rate under 1/s is 1
    assert _usage_cell(html, "tokens_drawn") in ("30 / 60", "29 / 60")  # 1 token/s refills meanwhile
    assert "counted by every gateway (Redis)" in html


def test_tenants_page_says_when_usage_cannot_be_read(staff_client: Client, make_tenant: Any) -> None:
    from serving.gateway.quota_redis import RedisQuotaStore
    from serving.gateway.quota_store import reset_quota_store

    reset_quota_store(RedisQuotaStore("redis://127.0.0.1:1/15"))  # nothing listens on port 1
    make_tenant("acme")
    html = staff_client.get("/dashboard/tenants/").text
    assert html.count('<td class="na">not available</td>') == 3
    assert 'data-field="in_flight"' not in html
    assert '<td data-field="num_refused_429">not available</td>' in html  # not "0": unknown


def test_an_api_key_is_shown_once_and_stored_only_as_a_hash(staff_client: Client, make_tenant: Any) -> None:
    from registry.models import ApiKey
    from registry.selectors import tenant_context_for_api_key
    from registry.services import hash_api_key

    acme = make_tenant("acme")
    response = staff_client.post(f"/dashboard/tenants/{acme.tenant.pk}/api-keys", {"name": "ci"})
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    match = re.search(r'id="new-key-value">([^<]+)<', response.text)
    assert match
    raw_key = match.group(1)
    stored = ApiKey.objects.get(tenant=acme.tenant, name="ci")
    assert stored.key_hash == hash_api_key(raw_key) and stored.prefix == raw_key[: ApiKey.PREFIX_LENGTH]
    assert all(raw_key not in str(value) for value in ApiKey.objects.values_list().get(pk=stored.pk))
    assert tenant_context_for_api_key(raw_key).tenant_name == "acme"  # the key works
    later = staff_client.get("/dashboard/tenants/").text
    assert raw_key not in later and f"{stored.prefix}…" in later
    assert staff_client.get(f"/dashboard/tenants/{acme.tenant.pk}/api-keys").status_code == 405


def test_creating_an_api_key_needs_staff_and_csrf(client: Client, make_user: Any, make_tenant: Any) -> None:
    from registry.models import ApiKey

    acme = make_tenant("acme")
    url = f"/dashboard/tenants/{acme.tenant.pk}/api-keys"
    before = ApiKey.objects.count()
    assert client.post(url)["Location"].startswith("/admin/login/")
    assert _csrf_client(make_user).post(url, {"name": "x"}).status_code == 403  # no token
    assert ApiKey.objects.count() == before


def test_tenants_page_counts_429s(staff_client: Client, make_tenant: Any) -> None:
    from serving.gateway.errors import GatewayError
    from serving.gateway.quota_store import quota_store

    acme = make_tenant("acme", max_concurrent_requests=1)
    quota_store().admit(acme.context, tokens=1)
    with pytest.raises(GatewayError):
        quota_store().admit(acme.context, tokens=1)
    html = staff_client.get("/dashboard/tenants/").text
    assert re.search(r'data-field="num_refused_429">1<', html)


def test_model_page_shows_the_autoscalers_target_and_its_reason(staff_client: Client, chat: Any) -> None:
    from registry.models import ModelVersion
    from rollouts.models import ScaleTarget

    v1 = ModelVersion.objects.get(model__name="chat", version="v1")
    ScaleTarget.objects.create(
        version=v1, replicas=3, reason="queue depth 5 (target 2 a replica) on 1 replica"
    )
    response = staff_client.get("/dashboard/models/chat/")
    cells = re.findall(r'data-field="target_replicas" title="([^"]*)">([^<]*)<', response.text)
    assert cells == [("queue depth 5 (target 2 a replica) on 1 replica", "3"), ("", "—")]
    from dashboard.selectors import model_versions

    rows = {r["version"]: r for r in model_versions(model=v1.model)}
    assert (rows["v1"]["target_replicas"], rows["v2"]["target_replicas"]) == (3, None)  # what the feed pushes


@pytest.mark.parametrize("page", ["/dashboard/", "/dashboard/models/chat/"])
def test_the_pages_load_when_the_replica_directory_cannot_be_read(
    staff_client: Client, chat_with_traffic: Any, monkeypatch: Any, page: str
) -> None:
    """Redis down during an incident: the two pages staff need most were a 500."""
    from dashboard import selectors

    async def unreadable() -> list[Any]:
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(selectors, "fleet_replicas", unreadable)
    response = staff_client.get(page)
    assert response.status_code == 200
    assert b"The replica directory (Redis) cannot be read" in response.content
    assert b"No replicas running." in response.content
