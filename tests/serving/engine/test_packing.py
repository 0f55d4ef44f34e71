"""Packing Linear layers in oneDNN's format only where timing says it pays (serving/engine/packing.py).

The decision is tested on a clock that the layers themselves advance, so that which kind is faster is
the test's to say. The runner's own choice, tested for what any machine must give (a verdict, the
layers packed or not by it, the same logits either way), is in test_runner.py beside the forced one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from serving.engine import packing
from serving.engine.packing import PackedLinear, packing_pays


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _layers_take(
    monkeypatch: pytest.MonkeyPatch, clock: _Clock, cost: Callable[[str, nn.Module, torch.Tensor], float]
) -> None:
    """Each call of a layer advances the clock by cost(kind, layer, input)."""
    plain_forward, packed_forward = nn.Linear.forward, PackedLinear.forward

    def plain(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        clock.now += cost("plain", self, x)
        return plain_forward(self, x)

    def packed(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        clock.now += cost("packed", self, x)
        return packed_forward(self, x)

    monkeypatch.setattr(nn.Linear, "forward", plain)
    monkeypatch.setattr(PackedLinear, "forward", packed)


def _by_kind_and_width(
    costs: dict[tuple[str, int], float],
) -> Callable[[str, nn.Module, torch.Tensor], float]:
    return lambda kind, layer, x: costs[kind, layer.out_features]


def _model(*shapes: tuple[int, int]) -> nn.Module:
    return nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in shapes))


@pytest.mark.parametrize(("packed_cost", "expect_pack"), [(0.5, True), (0.95, False), (2.0, False)])
def test_packs_only_when_packed_layers_are_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, packed_cost: float, expect_pack: bool
) -> None:
    clock = _Clock()
    _layers_take(monkeypatch, clock, _by_kind_and_width({("plain", 8): 1.0, ("packed", 8): packed_cost}))
    verdict = packing_pays(_model((8, 8), (8, 8)), rows=(1, 4), rounds=3, clock=clock)
    assert verdict.ratio == pytest.approx(packed_cost)
    assert verdict.ratio_by_rows == pytest.approx({1: packed_cost, 4: packed_cost})
    assert verdict.pack is expect_pack
    assert packing.PACK_IF_TIME_RATIO < 0.95  # a 5% gain does not pay for oneDNN's compiles and faults


def test_a_shape_weighs_as_often_as_the_model_holds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three layers of one shape, packed at half the time; one of another, packed at three times:
    # plain 3 + 1 = 4 units, packed 1.5 + 3 = 4.5. Counting each shape once would read 3.5 against 2.
    clock = _Clock()
    costs = {("plain", 8): 1.0, ("packed", 8): 0.5, ("plain", 4): 1.0, ("packed", 4): 3.0}
    _layers_take(monkeypatch, clock, _by_kind_and_width(costs))
    verdict = packing_pays(_model((8, 8), (8, 8), (8, 8), (8, 4)), rows=(2,), rounds=3, clock=clock)
    assert verdict.ratio == pytest.approx(4.5 / 4)
    assert not verdict.pack


def test_the_rows_ratios_are_combined_as_a_geometric_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    packed_cost_by_rows = {1: 0.25, 16: 4.0}
    _layers_take(
        monkeypatch, clock, lambda kind, layer, x: 1.0 if kind == "plain" else packed_cost_by_rows[x.shape[0]]
    )
    verdict = packing_pays(_model((8, 8)), rows=(1, 16), rounds=3, clock=clock)
    # 4x faster at one row and 4x slower at sixteen: neither wins, whatever the units of each.
    assert verdict.ratio_by_rows == pytest.approx({1: 0.25, 16: 4.0})
    assert verdict.ratio == pytest.approx(1.0)
    assert not verdict.pack


def test_a_slow_first_call_does_not_decide_at_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """At one row a call is short enough that waking the OpenMP threads can be most of it: the first
    packed call of each sample here costs 3 units (a wake-up), the next ones 0.5, plain ones 1. A
    decode step makes such calls back to back, so packing pays at one row; timed one call a sample it
    read 3x slower. At 128 rows one call is a sample."""
    clock = _Clock()
    calls: list[tuple[str, int]] = []

    def cost(kind: str, layer: nn.Module, x: torch.Tensor) -> float:
        first = not calls or calls[-1][0] != kind
        calls.append((kind, x.shape[0]))
        if kind == "plain":
            return 1.0
        return 3.0 if first else 0.5

    _layers_take(monkeypatch, clock, cost)
    verdict = packing_pays(_model((8, 8)), rows=(1, 128), rounds=3, clock=clock)
    per_sample = packing.CALLS_PER_SAMPLE_ROWS
    assert verdict.ratio_by_rows[1] == pytest.approx((3.0 + (per_sample - 1) * 0.5) / per_sample)
    assert verdict.ratio_by_rows[1] < packing.PACK_IF_TIME_RATIO
    assert calls.count(("packed", 1)) == calls.count(("plain", 1)) == 4 * per_sample  # warm-up + 3 rounds
    assert calls.count(("packed", 128)) == calls.count(("plain", 128)) == 4


def test_the_products_given_are_timed_instead_of_the_models_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused forward multiplies wider products than the model's layers: those decide."""
    clock = _Clock()
    costs = {("plain", 8): 1.0, ("packed", 8): 2.0, ("plain", 24): 1.0, ("packed", 24): 0.5}
    _layers_take(monkeypatch, clock, _by_kind_and_width(costs))
    model = _model((8, 8), (8, 8), (8, 8))
    assert not packing_pays(model, rows=(2,), rounds=3, clock=clock).pack
    verdict = packing_pays(model, shapes=[(8, 24, False)], rows=(2,), rounds=3, clock=clock)
    assert verdict.pack
    assert verdict.ratio == pytest.approx(0.5)


def test_a_model_without_plain_linear_layers_is_left_as_it_is() -> None:
    verdict = packing_pays(nn.Sequential(nn.ReLU()))
    assert not verdict.pack
