"""Service tiers under a flood, through the API: `python -m serving.benchmarks.tiers_bench`.

A platform of its own (`make serve`'s embedded default, the bench model) where tenant `bench` keeps
`--flood` long flex generations streaming, more than the replica's seats, so its queue stays full. Then,
one at a time and round after round, short requests ask for their first token: `bench`'s own priority
and default requests, and another tenant's priority request. Printed: the median and worst time to first
token of each, in seconds and in engine steps (the flood's median gap between tokens, measured in the
same run), and the priority/default ratio (docs/benchmarks.md, "Service tiers")."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from serving.benchmarks.bench_model import ensure_bench_model
from serving.benchmarks.serve_platform import Platform, run_manage

PROBES = (("bench", "priority"), ("other", "priority"), ("bench", "default"))


@dataclass
class Flood:
    gaps: list[float] = field(default_factory=list)  # seconds between a stream's tokens
    num_streams: int = 0
    stopped: asyncio.Event = field(default_factory=asyncio.Event)


async def _stream(
    client: httpx.AsyncClient,
    key: str,
    tier: str,
    max_tokens: int,
    on_token=None,  # type: ignore[no-untyped-def]
) -> float:
    """One streamed /infer; the seconds to its first token."""
    started = time.perf_counter()
    first = None
    body = {"input": "once upon a time", "max_tokens": max_tokens, "stream": True, "service_tier": tier}
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/models/bench/infer", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{tier} request refused: {response.status_code} {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if "token" in json.loads(line[6:]):
                now = time.perf_counter()
                if first is None:
                    first = now - started
                if on_token is not None:
                    on_token(now)
    return first if first is not None else float("nan")


class _Gaps:
    """A stream's token times, as gaps between consecutive tokens, into the flood's list."""

    def __init__(self, gaps: list[float]) -> None:
        self._gaps = gaps
        self._last: float | None = None

    def __call__(self, now: float) -> None:
        if self._last is not None:
            self._gaps.append(now - self._last)
        self._last = now


async def _flood_worker(client: httpx.AsyncClient, key: str, flood: Flood, max_tokens: int) -> None:
    while not flood.stopped.is_set():
        await _stream(client, key, "flex", max_tokens, _Gaps(flood.gaps))
        flood.num_streams += 1


async def _run(url: str, keys: dict[str, str], *, flood_size: int, flood_tokens: int, rounds: int) -> None:
    limits = httpx.Limits(max_connections=flood_size + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        flood = Flood()
        workers = [
            asyncio.create_task(_flood_worker(client, keys["bench"], flood, flood_tokens))
            for _ in range(flood_size)
        ]
        while len(flood.gaps) < 20 * flood_size:  # every seat busy, and the queue behind them full
            await asyncio.sleep(0.2)
        ttfts: dict[tuple[str, str], list[float]] = {probe: [] for probe in PROBES}
        for number in range(rounds):
            for tenant, tier in PROBES:
                ttft = await _stream(client, keys[tenant], tier, 4)
                ttfts[(tenant, tier)].append(ttft)
                print(f"round {number + 1}: {tenant} {tier}: first token after {ttft:.3f} s", flush=True)
        flood.stopped.set()
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    step_s = statistics.median(flood.gaps)
    print(
        f"\nflood: {flood_size} flex streams of {flood_tokens} tokens from tenant bench; engine step "
        f"(the flood's median gap between tokens) {step_s * 1000:.1f} ms"
    )
    medians = {}
    for (tenant, tier), values in ttfts.items():
        medians[(tenant, tier)] = median = statistics.median(values)
        print(
            f"{tenant:>6} {tier:<9} TTFT median {median:.3f} s ({median / step_s:.1f} steps), "
            f"worst {max(values):.3f} s, over {len(values)}"
        )
    own = medians[("bench", "priority")] / medians[("bench", "default")]
    other = medians[("other", "priority")] / medians[("bench", "default")]
    print(
        f"priority / default (median TTFT): bench's own {own:.3f}, the other tenant's {other:.3f} "
        "(target: at most 0.2)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=48, help="concurrent flex streams (default 48)")
    parser.add_argument("--flood-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the replica's seats (default 32)")
    parser.add_argument("--model-dir", type=Path, default=Path("var/bench-model"))
    args = parser.parse_args()
    model_dir = ensure_bench_model(args.model_dir.resolve(), log=print)
    platform = Platform(
        model_dir,
        layer="embedded",
        engine_env={"SWITCHYARD_MAX_NUM_SEQS": str(args.max_num_seqs)},
        redis_url="",
    )
    ok = False
    try:
        platform.start()
        run_manage(platform.env, "set_quota", "bench", "--max-service-tier", "priority")
        run_manage(platform.env, "create_tenant", "other", "--max-service-tier", "priority")
        keys = {
            "bench": platform.key,
            "other": run_manage(platform.env, "create_api_key", "--tenant", "other").strip().splitlines()[-1],
        }
        asyncio.run(
            _run(
                platform.url, keys, flood_size=args.flood, flood_tokens=args.flood_tokens, rounds=args.rounds
            )
        )
        ok = True
    finally:
        platform.stop(keep_state=not ok)


if __name__ == "__main__":
    main()
