"""The README's promise, checked against a real server process with a real HTTP client."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.live_server_process


def test_health_and_readiness(platform_server) -> None:
    assert httpx.get(f"{platform_server.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{platform_server.url}/readyz").json()
    # A load balancer's view: readiness and counts, not which models this platform serves.
    assert ready == {"ready": True, "database": True, "num_ready_replicas": 3}
    served = {(r["model"], r["version"], r["state"]) for r in platform_server.replicas()}
    assert served == {
        ("demo-chat", "v1", "ready"),
        ("demo-embed", "v1", "ready"),
        ("demo-classify", "v1", "ready"),
    }


def test_curl_example_streams_16_token_events_and_a_final_event(platform_server) -> None:
    events = []
    with httpx.stream(
        "POST",
        f"{platform_server.url}/v1/models/demo-chat/infer",
        headers={"Authorization": f"Bearer {platform_server.key}"},
        content=json.dumps({"input": "hello", "max_tokens": 16, "stream": True}),
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["X-Served-Version"] == "v1"
        assert response.headers["Content-Type"] == "text/event-stream"
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    tokens, final = events[:-1], events[-1]
    assert [e["index"] for e in tokens] == list(range(16))
    assert all(isinstance(e["token"], str) for e in tokens)
    assert final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 16


def test_the_readmes_openai_example_prints_a_chat_answer(platform_server) -> None:
    (example,) = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.DOTALL)
    code = example.replace("http://127.0.0.1:8000", platform_server.url).replace(
        "sy-...", platform_server.key
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # The demo model's random text, which may even be empty; never None (no content at all).
    assert result.stdout.endswith("\n") and result.stdout.strip() != "None", result.stdout


def test_classifier_example_scores_both_labels(platform_server) -> None:
    response = httpx.post(
        f"{platform_server.url}/v1/models/demo-classify/infer",
        headers={"Authorization": f"Bearer {platform_server.key}"},
        json={"input": ["hello", "hello world"]},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    assert [{p["label"] for p in labels} for labels in predictions] == [{"negative", "positive"}] * 2
    best = httpx.post(
        f"{platform_server.url}/v1/models/demo-classify/infer",
        headers={"Authorization": f"Bearer {platform_server.key}"},
        json={"input": ["hello", "hello world"], "top_k": 1},
        timeout=30,
    )
    best_labels = [[p["label"] for p in labels] for labels in best.json()["predictions"]]
    assert best_labels == [[max(labels, key=lambda p: p["score"])["label"]] for labels in predictions]


def test_openapi_schema_lists_the_inference_and_registry_paths(platform_server) -> None:
    response = httpx.get(f"{platform_server.url}/v1/schema", headers={"Accept": "application/json"})
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert {"/v1/models/{model}/infer", "/v1/models", "/v1/models/{model}/versions"} <= set(paths)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"model"} < set(body["required"]) <= set(body["properties"])
    infer = paths["/v1/models/{model}/infer"]["post"]["requestBody"]["content"]["application/json"]
    assert [s["title"] for s in infer["schema"]["anyOf"]] == ["generate (causal-lm)", "classify (classifier)"]


def test_a_newly_registered_model_gets_a_replica_without_a_restart(
    platform_server, demo_model_dir: Path
) -> None:
    result = platform_server.manage("register_model", "fresh", "v1", "--from", str(demo_model_dir))
    assert result.returncode == 0, result.stderr

    def has_fresh_replica() -> bool:
        replicas = platform_server.replicas()
        return any(r["model"] == "fresh" and r["state"] == "ready" for r in replicas)

    platform_server.wait_until(has_fresh_replica, timeout_s=30)
    response = httpx.post(
        f"{platform_server.url}/v1/models/fresh/infer",
        headers={"Authorization": f"Bearer {platform_server.key}"},
        json={"input": "hi", "max_tokens": 3},
        timeout=30,
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_a_client_that_disconnects_mid_stream_frees_its_sequence_on_the_replica(platform_server) -> None:
    def replica_state() -> dict:
        (replica,) = [
            r for r in platform_server.replicas() if r["model"] == "demo-chat" and r["version"] == "v1"
        ]
        return replica

    with httpx.stream(
        "POST",
        f"{platform_server.url}/v1/models/demo-chat/infer",
        headers={"Authorization": f"Bearer {platform_server.key}"},
        json={"input": "hello", "max_tokens": 1800, "stream": True},
        timeout=30,
    ) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        next(events)
        started = time.monotonic()
        for _ in range(20):
            next(events)
        seconds_per_token = (time.monotonic() - started) / 20
        busy = replica_state()
        assert busy["load"] == 1 and busy["kv_cache_usage"] > 0
    disconnected_at = time.monotonic()  # leaving the block closed the connection

    # Without the abort the sequence would hold its blocks for the ~1,780 tokens left; with it they are
    # freed at the next step. A quarter of the remaining generation time leaves room for a loaded machine.
    remaining_s = 1780 * seconds_per_token
    platform_server.wait_until(lambda: replica_state()["load"] == 0, timeout_s=remaining_s + 30)
    assert time.monotonic() - disconnected_at < max(1.0, 0.25 * remaining_s)
    assert replica_state()["kv_cache_usage"] == 0


def _dashboard_after_signing_in(url: str, username: str, password: str) -> httpx.Response:
    """The README's way in: open /dashboard/, get sent to the staff login form, sign in, land back."""
    with httpx.Client(base_url=url, follow_redirects=True, timeout=30) as browser:
        form = browser.get("/dashboard/")
        assert form.url.path == "/admin/login/", form.url
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
        assert csrf is not None, form.text[:2000]
        return browser.post(
            str(form.url),
            data={"username": username, "password": password, "csrfmiddlewaretoken": csrf.group(1)},
        )


def test_the_printed_staff_login_signs_in_to_the_dashboard_and_a_second_seed_keeps_it(
    platform_server,
) -> None:
    """`make serve` runs seed_demo before serving: the first run prints a staff login, later runs say it
    exists and print no password. The fixture's seed printed the login into output nobody kept, so the
    test removes that user and seeds again, which is a first run as far as the login goes. --no-key:
    a new demo key would revoke the one the other tests use."""
    removed = platform_server.manage(
        "shell",
        "-c",
        "from django.contrib.auth.models import User; User.objects.filter(username='admin').delete()",
    )
    assert removed.returncode == 0, removed.stderr
    first = platform_server.manage("seed_demo", "--no-key")
    assert first.returncode == 0, first.stderr
    printed = dict(re.findall(r"^\s*(username|password): (\S+)$", first.stdout, re.MULTILINE))
    assert printed.keys() == {"username", "password"}, first.stdout

    dashboard = _dashboard_after_signing_in(platform_server.url, printed["username"], printed["password"])
    assert dashboard.status_code == 200
    assert dashboard.url.path == "/dashboard/"
    assert "<h1>Overview</h1>" in dashboard.text and "demo-chat" in dashboard.text

    second = platform_server.manage("seed_demo", "--no-key")
    assert second.returncode == 0, second.stderr
    assert printed["password"] not in second.stdout and "password:" not in second.stdout
    assert "admin exists" in second.stdout and "manage.py changepassword admin" in second.stdout
    again = _dashboard_after_signing_in(platform_server.url, printed["username"], printed["password"])
    assert again.url.path == "/dashboard/"  # the same password still signs in: the login was kept

    # Only a hash is kept: the password is in no file of the platform's (its database, logs, models).
    state = Path(platform_server.env["SWITCHYARD_STATE_DIR"])
    secret = printed["password"].encode()
    assert not [p for p in state.rglob("*") if p.is_file() and secret in p.read_bytes()]
