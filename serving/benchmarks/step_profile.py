"""Where one engine step's time goes.

    .venv/bin/python -m serving.benchmarks.step_profile [--device cuda] [--batch 1 64]

For each batch size it fills the engine with that many 64-token prompts, lets them prefill, then times
decode steps (medians of --repeats rounds of --steps steps, the device synchronised around each round)
and profiles a few more with torch.profiler. It prints, per batch size:

- the decode step's wall time;
- the device's busy time per step (the sum of its kernels' times; CUDA only) and that as a share of the
  step: a share far below 1 means the step is bound by the host (Python, op dispatch, kernel launches),
  not by the accelerator, and CUDA graphs or fewer, larger ops are what would help;
- kernel launches per step, and the host ops with the most self time.

Written after the first run on a GPU machine (docs/benchmarks.md, "A GPU machine"), so that the next one
starts from a command rather than a one-off script. On a CPU it still prints wall time and host ops."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Where one engine step's time goes.")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-dir", default=None, help="default: the engine benchmark's model")
    parser.add_argument("--top", type=int, default=8, help="host ops to list per batch size")
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    import torch
    from django.conf import settings

    from serving.benchmarks.bench_model import ensure_bench_model
    from serving.engine.engine import Engine, EngineConfig
    from serving.engine.sequence import SamplingParams

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
        ),
    )
    device = engine.runner.device
    print(f"device {device}, dtype {engine.runner.dtype}, torch threads {torch.get_num_threads()}")
    engine.warmup()

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    prompt = [5 + i % 64 for i in range(args.prompt_len)]
    for batch in args.batch:
        for i in range(batch):
            engine.add_request(
                f"b{batch}-{i}",
                prompt,
                SamplingParams(
                    max_tokens=engine.max_model_len - len(prompt), ignore_eos=True, temperature=0.0
                ),
            )
        while engine.scheduler.num_waiting or any(
            s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running_seqs()
        ):
            engine.step()
        rounds = []
        for _ in range(args.repeats):
            synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            synchronize()
            rounds.append((time.perf_counter() - start) / args.steps * 1000)
        step_ms = statistics.median(rounds)

        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(args.steps):
                engine.step()
            synchronize()
        events = profile.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx"))
        line = f"batch {batch:>3}: decode step {step_ms:.2f} ms (median of {args.repeats} x {args.steps})"
        if device.type == "cuda":
            # Self device time of every op: each kernel counted once, under the op that launched it.
            busy_ms = sum(e.self_device_time_total for e in events) / 1000 / args.steps
            line += (
                f"; device busy {busy_ms:.2f} ms/step = {busy_ms / step_ms:.0%} of the step; "
                f"{launches / args.steps:.0f} kernel launches/step"
            )
        print(line)
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
        for event in top:
            print(
                f"    {event.key:<48} {event.self_cpu_time_total / 1000 / args.steps:7.2f} ms/step host"
                f"  {event.count / args.steps:6.0f} calls/step"
            )
        for request_id in [s.request_id for s in engine.scheduler.running_seqs()]:
            engine.abort(request_id)


if __name__ == "__main__":
    main()
