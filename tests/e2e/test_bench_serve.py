"""`manage.py bench serve --url` against a live server: the load runs over real HTTP with streaming, and
the report splits each request's TTFT into the replica's part and the rest of the path."""

from __future__ import annotations

import re
from io import StringIO

from django.core.management import call_command


def test_bench_serve_reports_latency_and_the_time_outside_the_replica(platform_server) -> None:
    out = StringIO()
    call_command(
        "bench",
        "serve",
        *("--url", platform_server.url, "--key", platform_server.key, "--model", "demo-chat"),
        *("--num-requests", "6", "--prompt-words", "3-6", "--output-len", "2-4", "--rate", "20"),
        stdout=out,
    )
    text = out.getvalue()
    assert "statuses: {'200': 6}" in text
    p50_ttft_ms = float(re.search(r"p50_ttft_ms\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    outside_ms = float(re.search(r"outside the replica.*: ([\d.]+) ms", text).group(1))  # type: ignore[union-attr]
    # The replica's own TTFT (its final event's timings) is part of what the client saw, so the rest is
    # positive and smaller than the whole.
    assert 0 < outside_ms < p50_ttft_ms
