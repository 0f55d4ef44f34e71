"""Where one engine step's time goes.

    .venv/bin/python -m serving.benchmarks.step_profile [--device cuda] [--batch 1 64]

For each batch size, serving.benchmarks.step_breakdown's figures (the decode step's wall time, host ops
per layer, the attention's share, bytes copied from the KV pool) and the host ops with the most self
time. On CUDA also the device's busy time per step (the sum of its kernels' times) and that as a share
of the step: a share far below 1 means the step is bound by the host (Python, op dispatch, kernel
launches), not by the accelerator, and CUDA graphs or fewer, larger ops are what would help.

Written after the first run on a GPU machine (docs/architecture.md, "The engine on a GPU is host-bound"), so
that the next one starts from a command rather than a one-off script. On a CPU it still prints wall time and
host ops."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Where one engine step's time goes.")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-dir", default=None, help="default: the engine benchmark's model")
    parser.add_argument("--top", type=int, default=8, help="host ops to list per batch size")
    parser.add_argument("--forward", choices=("auto", "fused", "generic"), default="auto")
    parser.add_argument("--attention", choices=("auto", "native", "gather"), default="auto")
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    import torch
    from django.conf import settings

    from serving.benchmarks.bench_model import ensure_bench_model
    from serving.benchmarks.step_breakdown import decode_breakdown
    from serving.engine.engine import Engine, EngineConfig

    model_dir = (
        Path(args.model_dir)
        if args.model_dir
        else ensure_bench_model(Path(settings.STATE_DIR) / "bench-model", log=print)
    )
    max_batch = max(args.batch)
    engine = Engine(
        model_dir,
        config=EngineConfig(
            max_num_seqs=max_batch,
            max_num_batched_tokens=max(2048, args.prompt_len),
            kv_cache_bytes=512 << 20,
            device=args.device,
            forward=args.forward,
            attention=args.attention,
        ),
    )
    print(
        f"device {engine.runner.device}, dtype {engine.runner.dtype}, torch threads {torch.get_num_threads()}"
    )
    print(f"engine: {engine.runner.describe()}")
    engine.warmup()
    for batch in args.batch:
        breakdown = decode_breakdown(
            engine,
            batch=batch,
            prompt_len=args.prompt_len,
            steps=args.steps,
            repeats=args.repeats,
            top=args.top,
        )
        print(f"batch {batch:>3}: {breakdown.describe()} (median of {args.repeats} x {args.steps})")
        for name, host_ms, calls in breakdown.top_ops:
            print(f"    {name:<48} {host_ms:7.2f} ms/step host  {calls:6.0f} calls/step")


if __name__ == "__main__":
    main()
