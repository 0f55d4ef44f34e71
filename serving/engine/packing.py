"""Linear layers with their weights kept in oneDNN's format, for fp32 inference on a CPU.

torch runs nn.Linear on a CPU through the BLAS it was built with; on this project's AMD EPYC machines
that path ran the engine's decode products ([64 x 512] x [512 x 1376]) at about half the speed of
oneDNN's (491 vs 248 us, and 3.3 vs 1.6 ms at 512 rows; docs/benchmarks.md). torch's own
`torch.utils.mkldnn.MkldnnLinear` keeps the weight as a oneDNN tensor and converts each input and
output: fp32 throughout, the same arithmetic in another order (outputs agree with nn.Linear to ~1e-6).
PackedLinear does the same as torch.utils.mkldnn.MkldnnLinear (whose TorchScript methods are deprecated)
through the aten operator directly.

Only plain nn.Linear modules are swapped (not subclasses, which may carry behaviour of their own), and
only for fp32 on a CPU with oneDNN; a GPU keeps its own kernels."""

from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    mkldnn_ok: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return device.type == "cpu" and dtype == torch.float32 and mkldnn_ok


class PackedLinear(nn.Module):
    """nn.Linear's forward over a weight held as a oneDNN tensor. Inference only (no gradients)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.weight = linear.weight.detach().float().to_mkldnn()
            self.bias = None if linear.bias is None else linear.bias.detach().float().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.aten.mkldnn_linear(x.to_mkldnn(), self.weight, self.bias)
        return y.to_dense()

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
