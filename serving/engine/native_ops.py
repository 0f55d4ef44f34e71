"""RMSNorm and SiLU(gate) * up in C (csrc/row_ops.c), for the engine's own Llama forward on a CPU in fp32.

torch's eager RMSNorm is six operators (a power, a mean, an add, a reciprocal square root and two
products), each a pass over the rows and a dispatch on the host, and SiLU-and-multiply two more; these
are one pass and one call each (docs/benchmarks.md, "Engine step cost"). The arithmetic is
transformers': the mean of squares in fp32, then x * rsqrt(mean + eps) * weight; SiLU through an exp
of our own that vectorises (relative error < 2e-7), where libm's is a call per element."""

from __future__ import annotations

import ctypes
import functools

import torch

from serving.engine.native_library import load_library

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class NativeOps:
    """The row operators' entry points in the loaded library. Inputs are fp32 on the CPU, 2-D, rows of
    any stride with contiguous columns (checked by the caller once, at load, not per call)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._rms_norm = library.sy_rms_norm
        self._rms_norm.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int32]
        self._rms_norm.restype = None
        self._silu_and_mul = library.sy_silu_and_mul
        self._silu_and_mul.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, ctypes.c_int32]
        self._silu_and_mul.restype = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, dim] -> x * rsqrt(mean(x^2) + eps) * weight, a new tensor."""
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=x.dtype)
        self._rms_norm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), dim, rows, dim, eps, _threads()
        )
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2w] -> silu(gate_up[:, :w]) * gate_up[:, w:], a new [rows, w] tensor."""
        rows, double_width = gate_up.shape
        width = double_width // 2
        out = torch.empty((rows, width), dtype=gate_up.dtype)
        self._silu_and_mul(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), width, rows, width, _threads()
        )
        return out


def _threads() -> int:
    return torch.get_num_threads()


def load_native_ops() -> NativeOps:
    """The row operators (native_library.py builds them); raises KernelUnavailable saying why not."""
    return _ops(load_library())


@functools.cache
def _ops(library: ctypes.CDLL) -> NativeOps:
    return NativeOps(library)
