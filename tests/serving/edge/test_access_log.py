"""The access log (docs/configuration.md, "Logs"): a line per request with method, path, status,
duration and tenant, on by default; never the key, the query string or the prompt."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO_ROOT
from tests.serving.conftest import asgi_client

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "a secret plan for the quarter"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def access_lines() -> Any:
    # A handler of its own on the logger: starting the runtime reconfigures logging (Django's LOGGING),
    # which takes caplog's handler off the root.
    handler, logger = _Lines(), logging.getLogger("switchyard.access")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


async def test_each_request_is_a_line_with_its_tenant_and_never_its_key_or_prompt(acme, access_lines) -> None:  # type: ignore[no-untyped-def]
    async with asgi_client() as client:
        served = await client.post(
            "/v1/completions?note=mine",
            json={"model": "demo-chat", "prompt": PROMPT, "max_tokens": 2},
            headers=acme.auth,
        )
        refused = await client.get("/v1/models", headers={"Authorization": "Bearer sy-not-a-key"})
        listed = await client.get("/v1/models", headers=acme.auth)
    assert (served.status_code, refused.status_code, listed.status_code) == (200, 401, 200)
    completion, unauthenticated, models = access_lines
    tenant_id = acme.context.tenant_id
    assert completion.startswith("POST /v1/completions 200 ") and completion.endswith(
        f" ms tenant={tenant_id}"
    )
    assert unauthenticated.startswith("GET /v1/models 401 ") and unauthenticated.endswith(" tenant=-")
    assert models.endswith(f" ms tenant={tenant_id}")  # the control plane's DRF authentication too
    logged = "\n".join(access_lines)
    assert acme.key not in logged and PROMPT not in logged and "note=mine" not in logged


@pytest.mark.parametrize(("value", "logged"), [(None, True), ("0", False)])
def test_switchyard_access_log_0_turns_it_off(value: str | None, logged: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SWITCHYARD_ACCESS_LOG"}
    if value is not None:
        env["SWITCHYARD_ACCESS_LOG"] = value
    code = "import config.asgi as a; print(a.http_app.__qualname__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    assert ("access_logged" in out) is logged
