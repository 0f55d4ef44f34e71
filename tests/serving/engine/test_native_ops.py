"""The C row operators of the fused Llama forward (serving/engine/native_ops.py, csrc/row_ops.c) against
torch's own: RMSNorm as transformers computes it, and SiLU(gate) * up, on rows of any stride."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.native_ops import NativeOps, load_native_ops
from serving.engine.runner import ModelRunner


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    return load_native_ops()


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300), dim=st.sampled_from([8, 64, 100, 512]), scale=st.sampled_from([1e-3, 1.0, 30.0])
)
def test_rms_norm_is_transformers_arithmetic(ops: NativeOps, rows: int, dim: int, scale: float) -> None:
    g = torch.Generator().manual_seed(rows * dim)
    wide = torch.randn(rows, dim + 7, generator=g) * scale
    x = wide[:, :dim]  # rows with a stride of their own, as a view of a wider product
    weight = torch.randn(dim, generator=g)
    variance = x.double().pow(2).mean(-1, keepdim=True)
    expected = (weight.double() * (x.double() * torch.rsqrt(variance + 1e-6))).float()
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), F.rms_norm(x, (dim,), weight, 1e-6))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), width=st.sampled_from([4, 64, 172, 1376]))
def test_silu_and_mul_is_torchs(ops: NativeOps, rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows + width)
    gate_up = torch.randn(rows, 2 * width, generator=g) * 6  # well into both tails of the sigmoid
    gate_up[0, 0], gate_up[-1, width - 1] = -200.0, 200.0  # past exp's range either way
    expected = F.silu(gate_up[:, :width].double()) * gate_up[:, width:].double()
    torch.testing.assert_close(ops.silu_and_mul(gate_up), expected.float(), atol=1e-5, rtol=1e-6)


def test_the_fused_forward_takes_the_c_row_ops_on_a_cpu_and_torchs_when_told(tiny_llama_dir: Path) -> None:
    options = {"kv_cache_bytes": 1 << 20, "max_num_seqs": 4, "max_num_batched_tokens": 64, "forward": "fused"}
    with_ops = ModelRunner(tiny_llama_dir, **options)
    without = ModelRunner(tiny_llama_dir, native_ops=False, **options)
    assert with_ops.fused is not None and with_ops.fused.ops is not None
    assert without.fused is not None and without.fused.ops is None
    assert "(C row ops)" in with_ops.describe() and "(C row ops)" not in without.describe()
