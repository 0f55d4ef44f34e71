"""Weight-only int8 Linear layers: the weights in int8 with one symmetric scale per output channel, the
activations and the arithmetic in the model's dtype (docs/architecture.md, "Quantized siblings").

    weight_fp ~= weight_int8 * scale[:, None],  scale = max |row| / 127,  weight_int8 in [-127, 127]

Two ways to multiply: torch's int8 kernel (`aten._weight_int8pack_mm`: x @ w.T * scales; a CPU kernel in
torch 2.13, any other device's tried), which never materialises a float weight, or dequantizing on the
fly (`x @ w.to(dtype).T * scale`, any device, a GPU's included: one transient float copy of the layer's
weight per call, then the BLAS). The kernel is taken only where it runs and is faster, timed once per
process, device type and dtype on a decode-sized product (`int8_kernel_pays`): on a 2-core AMD EPYC (Zen
5, AVX-512; docs/benchmarks.md, "Quantized siblings") torch 2.13's kernel was 10-25x slower than the fp32
BLAS (0.49 vs 0.05 ms for 1x512 @ 512x1376, 35 vs 0.9 ms at 64 rows, one thread), while dequantizing cost
about what fp32 does. Decided once, every call of one model runs the same arithmetic, so the engine's
forward and transformers' `generate` over the same module give the same tokens."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

INT8_MAX = 127


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights, fp32 scales) for a [out, in] float weight: symmetric, one scale per output row.
    A row of zeros gets scale 1 (any scale reproduces it)."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize(weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight an int8 one stands for."""
    return weight_int8.to(torch.float32) * scale.to(torch.float32)[:, None]


def _median_s(fn: Callable[[], object], device_type: str, repeats: int = 7) -> float:
    def sync() -> None:
        if device_type == "cuda":  # kernels run asynchronously: time them to their end
            torch.cuda.synchronize()

    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@functools.cache
def int8_kernel_pays(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `aten._weight_int8pack_mm` runs on this device type and dtype and beats dequantizing on
    the fly, on 16 rows x a 1024 x 1024 weight (timed once per process: a few milliseconds)."""
    try:
        x = torch.randn(16, 1024, dtype=dtype, device=device_type)
        w = torch.randint(-INT8_MAX, INT8_MAX + 1, (1024, 1024), dtype=torch.int8, device=device_type)
        s = torch.rand(1024, dtype=dtype, device=device_type)
        kernel_s = _median_s(lambda: torch.ops.aten._weight_int8pack_mm(x, w, s), device_type)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return kernel_s < _median_s(lambda: F.linear(x, w.to(dtype)) * s, device_type)


class Int8Linear(nn.Module):
    """nn.Linear's forward over int8 weights and per-output-channel scales. Inference only. `weight` is
    the int8 tensor (so a checkpoint's `<name>.weight` loads into it), `weight_scale` the scales in the
    model's dtype; both are buffers, not parameters: nothing trains them."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=dtype, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 form of a float Linear layer (quantized here), on its device and in its dtype."""
        dtype, device = linear.weight.dtype, linear.weight.device
        layer = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=dtype, device=device
        )
        q, scale = quantize_per_channel(linear.weight)
        layer.weight.copy_(q)
        layer.weight_scale.copy_(scale.to(dtype))
        if linear.bias is not None and layer.bias is not None:
            layer.bias.copy_(linear.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        out: torch.Tensor
        if int8_kernel_pays(rows.device.type, rows.dtype):
            out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight, self.weight_scale)
        else:  # dequantize on the fly: one float copy of this layer's weights per call
            out = F.linear(rows, self.weight.to(rows.dtype)) * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*leading, self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, int8"
