"""`manage.py bench batching`: the dynamic batcher's two settings swept against each other on one
non-generative model, in this process: every maximum batch size by every maximum wait, at three arrival
rates set from one replica's capacity measured first in the same run.

    manage.py bench batching                                   # the default grid, the demo embedding model
    manage.py bench batching --model demo-classify:v1          # a registered version
    manage.py bench batching --batch-sizes 1,4 --waits 0,2 --duration 0.5   # a quick look

The model is the demo embedding model by default (built once under the state directory), a registered
version with `--model NAME:VERSION`, or any directory with `--model-dir`. It is driven as
`bench embed` drives it (serving/benchmarks/embed_bench.py): the encoder engine, its batcher set to the
cell's settings, fed by one loop that adds the requests that have arrived, runs a step when a batch is
due and otherwise sleeps until the next arrival or the batch's deadline, as the replica's model thread
does. Requests carry one text each (tokenized beforehand, as the replica tokenizes off the model thread).

Capacity: one replica's inputs/s with a backlog (every input queued at once) for each batch size of
the grid, wait 0; the best of them is the replica's capacity. The three rates are that capacity times
`--loads` (0.5, 0.9 and 1.2 by default: below, near and above it), unless `--rates` names them. Each
cell is an open-loop Poisson stream for `--duration` seconds, run until every request is served (none
is dropped: a cell over its capacity drains its backlog, and its latency shows it). Per cell: p50 and
p99 latency (arrival to the end of the forward pass that served it), throughput (inputs served over
the time from the first arrival to the last result), mean batch size. Printed as a table, and written
as one HTML file of heatmaps (plotly, its script inlined: it opens with no network)."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.benchmarks.workload import percentile

Log = Callable[[str], None]

DEFAULT_BATCH_SIZES = "1,4,8,16,32,64"
DEFAULT_WAITS_MS = "0,1,2,5,10,20"
DEFAULT_LOADS = "0.5,0.9,1.2"
_SOURCE = (
    "the model serves many customers on a small fleet of expensive accelerators while every tenant keeps "
    "its latency promise a batch closes when it is full or when its oldest request has waited long "
    "enough sentences of similar length share a forward pass so padding stays small"
)
_WORDS = tuple(_SOURCE.split())


@dataclass(slots=True, frozen=True)
class Cell:
    rate: float  # arrivals per second offered
    max_batch_size: int
    max_wait_ms: float
    sent: int
    served: int
    p50_ms: float
    p99_ms: float
    inputs_per_s: float
    mean_batch_size: float
    seconds: float  # wall time of the cell, its drain included


def _csv(text: str, kind: Callable[[str], Any]) -> list[Any]:
    return [kind(part) for part in str(text).split(",") if part.strip()]


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process; at least one."""
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s or not times:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _set_batcher(engine: Any, max_batch_size: int, max_wait_s: float) -> None:
    from serving.engine.batcher import BatcherConfig, DynamicBatcher

    engine.batcher = DynamicBatcher(
        BatcherConfig(max_batch_size, max_wait_s, engine.batcher.config.max_batch_tokens)
    )


def backlog_rate(engine: Any, inputs: list[list[int]], max_batch_size: int) -> float:
    """Inputs/s with every input queued at once: what one replica serves flat out at this batch size."""
    _set_batcher(engine, max_batch_size, 0.0)
    start = time.monotonic()
    for index, ids in enumerate(inputs):
        engine.add_request(f"b{index}", [ids], arrival_time=start)
    served = 0
    while engine.has_unfinished():
        served += len(engine.step())
    return served / (time.monotonic() - start)


def run_cell(
    engine: Any,
    inputs: list[list[int]],
    arrivals: list[float],
    *,
    rate: float,
    max_batch_size: int,
    max_wait_ms: float,
) -> Cell:
    """One cell: the stream `arrivals` (seconds from the start), input i = inputs[i % len(inputs)]."""
    _set_batcher(engine, max_batch_size, max_wait_ms / 1000)
    latencies: list[float] = []
    sizes: list[int] = []
    arrived_at: dict[str, float] = {}
    start = time.monotonic()
    last_done = start
    next_index = 0
    while next_index < len(arrivals) or engine.has_unfinished():
        now = time.monotonic() - start
        while next_index < len(arrivals) and arrivals[next_index] <= now:
            request_id = str(next_index)
            arrived_at[request_id] = start + arrivals[next_index]
            engine.add_request(
                request_id, [inputs[next_index % len(inputs)]], arrival_time=arrived_at[request_id]
            )
            next_index += 1
        due = engine.seconds_until_ready()
        if due == 0:
            outputs = engine.step()
            sizes.append(len(engine.last_batch.items))
            for out in outputs:
                latencies.append(out.finished_time - arrived_at.pop(out.request_id))
                last_done = max(last_done, out.finished_time)
            continue
        next_arrival = arrivals[next_index] - now if next_index < len(arrivals) else None
        waits = [w for w in (due, next_arrival) if w is not None]
        time.sleep(max(0.0, min(waits)) if waits else 0.0)
    span = max(last_done - (start + arrivals[0]), 1e-9)
    return Cell(
        rate=rate,
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
        sent=len(arrivals),
        served=len(latencies),
        p50_ms=percentile(latencies, 50) * 1000,
        p99_ms=percentile(latencies, 99) * 1000,
        inputs_per_s=len(latencies) / span,
        mean_batch_size=statistics.fmean(sizes) if sizes else 0.0,
        seconds=time.monotonic() - start,
    )


def format_table(cells: list[Cell]) -> list[str]:
    lines = [
        f"{'rate/s':>8}{'batch':>7}{'wait ms':>9}{'p50 ms':>9}{'p99 ms':>9}{'inputs/s':>10}{'mean batch':>12}"
        f"{'served':>13}"
    ]
    for c in cells:
        lines.append(
            f"{c.rate:>8.0f}{c.max_batch_size:>7}{c.max_wait_ms:>9g}{c.p50_ms:>9.1f}{c.p99_ms:>9.1f}"
            f"{c.inputs_per_s:>10.1f}{c.mean_batch_size:>12.1f}{f'{c.served}/{c.sent}':>13}"
        )
    return lines


def format_matrices(cells: list[Cell], rates: list[float]) -> list[str]:
    """Per rate, p99 ms with batch sizes down and waits across: the tail at a glance."""
    batch_sizes = sorted({c.max_batch_size for c in cells})
    waits = sorted({c.max_wait_ms for c in cells})
    by_key = {(c.rate, c.max_batch_size, c.max_wait_ms): c for c in cells}
    lines: list[str] = []
    for rate in rates:
        lines += ["", f"p99 latency (ms) at {rate:.0f}/s; rows: max batch size, columns: max wait (ms)"]
        lines.append(f"{'':>7}" + "".join(f"{w:>9g}" for w in waits))
        for size in batch_sizes:
            row = [by_key.get((rate, size, w)) for w in waits]
            lines.append(f"{size:>7}" + "".join(f"{c.p99_ms:>9.1f}" if c else f"{'':>9}" for c in row))
    return lines


def write_heatmap(cells: list[Cell], rates: list[float], path: Path, title: str) -> None:
    """One self-contained HTML file: a row of heatmaps (p50, p99, inputs/s) per rate."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    batch_sizes = sorted({c.max_batch_size for c in cells})
    waits = sorted({c.max_wait_ms for c in cells})
    by_key = {(c.rate, c.max_batch_size, c.max_wait_ms): c for c in cells}
    metrics = (("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"), ("inputs_per_s", "inputs/s"))
    figure = make_subplots(
        rows=len(rates),
        cols=len(metrics),
        subplot_titles=[f"{label} at {rate:.0f}/s" for rate in rates for _, label in metrics],
        horizontal_spacing=0.08,
        vertical_spacing=0.12 / max(1, len(rates) - 1) if len(rates) > 1 else 0.1,
    )
    x_labels = [f"{w:g} ms" for w in waits]
    y_labels = [str(size) for size in batch_sizes]
    for row, rate in enumerate(rates, start=1):
        for col, (field, label) in enumerate(metrics, start=1):
            z = [
                [getattr(by_key[(rate, s, w)], field) if (rate, s, w) in by_key else None for w in waits]
                for s in batch_sizes
            ]
            figure.add_trace(
                go.Heatmap(
                    z=z,
                    x=x_labels,
                    y=y_labels,
                    text=[[f"{v:.1f}" if v is not None else "" for v in r] for r in z],
                    texttemplate="%{text}",
                    colorscale="Viridis" if field == "inputs_per_s" else "Viridis_r",
                    showscale=False,
                    hovertemplate=f"batch %{{y}}, wait %{{x}}: {label} %{{z:.1f}}<extra></extra>",
                ),
                row=row,
                col=col,
            )
            figure.update_xaxes(title_text="max wait", type="category", row=row, col=col)
            figure.update_yaxes(title_text="max batch size", type="category", row=row, col=col)
    figure.update_layout(title=title, height=360 * len(rates), width=1200)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.write_html(str(path), include_plotlyjs=True, full_html=True)


def add_batching_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="a registered non-generative version, NAME:VERSION (default: the demo embedding model)",
    )
    parser.add_argument("--model-dir", help="an embedding model directory instead of a registered version")
    parser.add_argument(
        "--batch-sizes", default=DEFAULT_BATCH_SIZES, help="maximum batch sizes, comma-separated"
    )
    parser.add_argument("--waits", default=DEFAULT_WAITS_MS, help="maximum waits in ms, comma-separated")
    parser.add_argument(
        "--loads",
        default=DEFAULT_LOADS,
        help="arrival rates as shares of the measured capacity (below, near, above)",
    )
    parser.add_argument("--rates", help="arrival rates per second, instead of --loads")
    parser.add_argument("--duration", type=float, default=1.2, help="seconds of arrivals per cell")
    parser.add_argument(
        "--capacity-inputs", type=int, default=200, help="the backlog per batch size that measures capacity"
    )
    parser.add_argument("--words", default="8-48", help="words per text, LOW-HIGH")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--html", help="where to write the heatmaps (default: STATE_DIR/bench-batching.html)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _load_engine(options: dict[str, Any], state_dir: Path, log: Log) -> tuple[Any, str]:
    from serving.engine.encoder import EncoderConfig, EncoderEngine

    config = EncoderConfig(max_batch_size=64, max_wait_s=0.0)
    if options.get("model"):
        from registry.models import Model, ModelVersion

        name, _, version = str(options["model"]).partition(":")
        found = ModelVersion.objects.select_related("model").filter(model__name=name, version=version).first()
        if found is None:
            raise ValueError(f"no registered version {options['model']!r} (give NAME:VERSION)")
        if found.model.kind == Model.Kind.CAUSAL_LM:
            raise ValueError(f"{options['model']} is generative; the dynamic batcher serves the others")
        return EncoderEngine(found.artifact_uri, kind=found.model.kind, config=config), str(options["model"])
    if options.get("model_dir"):
        return EncoderEngine(options["model_dir"], config=config), str(options["model_dir"])
    from serving.engine.demo_model import build_demo_embedding_model

    model_dir = state_dir / "bench-embedding-model"
    if not (model_dir / "model.safetensors").exists():
        log(f"building the demo embedding model in {model_dir}")
        build_demo_embedding_model(model_dir)
    return EncoderEngine(model_dir, config=config), f"the demo embedding model ({model_dir})"


def run_batching_from_options(options: dict[str, Any], *, default_model_dir: Path, log: Log = print) -> str:
    import torch
    from tqdm import tqdm

    began = time.monotonic()
    batch_sizes = _csv(options["batch_sizes"], int)
    waits = _csv(options["waits"], float)
    low, _, high = str(options["words"]).partition("-")
    min_words, max_words = int(low), int(high or low)
    duration = float(options["duration"])
    if not batch_sizes or min(batch_sizes) < 1 or not waits or min(waits) < 0:
        raise ValueError("--batch-sizes must be positive integers and --waits numbers >= 0")
    if duration <= 0 or not 1 <= min_words <= max_words or int(options["capacity_inputs"]) < 1:
        raise ValueError("--duration must be positive, --words LOW-HIGH with 1 <= LOW <= HIGH")
    torch.set_num_threads(int(options["torch_threads"]))
    engine, model_name = _load_engine(options, default_model_dir.parent, log)
    engine.warmup()
    seed = int(options["seed"])
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(_WORDS, k=rng.randint(min_words, max_words))) for _ in range(2000)]
    inputs = [engine.encode(text)[: engine.max_input_tokens] for text in texts]

    capacity_began = time.monotonic()
    backlog = inputs[: int(options["capacity_inputs"])]
    flat_out = {size: backlog_rate(engine, backlog, size) for size in batch_sizes}
    capacity = max(flat_out.values())
    capacity_s = time.monotonic() - capacity_began
    if options.get("rates"):
        rates = _csv(options["rates"], float)
    else:
        rates = [capacity * load for load in _csv(options["loads"], float)]
    if not rates or min(rates) <= 0:
        raise ValueError("--rates and --loads must be positive")

    cells: list[Cell] = []
    grid = [(rate, size, wait) for rate in rates for size in batch_sizes for wait in waits]
    with tqdm(
        total=len(grid), desc="bench batching", unit="cell", disable=bool(options.get("no_progress"))
    ) as bar:
        for index, (rate, size, wait) in enumerate(grid):
            arrivals = poisson_arrivals(rate, duration, random.Random(seed * 1_000_003 + index))
            cells.append(run_cell(engine, inputs, arrivals, rate=rate, max_batch_size=size, max_wait_ms=wait))
            bar.update(1)
    grid_s = sum(c.seconds for c in cells)
    html = Path(options.get("html") or default_model_dir.parent / "bench-batching.html")
    title = f"Dynamic batching: {model_name}, {duration:g} s of Poisson arrivals per cell"
    write_heatmap(cells, rates, html, title)

    lengths = sorted(len(i) for i in inputs)
    lost = sum(c.sent - c.served for c in cells)
    lines = [
        f"Switchyard batching sweep: {model_name} ({engine.dimension} dimensions), torch threads "
        f"{torch.get_num_threads()}",
        f"workload: one text per request, {lengths[0]}-{lengths[-1]} tokens (median "
        f"{lengths[len(lengths) // 2]}), Poisson arrivals for {duration:g} s per cell, seed {seed}",
        "capacity (inputs/s with a backlog of "
        f"{len(backlog)}, wait 0): "
        + ", ".join(f"batch {size} {rate:.0f}" for size, rate in flat_out.items())
        + f"; one replica's capacity {capacity:.0f}/s",
        "rates: " + ", ".join(f"{rate:.0f}/s" for rate in rates),
        "",
        *format_table(cells),
        *format_matrices(cells, rates),
        "",
        f"{len(cells)} cells, {sum(c.sent for c in cells)} requests, "
        + ("every one served" if not lost else f"{lost} NOT SERVED"),
        f"heatmaps: {html}",
        f"time: capacity {capacity_s:.1f} s, grid {grid_s:.1f} s, total {time.monotonic() - began:.1f} s "
        "(the model's load included)",
    ]
    return "\n".join(lines) + "\n"
