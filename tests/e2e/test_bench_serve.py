"""`manage.py bench serve --url` against a live server: the load runs over real HTTP with streaming, and
the report splits each request's TTFT into the replica's part and the rest of the path."""

from __future__ import annotations

import re
from io import StringIO

from django.core.management import call_command


def _bench_serve(server, *options: str) -> str:  # type: ignore[no-untyped-def]
    """What `manage.py bench serve --url` prints against the live server's demo model."""
    out = StringIO()
    call_command(
        "bench",
        "serve",
        *("--url", server.url, "--key", server.key, "--model", "demo-chat"),
        *options,
        stdout=out,
    )
    return out.getvalue()


def test_bench_serve_reports_latency_and_the_time_outside_the_replica(platform_server) -> None:
    text = _bench_serve(
        platform_server,
        *("--num-requests", "6", "--prompt-words", "3-6", "--output-len", "2-4", "--rate", "20"),
    )
    assert "outcomes (one per request): {'200': 6}" in text
    p50_ttft_ms = float(re.search(r"p50_ttft_ms\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    outside_ms = float(re.search(r"outside the replica.*: ([\d.]+) ms", text).group(1))  # type: ignore[union-attr]
    # The replica's own TTFT (its final event's timings) is part of what the client saw, so the rest is
    # positive and smaller than the whole.
    assert 0 < outside_ms < p50_ttft_ms


def test_bench_serve_runs_for_a_duration_with_prompts_sized_in_tokens(
    platform_server, demo_model_dir
) -> None:
    # The issue's own command line: a rate and a duration, prompt lengths in tokens. The demo model's
    # tokenizer is the one the fixture builds (the same training, whatever the model's size).
    text = _bench_serve(
        platform_server,
        *("--rate", "20", "--duration", "0.5", "--seed", "4"),
        *("--prompt-len", "6-12", "--tokenizer", str(demo_model_dir), "--output-len", "2-4"),
    )
    num_requests = int(re.search(r"requests\s+([\d.]+)", text).group(1).split(".")[0])  # type: ignore[union-attr]
    assert num_requests >= 3  # ~10 arrive in 0.5 s at 20/s
    assert f"outcomes (one per request): {{'200': {num_requests}}}" in text
    # As the server counted them (the final events' usage), the prompts are the lengths asked for.
    low, high = (int(n) for n in re.search(r"min (\d+), p50 \d+, max (\d+)", text).groups())  # type: ignore[union-attr]
    assert 6 <= low <= high <= 12
    sla = r"SLA p99 TTFT <= 2000 ms and p99 TPOT <= 200 ms over all \d+ requests sent .*: (met|NOT met)"
    assert re.search(sla, text)
