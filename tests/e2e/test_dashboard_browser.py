"""The dashboard in a real browser against a real platform process.

Headless Chromium (Debian's /usr/bin/chromium, driven by Playwright's Python client; no browser is ever
downloaded) signs in through the admin login form, watches the model page's charts fill with live
points for two versions under load (one series per version), then rolls a canary back from the rollout
page and sees its traffic reach 0%. Screenshots go to test-output/ (gitignored). Outside CI the test
skips when Chromium or Playwright is missing; under CI (CI=true) that is a failure (.ci/run installs
Chromium)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import IN_CI, REPO_ROOT
from tests.e2e.conftest import LiveServer, embedded_env, serving

pytestmark = pytest.mark.live_server_process

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
OUTPUT_DIR = REPO_ROOT / "test-output"
STAFF_USER = "admin"
STAFF_PASSWORD = "dashboard-e2e-password"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
PACE_S = 0.05  # between one thread's requests: under the demo tenant's 50 requests/s
NUM_CHARTS = 13  # 6 series per version, 3 per tier, batch and wait bars, KV and queue per replica

# Every chart holds traces of both versions with at least one value, and live pushes have arrived.
CHARTS_HAVE_BOTH_VERSIONS = """
([minUpdates, numCharts]) => {
  const charts = [...document.querySelectorAll(".chart[data-chart]")];
  const numUpdates = Number(document.body.dataset.liveUpdates || 0);
  if (charts.length !== numCharts || numUpdates < minUpdates) return false;
  return charts.every((el) => {
    const withData = (el.data || []).filter((t) => (t.y || []).some((v) => v !== null && v !== undefined));
    const versions = new Set(withData.map((t) => t.legendgroup));
    return versions.has("v1") && versions.has("v2");
  });
}
"""
# Values in each version's p99 TTFT trace; and "each version has more than it had".
TTFT_COUNTS = """
() => Object.fromEntries(document.getElementById("chart-ttft").data
  .filter((t) => t.name.endsWith(" p99"))
  .map((t) => [t.legendgroup, t.y.filter((v) => v !== null && v !== undefined).length]))
"""
TTFT_GREW = (
    "(before) => { const now = (" + TTFT_COUNTS.strip() + ")(); "
    "return now.v1 > before.v1 && now.v2 > before.v2; }"
)
CHART_TRACES = """
() => [...document.querySelectorAll(".chart[data-chart]")].map((el) => ({
  chart: el.dataset.chart,
  traces: el.data.map((t) => ({
    name: t.name,
    version: t.legendgroup,
    numValues: t.y.filter((v) => v !== null && v !== undefined).length,
  })),
}))
"""


def _require_browser() -> None:
    reason = None
    if not CHROMIUM.exists():
        reason = f"Debian's chromium is not installed at {CHROMIUM} (apt-get install chromium; .ci/run does)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            reason = "the playwright Python package is not installed (pip install -e '.[dev]')"
    if reason is not None:
        if IN_CI:
            pytest.fail(f"{reason}; CI must provide it")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def dashboard_server(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[LiveServer]:
    """A platform process of its own (the shared one must keep demo-chat to itself): demo-chat v1 (the
    small test model) serving, v2 registered at 0%, a staff user, fast metrics flushes and judge ticks."""
    _require_browser()
    state = tmp_path_factory.mktemp("dashboard-state")
    env = embedded_env(
        state, SWITCHYARD_METRICS_FLUSH_INTERVAL_S="1", SWITCHYARD_ROLLOUT_JUDGE_INTERVAL_S="1"
    )
    # One process for the setup (each manage.py start costs about a second). seed_demo finds demo-chat
    # registered, so it builds no model; it prints the demo key last.
    setup = f"""
from django.contrib.auth import get_user_model
from django.core.management import call_command
call_command("migrate", interactive=False, verbosity=0)
for version in ("v1", "v2"):
    call_command("register_model", "demo-chat", version, "--from", {str(demo_model_dir)!r})
get_user_model().objects.create_superuser({STAFF_USER!r}, "admin@example.com", {STAFF_PASSWORD!r})
call_command("seed_demo")
"""
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", setup],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip().splitlines()[-1]
    with serving(state, env, key) as server:
        yield server


class Load:
    """Requests to demo-chat from a few threads until stopped; the 50/50 split sends them to both."""

    def __init__(self, server: LiveServer, *, num_threads: int = 2) -> None:
        self._server = server
        self._stop = threading.Event()
        self.statuses: dict[int, int] = {}
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(num_threads)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self._server.key}"}
        with httpx.Client(base_url=self._server.url, headers=headers, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    status = client.post(
                        "/v1/models/demo-chat/infer", json={"input": "hello there", "max_tokens": 12}
                    ).status_code
                except httpx.HTTPError:
                    status = 0
                with self._lock:
                    self.statuses[status] = self.statuses.get(status, 0) + 1
                self._stop.wait(PACE_S)


def _console_errors(page: Any, errors: list[str]) -> None:
    def on_console(message: Any) -> None:
        if message.type != "error":
            return
        # Django admin's login page links no icon, so Chromium asks for /favicon.ico and logs the 404. The
        # dashboard's own pages declare an icon and never ask.
        if message.location.get("url", "").endswith("/favicon.ico") and "/admin/" in page.url:
            return
        errors.append(f"{page.url}: {message.text}")

    page.on("console", on_console)
    page.on("pageerror", lambda error: errors.append(f"{page.url}: uncaught {error}"))


def _wait_for_live_series(page: Any) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(CHARTS_HAVE_BOTH_VERSIONS, arg=[3, NUM_CHARTS], timeout=30_000)
    except PlaywrightTimeout:
        _screenshot(page, "dashboard-model-timeout.png")
        state = page.evaluate(CHART_TRACES)
        updates = page.evaluate("document.body.dataset.liveUpdates")
        pytest.fail(f"no live series of both versions in every chart: {updates} updates; charts {state}")


def _wait_for_new_points(page: Any) -> None:
    """A later window's point arrives over the WebSocket for both versions (the page is not reloaded)."""
    before = page.evaluate(TTFT_COUNTS)
    page.wait_for_function(TTFT_GREW, arg=before, timeout=30_000)


def _screenshot(page: Any, name: str) -> None:
    """Desktop shots show the whole page; phone shots the 390x844 screen as a phone shows it."""
    page.screenshot(path=str(OUTPUT_DIR / name), full_page=page.viewport_size["width"] >= DESKTOP["width"])


def _next_update(page: Any) -> None:
    """Wait for the next live push (it redraws every chart at the current size)."""
    seen = page.evaluate("Number(document.body.dataset.liveUpdates || 0)")
    page.wait_for_function(f"Number(document.body.dataset.liveUpdates || 0) > {seen}", timeout=15_000)


def test_live_charts_per_version_and_a_rollback_from_the_browser(dashboard_server: LiveServer) -> None:
    from playwright.sync_api import expect, sync_playwright

    OUTPUT_DIR.mkdir(exist_ok=True)
    server = dashboard_server
    errors: list[str] = []
    # demo-chat is the platform's: a tenant deploys it only when granted it, and the demo tenant is not.
    created = server.manage("create_tenant", "deployer", "--deploy-model", "demo-chat", "--may-deploy")
    assert created.returncode == 0, created.stderr
    deployer_key = server.manage("create_api_key", "--tenant", "deployer").stdout.strip().splitlines()[-1]
    auth = {"Authorization": f"Bearer {deployer_key}"}
    # A canary of v2 at 50%: its replica starts, and once it is ready the judge's next tick splits 50/50.
    deployment = httpx.post(
        f"{server.url}/v1/deployments",
        headers=auth,
        json={
            "model": "demo-chat",
            "version": "v2",
            "steps": [{"pct": 50}, {"pct": 100}],
            "bake_seconds": 3600,
            "thresholds": {"min_samples": 1_000_000},  # the judge holds; the rollback is ours
        },
        timeout=30,
    )
    assert deployment.status_code == 202, deployment.text
    deployment_id = deployment.json()["deployment_id"]
    server.wait_until(
        lambda: (
            httpx.get(f"{server.url}/v1/deployments/{deployment_id}", headers=auth).json()["state"]
            == "ramping"
        ),
        timeout_s=60,
    )
    with Load(server) as load, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=DESKTOP)
            _console_errors(page, errors)

            # Sign in through the admin's form; it sends us on to the model page (5 min: a point per 5 s).
            model_page = f"{server.url}/dashboard/models/demo-chat/?range=5m"
            page.goto(model_page)
            assert "/admin/login/" in page.url
            page.fill("#id_username", STAFF_USER)
            page.fill("#id_password", STAFF_PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url(model_page)

            # Live points: every chart gets both versions' series from pushes over the WebSocket.
            _wait_for_live_series(page)
            _wait_for_new_points(page)
            expect(page.locator("#live-status")).to_have_attribute("data-state", "live")
            for chart in page.evaluate(CHART_TRACES):
                versions = {t["version"] for t in chart["traces"]}
                assert versions == {"v1", "v2"}, chart  # no trace without a version, none blended
                for version in ("v1", "v2"):
                    mine = [t for t in chart["traces"] if t["version"] == version]
                    assert all(t["name"].startswith(f"{version} ") or t["name"] == version for t in mine), (
                        chart
                    )
                    assert any(t["numValues"] for t in mine), chart
            replica_points = page.evaluate("document.getElementById('chart-kv').data.map((t) => t.x.length)")
            assert len(replica_points) == 2 and min(replica_points) >= 3  # one sample per push
            # Both replicas step under the load, and the live table says how long their steps take.
            steps = page.locator("table.replicas [data-field='step_ms']")
            expect(steps).to_have_text([re.compile(r"^\d+\.\d ms$")] * 2)
            _screenshot(page, "dashboard-model-1280x800.png")
            page.set_viewport_size(PHONE)
            _next_update(page)
            _screenshot(page, "dashboard-model-390x844.png")
            page.set_viewport_size(DESKTOP)

            page.goto(f"{server.url}/dashboard/")
            expect(page.locator("tr[data-version='v2'] .traffic")).to_have_text("50%")
            _screenshot(page, "dashboard-overview-1280x800.png")

            # The rollout page: roll the canary back (accepting the confirmation) and see it at 0%.
            page.goto(f"{server.url}/dashboard/models/demo-chat/rollout/")
            page.wait_for_url(f"{server.url}/dashboard/deployments/{deployment_id}/")
            candidate_traffic = page.locator("tr[data-role='candidate'] [data-field='traffic']")
            expect(candidate_traffic).to_have_text("50%")
            expect(page.locator("#live-status")).to_have_attribute("data-state", "live")
            _screenshot(page, "dashboard-rollout-1280x800.png")
            dialogs: list[str] = []
            page.once("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.accept()))
            page.fill("#rollback-reason", "canary answers look wrong")
            page.click("#rollback-button")
            expect(candidate_traffic).to_have_text("0%")
            assert dialogs and "Roll back" in dialogs[0]
            expect(page.locator("ol.events")).to_contain_text("canary answers look wrong")
            expect(page.locator("#rollback-timing")).to_contain_text("routing edit")
            expect(page.locator("#deployment-state")).to_contain_text("rolled_back")
            _screenshot(page, "dashboard-rollout-rolled-back-1280x800.png")
            page.set_viewport_size(PHONE)
            _screenshot(page, "dashboard-rollout-rolled-back-390x844.png")
        finally:
            browser.close()

    versions = httpx.get(f"{server.url}/v1/models/demo-chat/versions", headers=auth).json()
    assert {v["version"]: v["traffic_pct"] for v in versions} == {"v1": 100, "v2": 0}
    assert load.statuses.get(200, 0) > 20, load.statuses
    assert errors == [], errors
