"""Where one decode step's time goes, measured on a live engine: `bench engine` prints it for each run
of (d), `python -m serving.benchmarks.step_profile` for several batch sizes.

The engine is filled with `batch` sequences of `prompt_len` tokens (no two alike), which prefill; then
decode steps are timed (medians of `repeats` rounds of `steps` steps, the device synchronised around each
round) and a few more are profiled with torch.profiler. Reported:

- the step's wall time;
- host operations per layer: the operators the step dispatches at top level (not the ones they call
  inside), views and other metadata-only operators left out, over the model's layers; each costs
  Python and dispatch time on the host whatever its size, which is what fusing cuts;
- the attention's share of the step: the time inside the engine's `attend` (the native kernel, or the
  gather path's copies, SDPA calls and K/V writes) over the timed steps, clocked by the engine itself
  (a profiler's overhead would shrink it);
- bytes copied per step from the KV pool into contiguous buffers (the gather path's cost; the native
  kernel reads the pool in place and copies none);
- on CUDA, the device's busy time per step (its kernels' times) and kernel launches per step.

The sequences are aborted afterwards, so the engine is left as it was found (its prefix cache aside)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from serving.engine.native_attention import PROFILE_NAME

# Operators that only make a view or read metadata: no work of their own worth counting.
VIEW_OPERATORS = frozenset(
    {
        "aten::view",
        "aten::reshape",
        "aten::_reshape_alias",
        "aten::_unsafe_view",
        "aten::slice",
        "aten::select",
        "aten::as_strided",
        "aten::transpose",
        "aten::t",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::expand",
        "aten::permute",
        "aten::split",
        "aten::split_with_sizes",
        "aten::narrow",
        "aten::alias",
        "aten::detach",
        "aten::view_as_complex",
        "aten::view_as_real",
        "aten::unflatten",
        "aten::flatten",
        "aten::lift_fresh",
        "aten::numpy_T",
        "aten::is_nonzero",
        "aten::item",
        "aten::_local_scalar_dense",
    }
)


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    batch: int
    context_len: int  # tokens per sequence when the timed steps began
    step_ms: float
    host_ops_per_layer: float
    attention_share: float
    bytes_copied_per_step: float
    device_busy_ms: float | None = None  # CUDA only
    launches_per_step: float | None = None  # CUDA only
    attention_ms: float = 0.0  # per step, in the engine's attention (its own clock)
    top_ops: list[tuple[str, float, float]] = field(default_factory=list)  # name, host ms/step, calls/step

    def describe(self) -> str:
        line = (
            f"decode step at batch {self.batch}, context {self.context_len}: {self.step_ms:.2f} ms; "
            f"{self.host_ops_per_layer:.1f} host ops per layer; attention {self.attention_ms:.2f} ms = "
            f"{self.attention_share:.0%} of the step; "
            f"{self.bytes_copied_per_step / 2**20:.1f} MiB copied from the KV pool per step"
        )
        if self.device_busy_ms is not None:
            busy = self.device_busy_ms
            line += f"; device busy {busy:.2f} ms/step = {busy / self.step_ms:.0%}, "
            line += f"{self.launches_per_step:.0f} kernel launches/step"
        return line


def decode_breakdown(
    engine: Any, *, batch: int = 64, prompt_len: int = 128, steps: int = 10, repeats: int = 5, top: int = 8
) -> StepBreakdown:
    """Profile `engine`'s decode steps at `batch` sequences of `prompt_len` tokens: fewer, and shorter,
    where its max_num_seqs or KV cache cannot hold them (the figures say what was profiled)."""
    import torch

    from serving.engine.sequence import SamplingParams

    runner = engine.runner
    device = runner.device
    num_decoded = (repeats + 1) * steps + 1
    batch = min(batch, engine.config.max_num_seqs)
    # What the pool holds: shorter prompts first (down to one block), then fewer sequences.
    room = runner.num_blocks * runner.block_size // batch - num_decoded - runner.block_size
    prompt_len = max(min(prompt_len, room), min(prompt_len, runner.block_size))
    per_seq_blocks = -(-(prompt_len + num_decoded) // runner.block_size) + 1
    batch = min(batch, runner.num_blocks // per_seq_blocks)
    if batch < 1:
        raise ValueError(f"the KV cache ({runner.num_blocks} blocks) is too small to profile a decode step")

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    params = SamplingParams(max_tokens=num_decoded, ignore_eos=True, temperature=0.0)
    request_ids = [f"breakdown-{i}" for i in range(batch)]
    vocab = runner.vocab_size - 8
    for index, request_id in enumerate(request_ids):
        # Prompts that differ from their first token: shared prefix blocks would be read from cache by
        # every row, and make the attention look cheaper than a real batch's.
        prompt = [5 + (index * 31 + 7 * position) % vocab for position in range(prompt_len)]
        engine.add_request(request_id, prompt, params, tenant_id="step-breakdown")
    try:
        while engine.scheduler.num_waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running_seqs()
        ):
            engine.step()
        rounds = []
        attention_before = runner.attention_clock.seconds
        for _ in range(repeats):
            synchronize()
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            synchronize()
            rounds.append((time.perf_counter() - started) / steps * 1000)
        attention_ms = (runner.attention_clock.seconds - attention_before) * 1000 / (repeats * steps)
        copied_before = runner.scratch.num_bytes_copied
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(steps):
                engine.step()
            synchronize()
        copied = (runner.scratch.num_bytes_copied - copied_before) / steps
    finally:
        for request_id in request_ids:
            engine.abort(request_id)
    events = profile.events()
    top_level = [e for e in events if e.cpu_parent is None and not e.name.startswith("ProfilerStep")]
    num_ops = sum(1 for e in top_level if e.name not in VIEW_OPERATORS)
    averages = profile.key_averages()
    device_busy = launches = None
    if device.type == "cuda":
        device_busy = sum(e.self_device_time_total for e in averages) / 1000 / steps
        launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx")) / steps
    # The kernel's own range is left out: a profile counts the C call's time under it twice.
    operators = [e for e in averages if e.key != PROFILE_NAME]
    ranked = sorted(operators, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return StepBreakdown(
        batch=batch,
        context_len=prompt_len,
        step_ms=statistics.median(rounds),
        host_ops_per_layer=num_ops / steps / runner.num_layers,
        attention_share=attention_ms / statistics.fmean(rounds),
        bytes_copied_per_step=copied,
        device_busy_ms=device_busy,
        launches_per_step=launches,
        top_ops=[(e.key, e.self_cpu_time_total / 1000 / steps, e.count / steps) for e in ranked],
        attention_ms=attention_ms,
    )
