"""Linear layers with their weights kept in oneDNN's blocked format, for fp32 inference on a CPU.

torch runs nn.Linear on a CPU through the BLAS it was built with (MKL in the x86 wheels). On the
twenty-eighth machine (an AMD EPYC, Zen 5) that path ran the engine's decode products at a third to a
half of oneDNN's speed: [64 x 512] x [512 x 2752] in 1,005 us against 368 us, and 72 against 49 us at one
row (docs/benchmarks.md, "Engine step cost"). A weight reordered once into oneDNN's blocked layout
(`mkldnn._reorder_linear_weight`) and multiplied by `mkldnn._linear_pointwise`, the operator Inductor's
CPU backend emits, takes a dense input and returns a dense output: fp32 throughout, the same arithmetic
in another order (outputs agree with nn.Linear to ~1e-6). Its binary form adds a residual in the same
call, which the engine's own Llama forward (fused_llama.py) uses. (An earlier version converted every
input and output to and from oneDNN tensors around `mkldnn_linear`, which cost most of that gain.)

Only plain nn.Linear modules are swapped (not subclasses, which may carry behaviour of their own), and
only for fp32 on a CPU with oneDNN; a GPU keeps its own kernels.

Whether it pays depends on the CPU and on the BLAS torch was built with (with the older conversions it
was 17-45% slower on an AVX2-only AMD EPYC: docs/architecture.md, "Packed Linear layers choose themselves").
So by default the runner times both on the model's own weights at load (`packing_pays`) and packs only when
oneDNN clearly wins."""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# A sample times this many rows' worth of back-to-back calls (32 calls at one row, one at 128), as a
# decode step makes them. One call at one row (20-70 us) is mostly how soon the OpenMP threads wake: on a
# 2-core Zen 4, in eight starts of the platform, the bench model's one-row ratio read 0.80-1.75 and twice
# tipped the verdict to plain (where the engine alone makes ~20% fewer tokens a second); with 32 calls,
# 0.80-1.18 and packed in six starts of six (docs/lab/2026-12-07-zen4-loop.md, "Packing chosen at load").
CALLS_PER_SAMPLE_ROWS = 32

# Packed layers must be this much faster than plain ones to be chosen. The timing sees only a warm
# kernel; packing also costs what it does not see: oneDNN compiles kernels for each new number of rows
# (a prompt length it has not met: a median 7.7 ms on the fourteenth machine, with the older operator).
PACK_IF_TIME_RATIO = 0.9


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    mkldnn_ok: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    has_ops = hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )
    return device.type == "cpu" and dtype == torch.float32 and mkldnn_ok and has_ops


class LinearWeight:
    """One matmul's weight [out, in] (and bias), prepared for the fastest kernel at hand: oneDNN's
    blocked layout when `packed`, else as it is for torch's own matmul. Inputs are 2-D [rows, in]."""

    __slots__ = ("bias", "in_features", "is_packed", "out_features", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, packed: bool) -> None:
        self.out_features, self.in_features = weight.shape
        self.is_packed = packed
        with torch.no_grad():
            weight = weight.detach()
            self.weight = (
                torch.ops.mkldnn._reorder_linear_weight(weight.float().contiguous()) if packed else weight
            )
            self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_packed:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return y
        return F.linear(x, self.weight, self.bias)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T (+ bias): a new tensor, in one call when packed (a post-op of the product)."""
        if self.is_packed:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.weight, self.bias, "add"
            )
            return y
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)


class PackedLinear(nn.Module):
    """nn.Linear's forward over a weight in oneDNN's blocked layout. Inference only (no gradients)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.linear = LinearWeight(linear.weight, linear.bias, packed=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN weight"


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` with a PackedLinear, in place; returns how many. A tied
    output projection gets its own copy (the input embedding stays as it is)."""
    linears = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, linear in linears:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, PackedLinear(linear))
    return len(linears)


@dataclass(frozen=True, slots=True)
class PackingVerdict:
    """What timing both kinds of Linear layer found: packed time / plain time for the model's Linear
    layers, per number of rows and overall (the geometric mean), and whether to pack."""

    ratio: float
    ratio_by_rows: dict[int, float]

    @property
    def pack(self) -> bool:
        return self.ratio <= PACK_IF_TIME_RATIO

    def describe(self) -> str:
        per_rows = ", ".join(f"{rows} rows {ratio:.2f}" for rows, ratio in self.ratio_by_rows.items())
        choice = "packed" if self.pack else "plain"
        return f"{choice} (oneDNN/plain time {self.ratio:.2f}: {per_rows})"


def packing_pays(
    model: nn.Module,
    *,
    shapes: Sequence[tuple[int, int, bool]] | None = None,
    rows: Sequence[int] = (1, 16, 128),
    rounds: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> PackingVerdict:
    """Time each distinct shape of the model's plain nn.Linear layers, on its own weights, as they are
    and packed, at decode-sized and prefill-sized inputs; a shape weighs as many times as the model
    holds it. The two kinds alternate within each round and medians over the rounds are compared,
    because a shared machine's speed drifts by several per cent from one second to the next.
    `shapes` ((in, out, bias), one a product): time those instead, on random weights, when the forward
    runs other products than the model's layers (fused_llama.py's concatenated QKV and gate/up, whose
    wider products gain more from packing: on a Zen 4 EPYC the bench model's own layers read 0.73-0.92,
    once above the bar, its fused products 0.68-0.71; docs/lab/2026-12-07-half-block-tails.md)."""
    counts: Counter[tuple[int, int, bool]] = Counter()  # (in, out, bias) -> how many layers
    plain: dict[tuple[int, int, bool], nn.Linear] = {}
    if shapes is not None:
        counts.update(shapes)
        plain = {shape: nn.Linear(*shape) for shape in counts}
    else:
        for module in model.modules():
            if type(module) is nn.Linear:
                shape = (module.in_features, module.out_features, module.bias is not None)
                counts[shape] += 1
                plain.setdefault(shape, module)
    if not counts:
        return PackingVerdict(1.0, {})
    layers: dict[str, dict[tuple[int, int, bool], nn.Module]] = {
        "plain": dict(plain),
        "packed": {shape: PackedLinear(linear) for shape, linear in plain.items()},
    }
    ratio_by_rows = {}
    with torch.inference_mode():
        for num_rows in rows:
            times: dict[tuple[str, tuple[int, int, bool]], list[float]] = {}
            calls = max(1, CALLS_PER_SAMPLE_ROWS // num_rows)
            for round_index in range(rounds + 1):  # round 0 warms up: oneDNN compiles its kernels there
                for kind in ("plain", "packed") if round_index % 2 else ("packed", "plain"):
                    for shape, layer in layers[kind].items():
                        x = torch.randn(num_rows, shape[0], dtype=plain[shape].weight.dtype)
                        started = clock()
                        for _ in range(calls):
                            layer(x)
                        if round_index:
                            times.setdefault((kind, shape), []).append((clock() - started) / calls)
            total = {
                kind: sum(counts[shape] * statistics.median(times[kind, shape]) for shape in counts)
                for kind in layers
            }
            ratio_by_rows[num_rows] = total["packed"] / total["plain"]
    ratio = math.exp(statistics.fmean(math.log(r) for r in ratio_by_rows.values()))
    return PackingVerdict(ratio, ratio_by_rows)
