"""SIGTERM to the web process (docs/reliability.md, "Shutdown"): it stops taking connections, lets the
streams in flight run on for the drain, ends those still open then with a final error event in a whole
response body, and exits. A platform of its own with a short drain."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import embedded_env, seeded, serving

pytestmark = pytest.mark.live_server_process

DRAIN_S = 2.0


def _stream(url: str, key: str, max_tokens: int, first_token: threading.Event, out: list[Any]) -> None:
    """An SSE stream of /infer, read to its end: its events, and whether the body ended cleanly."""
    events: list[dict[str, Any]] = []
    body = {"input": "once upon a time", "max_tokens": max_tokens, "stream": True}
    try:
        with httpx.stream(
            "POST",
            f"{url}/v1/models/demo-chat/infer",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
                    first_token.set()
        out.append((events, "whole"))
    except httpx.HTTPError as exc:  # a body cut off mid-stream (an incomplete chunked encoding)
        out.append((events, repr(exc)))
    finally:
        first_token.set()


def sigterm_drains_two_streams(server: Any, key: str, *, exit_code: int) -> None:
    """SIGTERM while a stream that outlasts the drain (1,900 tokens) and one that ends within it (8) run:
    no new connection is taken, the short one finishes, the long one ends with a final
    `server_shutting_down` event in a whole body, and the process exits with `exit_code` once the drain
    (DRAIN_S, the server's SWITCHYARD_SHUTDOWN_DRAIN_S) is over. Shared with daphne's
    (tests/e2e/test_daphne.py)."""
    started, long_out = threading.Event(), []
    long = threading.Thread(target=_stream, args=(server.url, key, 1900, started, long_out))
    long.start()
    assert started.wait(30)
    short_started, short_out = threading.Event(), []
    short = threading.Thread(target=_stream, args=(server.url, key, 8, short_started, short_out))
    short.start()
    assert short_started.wait(30)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(httpx.HTTPError):  # no new connections
        httpx.get(f"{server.url}/healthz", timeout=2)
    long.join(timeout=DRAIN_S + 15)
    short.join(timeout=DRAIN_S + 15)
    assert server.process.wait(timeout=DRAIN_S + 15) == exit_code
    exited_after_s = time.monotonic() - signalled
    (short_events, short_end), (long_events, long_end) = short_out[0], long_out[0]
    assert short_end == "whole" and short_events[-1]["finish_reason"] == "length"  # finished in the drain
    assert long_end == "whole", long_end  # not cut mid-body
    assert long_events[-1]["finish_reason"] == "error"
    assert long_events[-1]["error"]["type"] == "server_shutting_down"
    assert DRAIN_S <= exited_after_s < DRAIN_S + 10


def test_sigterm_drains_then_ends_the_open_streams_with_a_final_event(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = embedded_env(tmp_path, SWITCHYARD_SHUTDOWN_DRAIN_S=str(DRAIN_S))
    key = seeded(env)
    with serving(tmp_path, env, key) as server:
        # uvicorn re-raises the SIGTERM it handled once it has shut down: the exit a supervisor expects.
        sigterm_drains_two_streams(server, key, exit_code=-signal.SIGTERM)
