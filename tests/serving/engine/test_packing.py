"""Packing Linear layers in oneDNN's format only where timing says it pays (serving/engine/packing.py).

The decision is tested on a clock that the layers themselves advance, so that which kind is faster is
the test's to say; the runner's own choice is tested for what any machine must give: a verdict, the
layers packed or not by it, and the same logits either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from serving.engine import packing
from serving.engine.packing import PackedLinear, packing_pays
from serving.engine.runner import ModelRunner
from serving.engine.sequence import Sequence


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _layers_take(monkeypatch: pytest.MonkeyPatch, clock: _Clock, cost: dict[tuple[str, int], float]) -> None:
    """Each call of a layer advances the clock by cost[(kind, out_features)]."""
    plain_forward, packed_forward = nn.Linear.forward, PackedLinear.forward

    def plain(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        clock.now += cost["plain", self.out_features]
        return plain_forward(self, x)

    def packed(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        clock.now += cost["packed", self.out_features]
        return packed_forward(self, x)

    monkeypatch.setattr(nn.Linear, "forward", plain)
    monkeypatch.setattr(PackedLinear, "forward", packed)


def _model(*shapes: tuple[int, int]) -> nn.Module:
    return nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in shapes))


@pytest.mark.parametrize(("packed_cost", "expect_pack"), [(0.5, True), (0.95, False), (2.0, False)])
def test_packs_only_when_packed_layers_are_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, packed_cost: float, expect_pack: bool
) -> None:
    clock = _Clock()
    _layers_take(monkeypatch, clock, {("plain", 8): 1.0, ("packed", 8): packed_cost})
    verdict = packing_pays(_model((8, 8), (8, 8)), rows=(1, 4), rounds=3, clock=clock)
    assert verdict.ratio == pytest.approx(packed_cost)
    assert verdict.ratio_by_rows == pytest.approx({1: packed_cost, 4: packed_cost})
    assert verdict.pack is expect_pack
    assert packing.PACK_IF_TIME_RATIO < 0.95  # a 5% gain does not pay for oneDNN's compiles and faults


def test_a_shape_weighs_as_often_as_the_model_holds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three layers of one shape, packed at half the time; one of another, packed at three times:
    # plain 3 + 1 = 4 units, packed 1.5 + 3 = 4.5. Counting each shape once would read 3.5 against 2.
    clock = _Clock()
    _layers_take(
        monkeypatch, clock, {("plain", 8): 1.0, ("packed", 8): 0.5, ("plain", 4): 1.0, ("packed", 4): 3.0}
    )
    verdict = packing_pays(_model((8, 8), (8, 8), (8, 8), (8, 4)), rows=(2,), rounds=3, clock=clock)
    assert verdict.ratio == pytest.approx(4.5 / 4)
    assert not verdict.pack


def test_the_rows_ratios_are_combined_as_a_geometric_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    plain_forward, packed_forward = nn.Linear.forward, PackedLinear.forward

    def plain(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        clock.now += 1.0
        return plain_forward(self, x)

    def packed(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        clock.now += {1: 0.25, 16: 4.0}[x.shape[0]]
        return packed_forward(self, x)

    monkeypatch.setattr(nn.Linear, "forward", plain)
    monkeypatch.setattr(PackedLinear, "forward", packed)
    verdict = packing_pays(_model((8, 8)), rows=(1, 16), rounds=3, clock=clock)
    # 4x faster at one row and 4x slower at sixteen: neither wins, whatever the units of each.
    assert verdict.ratio_by_rows == pytest.approx({1: 0.25, 16: 4.0})
    assert verdict.ratio == pytest.approx(1.0)
    assert not verdict.pack


def test_a_model_without_plain_linear_layers_is_left_as_it_is() -> None:
    verdict = packing_pays(nn.Sequential(nn.ReLU()))
    assert not verdict.pack


def test_a_runner_left_to_choose_times_both_and_follows_its_verdict(tiny_llama_dir: Path) -> None:
    def runner(pack: bool | None) -> ModelRunner:
        return ModelRunner(
            tiny_llama_dir,
            kv_cache_bytes=256 * 8192,
            block_size=16,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            pack_linear=pack,
        )

    chosen, plain = runner(None), runner(False)
    assert chosen.packing is not None
    # 2 layers x (q, k, v, o, gate, up, down) + the LM head, all or none.
    assert chosen.num_packed_linears == (15 if chosen.packing.pack else 0)
    assert chosen.packing.describe().startswith("packed" if chosen.packing.pack else "plain")
    assert plain.packing is None  # told, not timed
    prompt = list(range(3, 40))
    logits = []
    for r in (chosen, plain):
        seq = Sequence(request_id="a", prompt_token_ids=prompt)
        seq.block_table = list(range(-(-len(prompt) // 16)))
        logits.append(r.execute(r.build_batch([seq], [len(prompt)])))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
