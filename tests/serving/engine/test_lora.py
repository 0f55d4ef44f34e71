"""LoRA adapters served by the engine (serving/engine/lora*.py): greedy output with an adapter equals
transformers' generate on peft's merged model; a batch mixing the base and four adapters gives each row
what it gives alone; adapters beyond max_loras are evicted least recently used first and still give the
right output; a request whose adapter finds every slot held waits, and cannot starve; base and adapter
never share prefix-cache blocks; what the engine can never serve is refused at add_request."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.demo_model import DemoModelSpec, build_demo_model
from serving.engine.engine import Engine, EngineConfig
from serving.engine.lora import LoraAdapter, read_adapter
from serving.engine.sequence import SamplingParams
from tests.serving.engine.lora_models import AdapterSpec, MergedReference, greedy, load_base

DEMO_SPEC = DemoModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
SPECS = (
    AdapterSpec("all-r4", rank=4, seed=1),
    AdapterSpec("qv-r8", rank=8, targets=("q_proj", "v_proj"), alpha=32, seed=2),
    AdapterSpec("mlp-r2-rslora", rank=2, targets=("gate_proj", "up_proj", "down_proj"), rslora=True, seed=3),
    AdapterSpec("attn-r4", rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj"), alpha=8, seed=4),
    AdapterSpec("ko-down-r3", rank=3, targets=("k_proj", "o_proj", "down_proj"), seed=5),
)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread's barrier only slows them on busy cores
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("lora_base"), DEMO_SPEC)


@dataclass
class Served:
    adapter: LoraAdapter
    reference: MergedReference


@pytest.fixture(scope="module")
def served(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Served]:
    config = load_base(base_dir).config
    out: dict[str, Served] = {}
    for spec in SPECS:
        adapter_dir = tmp_path_factory.mktemp(spec.name)
        reference = MergedReference(base_dir, spec, adapter_dir)
        out[spec.name] = Served(read_adapter(adapter_dir, spec.name, config), reference)
    return out


@pytest.fixture(scope="module")
def base_model(base_dir: Path) -> Any:
    return load_base(base_dir)


def make_engine(base_dir: Path, **overrides: Any) -> Engine:
    fields: dict[str, Any] = {
        "kv_cache_bytes": 1 << 20,
        "device": "cpu",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 48,  # long prompts are prefilled in chunks beside decodes
        "pack_linear": False,
        "seed": 0,
        **overrides,
    }
    return Engine(base_dir, config=EngineConfig(**fields))


def prompt(length: int, start: int) -> list[int]:
    return [1, *((start * 37 + 11 * i) % 500 + 3 for i in range(length - 1))]


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    adapter: LoraAdapter | None = None
    step: int = 0
    tenant_id: str = "t"


def run(engine: Engine, requests: list[Request], max_steps: int = 500) -> dict[str, list[int]]:
    pending = sorted(requests, key=lambda r: r.step)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].step <= step:
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(r.request_id, r.prompt, params, adapter=r.adapter, tenant_id=r.tenant_id)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.scheduler.check_invariants()
        engine.adapters.check_invariants()
        step += 1
        assert step < max_steps, "no progress"
    return tokens


def expected(request: Request, served: dict[str, Served], base_model: Any) -> list[int]:
    if request.adapter is None:
        return greedy(base_model, request.prompt, request.max_tokens)
    return served[request.adapter.adapter_id].reference.greedy(request.prompt, request.max_tokens)


def test_greedy_with_an_adapter_equals_generate_on_the_merged_model(
    base_dir: Path, served: dict[str, Served], base_model: Any
) -> None:
    engine = make_engine(base_dir)
    for index, spec in enumerate(SPECS):
        request = Request(f"r{index}", prompt(20 + 7 * index, index), 10, served[spec.name].adapter)
        got = run(engine, [request])[request.request_id]
        assert got == expected(request, served, base_model), spec.name
        assert got != greedy(base_model, request.prompt, request.max_tokens), f"{spec.name} changes nothing"


def test_a_batch_mixing_the_base_and_four_adapters_gives_each_row_what_it_gives_alone(
    base_dir: Path, served: dict[str, Served], base_model: Any
) -> None:
    adapters: list[LoraAdapter | None] = [None, *(served[s.name].adapter for s in SPECS[:4])]
    requests = [
        Request(f"m{i}", prompt(9 + 13 * i, 40 + i), 8 + i % 3, adapters[i % 5], step=i // 3)
        for i in range(10)
    ]
    engine = make_engine(base_dir)
    mixed = run(engine, requests)
    assert engine.stats().num_adapter_loads == 4
    for request in requests:
        alone = run(
            make_engine(base_dir),
            [Request(request.request_id, request.prompt, request.max_tokens, request.adapter)],
        )
        assert mixed[request.request_id] == alone[request.request_id], request.request_id
        assert mixed[request.request_id] == expected(request, served, base_model), request.request_id


def test_adapters_beyond_max_loras_are_evicted_least_recently_used_first_and_stay_right(
    base_dir: Path, served: dict[str, Served], base_model: Any
) -> None:
    engine = make_engine(base_dir, max_loras=2)
    names = [s.name for s in SPECS]
    order = [names[0], names[1], names[0], names[2], names[3], names[0]]
    for index, name in enumerate(order):
        request = Request(f"e{index}", prompt(12 + index, 70 + index), 5, served[name].adapter)
        assert run(engine, [request])[request.request_id] == expected(request, served, base_model), name
    stats = engine.stats()
    # name0, name1 loaded; name0 reused; name2 evicts name1 (least recent); name3 evicts name0; name0
    # evicts name2.
    assert stats.num_adapter_loads == 5
    assert stats.num_adapter_evictions == 3
    assert stats.adapters_resident == (names[3], names[0])
    # Concurrent: four adapters through two slots, mixed with the base.
    requests = [
        Request(f"c{i}", prompt(10 + 5 * i, 90 + i), 6, None if i == 4 else served[names[i]].adapter)
        for i in range(5)
    ]
    tokens = run(engine, requests)
    for request in requests:
        assert tokens[request.request_id] == expected(request, served, base_model), request.request_id


def test_an_adapter_waits_for_a_held_slot_and_does_not_starve(
    base_dir: Path, served: dict[str, Served], base_model: Any
) -> None:
    engine = make_engine(base_dir, max_loras=1)
    first, second = served[SPECS[0].name].adapter, served[SPECS[1].name].adapter
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("a1", prompt(10, 1), params, adapter=first)
    engine.step()
    engine.add_request("b", prompt(11, 2), params, adapter=second)
    engine.add_request("a2", prompt(12, 3), params, adapter=first)
    engine.add_request("base", prompt(13, 4), params, tenant_id="other")
    outputs = engine.step()
    running = {seq.request_id for seq in engine.scheduler.running_seqs()}
    # b waits for the slot a1 holds (and its tenant's queue behind it, a2 among them: a FIFO per tenant
    # and tier); another tenant's base request runs.
    assert running == {"a1", "base"}, running
    assert {out.request_id for out in outputs} == {"a1", "base"}
    engine.add_request("a3", prompt(9, 5), params, adapter=first, tenant_id="third")
    engine.step()
    # Of another tenant, and of the resident adapter: it waits too, so that the held slot drains for b.
    assert "a3" not in {seq.request_id for seq in engine.scheduler.running_seqs()}
    finished_at: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.is_finished:
                finished_at[out.request_id] = step
        step += 1
        assert step < 100
    assert finished_at["b"] < min(finished_at["a2"], finished_at["a3"])
    assert engine.stats().num_adapter_loads == 3  # first, second, first again


def test_base_and_adapter_never_share_prefix_cache_blocks(
    base_dir: Path, served: dict[str, Served], base_model: Any
) -> None:
    engine = make_engine(base_dir)
    adapter = served[SPECS[0].name].adapter
    shared = prompt(40, 7)  # two full blocks of 16 and more
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cached: dict[str, int] = {}
    for request_id, with_adapter in (("base1", None), ("ad1", adapter), ("ad2", adapter), ("base2", None)):
        engine.add_request(request_id, shared, params, adapter=with_adapter)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                if out.is_finished:
                    cached[request_id] = out.num_cached_prompt_tokens
        request = Request(request_id, shared, 4, with_adapter)
        assert tokens == expected(request, served, base_model), request_id
    assert cached == {"base1": 0, "ad1": 0, "ad2": 32, "base2": 32}


def test_what_the_engine_can_never_serve_is_refused_at_add_request(
    base_dir: Path, served: dict[str, Served]
) -> None:
    params = SamplingParams(max_tokens=4)
    engine = make_engine(base_dir, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8, over this engine's limit of 4"):
        engine.add_request("r", prompt(8, 0), params, adapter=served["qv-r8"].adapter)
    assert not engine.has_unfinished() and engine.stats().num_adapter_loads == 0
    generic = make_engine(base_dir, forward="generic")
    with pytest.raises(ValueError, match="fused Llama forward only"):
        generic.add_request("r", prompt(8, 0), params, adapter=served["all-r4"].adapter)
    assert not generic.has_unfinished()
    generic.add_request("base", prompt(8, 0), params)  # the base is served as ever
    assert generic.has_unfinished()


def test_base_only_steps_build_no_lora_step(base_dir: Path, served: dict[str, Served]) -> None:
    engine = make_engine(base_dir)
    calls: list[object] = []
    execute = engine.runner.execute

    def spy(batch: Any, lora: Any = None) -> torch.Tensor:
        calls.append(lora)
        return execute(batch, lora)

    engine.runner.execute = spy  # type: ignore[method-assign]
    run(engine, [Request("b", prompt(10, 0), 3)])
    assert calls and all(lora is None for lora in calls)
    calls.clear()
    run(engine, [Request("a", prompt(10, 0), 3, served["all-r4"].adapter), Request("b2", prompt(9, 1), 3)])
    assert calls and all(lora is not None for lora in calls)


def test_with_two_threads_the_updates_run_on_one_and_the_forward_gets_both_back(
    base_dir: Path, served: dict[str, Served], base_model: Any
) -> None:
    """The updates' small products run on one thread (lora_batch.py: on two they took twice as long);
    the base's products after them must still get every thread, and the answers stay the merged model's."""
    torch.set_num_threads(2)
    try:
        seen: list[int] = []
        engine = make_engine(base_dir)
        execute = engine.runner.execute

        def counting(batch: Any, lora: Any = None) -> Any:
            logits = execute(batch, lora)
            seen.append(torch.get_num_threads())
            return logits

        engine.runner.execute = counting  # type: ignore[method-assign]
        adapters: list[LoraAdapter | None] = [None, *(served[s.name].adapter for s in SPECS[:2])]
        requests = [Request(f"t{i}", prompt(12 + 5 * i, 70 + i), 6, adapters[i % 3]) for i in range(6)]
        got = run(engine, requests)
        assert seen and set(seen) == {2}
        for request in requests:
            assert got[request.request_id] == expected(request, served, base_model), request.request_id
    finally:
        torch.set_num_threads(1)
