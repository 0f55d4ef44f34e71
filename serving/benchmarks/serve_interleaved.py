"""`bench serve --interleaved`: requests one at a time, each on the engine alone and through the API in turn,
and what the path adds, with a bootstrap interval."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serving.benchmarks.http_client import HttpClient
from serving.benchmarks.http_run import HttpRun, TextRequest
from serving.benchmarks.serve_workload import WARM_UP_PREFIX, _one
from serving.benchmarks.workload import percentile


@dataclass(slots=True, frozen=True)
class Pair:
    """One request run on the engine alone and through the API, back to back, each with the other idle."""

    request_id: str
    alone_ttft_s: float
    api_ttft_s: float
    replica_ttft_s: float | None  # the replica's own, from the gateway's submission (the final event)
    api_first: bool
    replica_queue_s: float | None = None  # of which before its first forward pass (the final event)
    # Its place in its block (run_interleaved's `block`): past 0, each of its two runs came right after
    # a run on the same path, not the other path's.
    position: int = 0

    @property
    def added_ms(self) -> float:
        return (self.api_ttft_s - self.alone_ttft_s) * 1000


async def run_interleaved(
    base_url: str,
    key: str,
    model: str,
    requests: Sequence[TextRequest],
    alone: Callable[[TextRequest], float],
    *,
    mean_gap_s: float,
    seed: int,
    statuses: Counter[str],
    block: int = 1,
) -> list[Pair]:
    """Each request once on the engine alone (`alone` runs it and returns its TTFT in seconds) and once
    through the API, each run followed by an idle gap drawn from [0, 2 * mean_gap_s], so that no run
    keeps step with the replica's heartbeat. With one request at a time no queueing amplifies a slower
    step, and a request's two runs see the machine within a second or two of each other rather than a
    minute apart (its speed drifts by several per cent over that here).

    The requests go in blocks of `block`: the block's requests on one path, then the same requests on
    the other, the API first in every second block. A run that follows the other path's run finds the
    caches full of the other process's data and pays a few ms for it here; one that follows a run on
    its own path does not, as in a deployment, where no second engine runs between two requests. Within
    a block only its first pair has such a run (the other path's side ran last): each pair carries its
    `position` in the block. With `block` 1 (requests alternating one by one) every pair has one such
    run: the report's figures by order show what that costs each path. A request the API failed is left
    out (its status is counted)."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    rng = random.Random(f"gaps-{seed}")
    path = f"/v1/models/{model}/infer"
    pairs = []
    async with HttpClient(base_url, max_connections=2) as client:
        if requests:  # untimed: the connection opens here rather than on the first pair's clock
            # Not requests[0]'s text: its prompt's blocks would then be in the replica's prefix cache
            # when it is measured there, and not in the engine alone's.
            warm_up = dataclasses.replace(
                requests[0], request_id="warm-up", arrival_s=0.0, text=f"{WARM_UP_PREFIX}{requests[0].text}"
            )
            await _one(client, path, key, warm_up, time.perf_counter(), HttpRun([], []))
        for start in range(0, len(requests), block):
            chunk = [dataclasses.replace(r, arrival_s=0.0) for r in requests[start : start + block]]
            api_first = (start // block) % 2 == 1
            run = HttpRun([], [])
            alone_ttft_s: dict[str, float] = {}
            for side in ("api", "alone") if api_first else ("alone", "api"):
                for request in chunk:
                    if side == "alone":
                        alone_ttft_s[request.request_id] = alone(request)
                    else:
                        await _one(client, path, key, request, time.perf_counter(), run)
                    await asyncio.sleep(rng.uniform(0.0, 2 * mean_gap_s))
            statuses.update(run.statuses)
            records = {record.request_id: record for record in run.records}
            for position, request in enumerate(chunk):
                api = records.get(request.request_id)
                if api is None or not api.is_complete:
                    continue
                pairs.append(
                    Pair(
                        request.request_id,
                        alone_ttft_s[request.request_id],
                        api.ttft_s,
                        run.replica_ttft_s.get(request.request_id),
                        api_first,
                        run.replica_queue_s.get(request.request_id),
                        position=position,
                    )
                )
    return pairs


def bootstrap_interval(
    pairs: Sequence[Pair],
    statistic: Callable[[Sequence[Pair]], float],
    *,
    num_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """A percentile bootstrap interval for a statistic of the pairs: resampled whole pairs, so that a
    request's two runs stay together."""
    rng = random.Random(seed)
    values = sorted(statistic(rng.choices(pairs, k=len(pairs))) for _ in range(num_resamples))
    tail = (1 - confidence) / 2 * 100
    return percentile(values, tail), percentile(values, 100 - tail)


def p50_ttft_added_ms(pairs: Sequence[Pair]) -> float:
    """The issue's figure: p50 TTFT through the API minus p50 TTFT on the engine alone."""
    through = percentile([p.api_ttft_s for p in pairs], 50)
    return (through - percentile([p.alone_ttft_s for p in pairs], 50)) * 1000


def median_added_ms(pairs: Sequence[Pair]) -> float:
    """The median over requests of each one's own difference: what the path adds to a request."""
    return percentile([p.added_ms for p in pairs], 50)


def _median_ms(values: Sequence[float], *, sign: bool = False) -> str:
    if not values:
        return "n/a"
    return f"{percentile(values, 50):{'+' if sign else ''}.2f} ms"


def interleaved_report(pairs: Sequence[Pair]) -> str:
    if not pairs:
        return "no request completed through the API: nothing to compare"
    lines = []
    statistics = {
        "p50 TTFT added by the API path": p50_ttft_added_ms,
        "median per-request difference": median_added_ms,
    }
    warm = [p for p in pairs if p.position > 0]
    groups = [("", pairs)]
    if warm:
        groups.append((f"pairs after their block's first ({len(warm)} of {len(pairs)}), ", warm))
    for prefix, group in groups:
        for name, statistic in statistics.items():
            low, high = bootstrap_interval(group, statistic)
            lines.append(
                f"{prefix}{name}: {statistic(group):+.2f} ms (95% interval {low:+.2f} to {high:+.2f})"
            )
    # The replica's own TTFT splits each difference into the path outside the replica and its inside.
    split = [(p, p.replica_ttft_s) for p in pairs if p.replica_ttft_s is not None]
    outside = [(p.api_ttft_s - replica) * 1000 for p, replica in split]
    inside = [(replica - p.alone_ttft_s) * 1000 for p, replica in split]
    # The inside again: the replica's path before its first forward pass (the engine alone starts one at
    # once), and the rest, where the two engines' speeds differ.
    queued = [(p, replica, p.replica_queue_s) for p, replica in split if p.replica_queue_s is not None]
    queue = [q * 1000 for _, _, q in queued]
    model = [(replica - q - p.alone_ttft_s) * 1000 for p, replica, q in queued]
    alone_first = [p.added_ms for p in pairs if not p.api_first]
    api_first = [p.added_ms for p in pairs if p.api_first]
    lines += [
        f"of which outside the replica (client TTFT - replica TTFT, median): {_median_ms(outside)}",
        f"and inside it (replica TTFT - engine-alone TTFT, median): {_median_ms(inside, sign=True)}",
        f"  inside, before the replica's first forward pass (its queue_s, median): {_median_ms(queue)}",
        "  inside, from that forward pass on (replica TTFT - queue_s - engine-alone TTFT, median): "
        f"{_median_ms(model, sign=True)}",
        "per-request difference by order (median): engine alone first "
        f"{_median_ms(alone_first, sign=True)}, API first {_median_ms(api_first, sign=True)}",
        *_by_position(pairs),
        f"{len(pairs)} requests, one at a time; p50 TTFT engine alone "
        f"{percentile([p.alone_ttft_s for p in pairs], 50) * 1000:.1f} ms, through the API "
        f"{percentile([p.api_ttft_s for p in pairs], 50) * 1000:.1f} ms",
    ]
    return "\n".join(lines)


def _by_position(pairs: Sequence[Pair]) -> list[str]:
    """With blocks, the median per-request difference at each place in a block: how many runs on its
    own path a run needs before the other path's stops slowing it."""
    positions = sorted({p.position for p in pairs})
    if positions == [0]:
        return []
    medians = ", ".join(
        f"{position}: {_median_ms([p.added_ms for p in pairs if p.position == position], sign=True)}"
        for position in positions
    )
    return [f"median per-request difference by place in its block: {medians}"]
