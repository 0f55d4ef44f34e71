"""Structured outputs in the engine (docs/architecture.md, "Structured outputs"): a response_format
compiled once per schema, each constrained sequence's logits masked to its grammar inside the
continuous batch, and finished as soon as its value is whole. On the random demo model, which writes
anything it is allowed to: the grammar alone makes its output valid."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from serving.engine.demo_model import DemoModelSpec, build_demo_model
from serving.engine.engine import Engine, EngineConfig, RequestOutput
from serving.engine.grammar import GrammarCompiler, GrammarError
from serving.engine.grammar_mask import mask_logits
from serving.engine.sequence import FinishReason, SamplingParams, Sequence

DEMO_SPEC = DemoModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
# Nested, with every kind of bound, so that a completion always closes well within its max_tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "kind": {"enum": ["cat", "dog", 3]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "address"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
MAX_TOKENS = 160  # the schema's longest value is well under this many tokens


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only waits on the first
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo"), DEMO_SPEC)


def make_engine(model_dir: Path, **overrides: Any) -> Engine:
    fields: dict[str, Any] = {
        "kv_cache_bytes": 4 << 20,
        "device": "cpu",
        "max_num_seqs": 64,
        "max_num_batched_tokens": 256,
        "seed": 0,
        **overrides,
    }
    return Engine(model_dir, config=EngineConfig(**fields))


def run(engine: Engine, requests: dict[str, SamplingParams], prompt: str = "hello") -> dict[str, Any]:
    """Every request's text, finish reason, tokens and logprobs, checking the scheduler each step."""
    ids = engine.encode(prompt)
    for request_id, params in requests.items():
        engine.add_request(request_id, ids, params)
    results: dict[str, dict[str, Any]] = {r: {"text": "", "tokens": [], "logprobs": []} for r in requests}
    while engine.has_unfinished():
        outputs: list[RequestOutput] = engine.step()
        engine.scheduler.check_invariants()  # each matcher has consumed exactly its output tokens
        for out in outputs:
            result = results[out.request_id]
            result["text"] += out.new_text
            result["tokens"] += out.new_token_ids
            result["logprobs"] += out.logprobs or []
            if out.is_finished:
                result["finish_reason"] = out.finish_reason
    return results


def test_a_schema_compiles_once_and_its_key_ignores_key_order(demo_dir: Path) -> None:
    engine = make_engine(demo_dir)
    grammars = engine.grammars
    first = grammars.compile(RESPONSE_FORMAT)
    reordered = {"json_schema": {"schema": dict(reversed(list(SCHEMA.items()))), "name": "other"}}
    again = grammars.compile({**reordered, "type": "json_schema"})
    assert first is not None and again is first and grammars.num_compiled == 1
    assert grammars.compile({"type": "text"}) is None
    assert grammars.compile({"type": "json_object"}) is not None and grammars.num_compiled == 2
    with pytest.raises(GrammarError, match="uniqueItems"):
        grammars.compile(
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}
        )
    with pytest.raises(GrammarError, match=r"response_format\.type"):
        grammars.compile({"type": "yaml"})


def test_sampled_constrained_outputs_all_validate_and_stop_when_whole(demo_dir: Path) -> None:
    engine = make_engine(demo_dir)
    grammar = engine.grammars.compile(RESPONSE_FORMAT)
    requests = {
        f"s{seed}": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, grammar=grammar)
        for seed in range(48)
    }
    results = run(engine, requests)
    for request_id, result in results.items():
        assert result["finish_reason"] is FinishReason.STOP, (request_id, result["text"])
        jsonschema.validate(json.loads(result["text"]), SCHEMA)
    # Once whole, nothing follows: not even the end of sequence (no step is spent on it).
    assert all(len(r["tokens"]) < MAX_TOKENS for r in results.values())
    assert len({r["text"] for r in results.values()}) > 40  # seeds differ, and so do the outputs


def test_a_constrained_row_and_a_free_row_share_a_step_and_give_what_they_give_alone(
    demo_dir: Path,
) -> None:
    engine = make_engine(demo_dir)
    grammar = engine.grammars.compile(RESPONSE_FORMAT)
    constrained = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar)
    free = SamplingParams(max_tokens=24, temperature=0.0)
    alone_c = run(make_engine(demo_dir), {"c": constrained})["c"]
    alone_f = run(make_engine(demo_dir), {"f": free})["f"]
    together = run(engine, {"c": constrained, "f": free})
    assert together["c"]["tokens"] == alone_c["tokens"] and together["f"]["tokens"] == alone_f["tokens"]
    jsonschema.validate(json.loads(together["c"]["text"]), SCHEMA)
    assert together["f"]["finish_reason"] is FinishReason.LENGTH  # the free row rambles on, unmasked
    # Seeded and sampled too: a seeded row's draw is its own, whatever shares its batch.
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5, grammar=grammar)
    alone_s = run(make_engine(demo_dir), {"s": seeded})["s"]
    mixed = run(make_engine(demo_dir), {"s": seeded, "f": free, "g": constrained})
    assert mixed["s"]["tokens"] == alone_s["tokens"]


def test_a_preempted_constrained_sequence_keeps_its_place_in_the_grammar(demo_dir: Path) -> None:
    """Preemption recomputes a sequence's keys and values but keeps its tokens: its matcher, which has
    consumed them, stays where it is (run() checks that after every step)."""
    roomy = make_engine(demo_dir)
    grammar = roomy.grammars.compile(RESPONSE_FORMAT)
    requests = {
        f"s{seed}": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, grammar=grammar)
        for seed in range(6)
    }
    alone = run(roomy, requests)
    block_bytes = 2 * DEMO_SPEC.num_layers * 16 * DEMO_SPEC.num_kv_heads * 16 * 4  # head_dim 16, fp32
    tight = make_engine(demo_dir, kv_cache_bytes=16 * block_bytes, max_num_batched_tokens=64)
    tight_grammar = tight.grammars.compile(RESPONSE_FORMAT)
    tight_requests = {
        k: SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=p.seed, grammar=tight_grammar)
        for k, p in requests.items()
    }
    preempted = run(tight, tight_requests)
    assert tight.stats().num_preemptions > 0
    assert {k: r["tokens"] for k, r in preempted.items()} == {k: r["tokens"] for k, r in alone.items()}
    for result in preempted.values():
        jsonschema.validate(json.loads(result["text"]), SCHEMA)


def test_stop_strings_logprobs_and_json_object_work_under_a_grammar(demo_dir: Path) -> None:
    engine = make_engine(demo_dir)
    grammar = engine.grammars.compile(RESPONSE_FORMAT)
    any_object = engine.grammars.compile({"type": "json_object"})
    results = run(
        engine,
        {
            "stopped": SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar, stop=('"age"',)
            ),
            "logprobs": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=grammar, logprobs=2),
            **{
                f"object{seed}": SamplingParams(max_tokens=64, temperature=1.0, seed=seed, grammar=any_object)
                for seed in range(8)
            },
        },
    )
    stopped = results["stopped"]
    assert stopped["finish_reason"] is FinishReason.STOP and '"age"' not in stopped["text"]
    assert stopped["text"].startswith('{"name":"')
    logprobs = results["logprobs"]
    assert len(logprobs["logprobs"]) == len(logprobs["tokens"])
    assert all(entry.logprob <= 0 and len(entry.top) == 2 for entry in logprobs["logprobs"])
    objects = [results[f"object{seed}"] for seed in range(8)]
    for result in objects:  # whole ones parse; one cut short by max_tokens is an object's beginning
        if result["finish_reason"] is FinishReason.STOP:
            assert isinstance(json.loads(result["text"]), dict)
        else:
            assert result["finish_reason"] is FinishReason.LENGTH and result["text"].startswith("{")
    assert any(r["finish_reason"] is FinishReason.STOP for r in objects)


def test_the_masks_on_the_host_and_on_another_dtype_agree_and_a_dead_end_row_allows_eos(
    demo_dir: Path,
) -> None:
    """float32 on a CPU is masked through numpy; any other dtype or device through torch (a GPU's bf16):
    the two block the same tokens. A matcher stuck in an error state would allow nothing: its row
    allows its end of sequence instead, so that the sampler never draws from a row of -inf."""
    engine = make_engine(demo_dir)
    grammar = engine.grammars.compile(RESPONSE_FORMAT)
    params = SamplingParams(max_tokens=MAX_TOKENS, grammar=grammar)
    seqs = [Sequence(f"s{i}", [1], params) for i in range(3)]
    free = Sequence("free", [1], SamplingParams())
    opening = engine.encode('{"name":"')
    assert seqs[1].constraint is not None and seqs[2].constraint is not None
    for token_id in opening:
        assert seqs[1].constraint.advance(token_id)
    assert not seqs[2].constraint.advance(opening[-1] if opening[-1] != opening[0] else 5)  # not "{"
    vocab = engine.runner.vocab_size
    batch = [seqs[0], free, seqs[1], seqs[2]]
    on_host = mask_logits(torch.zeros(4, vocab), batch)
    through_torch = mask_logits(torch.zeros(4, vocab, dtype=torch.bfloat16), batch)
    assert torch.equal(on_host.isinf(), through_torch.isinf())
    assert not on_host[1].isinf().any()  # the free row is untouched
    assert 0 < int((~on_host[0].isinf()).sum()) < vocab and 0 < int((~on_host[2].isinf()).sum()) < vocab
    assert (~on_host[3].isinf()).nonzero().flatten().tolist() == list(grammar.eos_token_ids)


def test_a_tokenizer_llguidance_cannot_read_refuses_response_format_and_says_so() -> None:
    """A slow (Python) tokenizer has no Rust backend to read: each compile is a GrammarError (the
    request's 400), found once and kept; free text is served as ever."""

    class Slow:
        pass

    compiler = GrammarCompiler(Slow(), vocab_size=256, eos_ids=[])
    for _ in range(2):
        with pytest.raises(GrammarError, match="fast"):
            compiler.compile(RESPONSE_FORMAT)
    assert compiler.compile({"type": "text"}) is None
