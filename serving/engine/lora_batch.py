"""Batched LoRA in the fused Llama forward: many adapters, and the base, in one continuous batch.

An adapter is installed into the fused forward's own layout (lora_weights.py): per layer, four sites,
one per fused product (QKV, O, gate/up, down): out += (x A) B, x A one product for all the site's
targets, B one per target.

A step (`LoraStep`) groups the batch's token rows by adapter: the engine orders a step's sequences by
adapter, so each adapter's rows are one run of the batch, whose update is added in place (rows out of
that order are gathered by adapter and added back by index). Rows of the base take no part; a step with
no adapter row builds no LoraStep, and the forward's LoRA code is a None check per site. (Grouping, not a
bmm over A and B gathered per row: docs/architecture.md, "Adapters on a shared base", has the timing.)"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from serving.engine.lora_slots import AdapterSlots
from serving.engine.sequence import Sequence

QKV, OUT, GATE_UP, DOWN = 0, 1, 2, 3  # the fused forward's four products, in a layer's order


@dataclass(frozen=True, slots=True)
class SiteWeights:
    """An adapter's update at one site of one layer, for the n of the site's targets it has: x a, then
    each target's columns of the fused output from its rank's share of that: out[:, start:end] +=
    (x a)[:, i r : (i + 1) r] b_i. (One block-diagonal b would be one product, but reads and multiplies
    its zeros: a decode step of 8 rank-16 adapters ran ~10% slower with it.)"""

    a: torch.Tensor  # [in, n x rank]: the targets' A, transposed, side by side
    rank: int
    b: tuple[tuple[int, int, torch.Tensor], ...]  # (start, end, B_i [rank, end - start], scaled) each
    uncovered: tuple[tuple[int, int], ...]  # the output's columns of the targets it lacks (zero update)


# Per layer, each site's weights, or None where the adapter has none of the site's targets.
FusedLoraWeights = tuple[tuple[SiteWeights | None, ...], ...]


class LoraStep:
    """One step's adapter rows, grouped by adapter, and the per-site update of them. Where each adapter's
    rows lie side by side in the batch (the engine orders a step's sequences by adapter so that they
    do) its updates are added to those rows in place; otherwise the adapter rows are gathered in
    adapter order, and their updates added back by index."""

    __slots__ = ("_index", "_segments", "num_rows")

    def __init__(
        self,
        weights: Seq[FusedLoraWeights | None],
        query_lens: np.ndarray,
        device: torch.device,
    ) -> None:
        """`weights`: each sequence's adapter (None: the base), in batch order; `query_lens`: each
        sequence's rows (tokens) this step. Needs at least one adapter row."""
        groups: dict[int, int] = {}  # id(weights) -> group number, in first-seen order
        group_weights: list[FusedLoraWeights] = []
        seq_group = np.full(len(weights), -1, np.int64)
        for index, w in enumerate(weights):
            if w is not None:
                seq_group[index] = groups.setdefault(id(w), len(groups))
                if seq_group[index] == len(group_weights):
                    group_weights.append(w)
        token_group = np.repeat(seq_group, query_lens)
        order = np.argsort(token_group, kind="stable")
        order = order[token_group[order] >= 0]
        counts = np.bincount(token_group[order], minlength=len(group_weights))
        ends = np.cumsum(counts).tolist()
        starts = [0, *ends[:-1]]
        self.num_rows = len(order)
        runs = [(s, e) for s, e in zip(starts, ends, strict=True) if e > s]
        if all(order[e - 1] - order[s] == e - s - 1 for s, e in runs):  # each adapter's rows side by side
            self._index: torch.Tensor | None = None
            runs = [(int(order[s]), int(order[s]) + e - s) for s, e in runs]
        else:
            self._index = torch.from_numpy(order).to(device)
        used = [w for w, count in zip(group_weights, counts.tolist(), strict=True) if count]
        self._segments = [(w, s, e) for w, (s, e) in zip(used, runs, strict=True)]

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: int) -> None:
        """out[rows] += (x[rows] A) B for each adapter row, in place, with that row's adapter's weights
        of `site` in `layer`. On a CPU the update's small products run on one thread: on this 2-core
        machine's two, each took twice as long (a layer's QKV update of 64 rows over 8 adapters: 342
        against 171 µs, `bench lora` (c); docs/benchmarks.md "LoRA adapters"), while the base's large
        products around it keep every thread."""
        threads = torch.get_num_threads()
        if threads == 1 or out.device.type != "cpu":
            self._add(out, x, layer, site)
            return
        torch.set_num_threads(1)
        try:
            self._add(out, x, layer, site)
        finally:
            torch.set_num_threads(threads)

    def _add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: int) -> None:
        if self._index is None:
            for weights, start, end in self._segments:
                site_weights = weights[layer][site]
                if site_weights is not None:
                    _add_update(out[start:end], x[start:end], site_weights, zero_uncovered=False)
            return
        xs = x.index_select(0, self._index)
        delta = out.new_empty(self.num_rows, out.shape[1])
        for weights, start, end in self._segments:
            site_weights = weights[layer][site]
            if site_weights is None:
                delta[start:end].zero_()
            else:
                _add_update(delta[start:end], xs[start:end], site_weights, zero_uncovered=True)
        out.index_add_(0, self._index, delta)


def _add_update(rows: torch.Tensor, x: torch.Tensor, site: SiteWeights, *, zero_uncovered: bool) -> None:
    """rows += (x a) b, each target's columns from its share of x a; with `zero_uncovered`, `rows` is
    a fresh buffer written, not added to, and the columns of targets the adapter lacks are zeroed."""
    shrunk = torch.mm(x, site.a)
    rank = site.rank
    for index, (first, last, b) in enumerate(site.b):
        part = shrunk[:, index * rank : (index + 1) * rank]
        if zero_uncovered:
            torch.mm(part, b, out=rows[:, first:last])
        else:
            rows[:, first:last].addmm_(part, b)
    if zero_uncovered:
        for first, last in site.uncovered:
            rows[:, first:last].zero_()


def lora_step(
    seqs: Seq[Sequence],
    slots: AdapterSlots[Any, FusedLoraWeights],
    query_lens: np.ndarray,
    device: torch.device,
) -> LoraStep | None:
    """The step's adapter rows, or None when every sequence of the batch is the base's."""
    if not slots.has_holders:
        return None
    weights = [None if seq.adapter_id is None else slots.weights(seq.adapter_id) for seq in seqs]
    if all(w is None for w in weights):
        return None
    return LoraStep(weights, query_lens, device)
