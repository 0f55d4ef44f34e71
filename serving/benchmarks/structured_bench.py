"""`manage.py bench structured`: what structured outputs cost the engine (docs/benchmarks.md, "Structured
outputs"). One engine, one model, in this process.

Throughput: `--batch` sequences decode together, every step, for `--max-tokens` tokens each; in one
system none is constrained, in the other `--constrained-share` of them (half, by default) follow a JSON
schema. A round runs both, seconds apart, alternating which goes first; the figures are medians over
`--repeat` rounds, and the ratio constrained / none is the median of the rounds' own ratios (on a shared
machine the load moves between rounds more than within one).

So that every step holds the whole batch in both systems, the schema is a typical nested one (objects,
an array of objects, enums, bounded strings and numbers) whose array has `minItems` 1000: no constrained
row can finish its JSON before max_tokens, and the demo model has no end-of-sequence token, so no free
row ends early either. Each round also times, in the same steps, the masks (grammar_mask.mask_logits:
llguidance's bits for the constrained rows, unpacked and applied) and the matchers' advance: their share
of a constrained step is the grammars' own cost, whatever the machine's load does to the forward pass.

Compile time: a typical schema (the structured-output tests' nested one) compiled into a grammar for the
model's tokenizer by a fresh GrammarCompiler, the median of 20, and a cache hit; the edge's check of the
same schema (no tokenizer); and building llguidance's view of the tokenizer, once per replica.

The vocabulary sets the mask's cost. The demo tokenizer knows ~735 tokens; `--vocab 32000` (the default)
trains a byte-level BPE tokenizer of that size on the Python standard library's sources (seconds, once)
and builds the bench model's shapes around it, as a real model's vocabulary would be.

    manage.py bench structured --repeat 11 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Log = Callable[[str], None]

_ITEM = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "weight": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["label", "kind", "weight"],
    "additionalProperties": False,
}
# The throughput schema: no row can finish before max_tokens (the docstring says why).
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "items": {"type": "array", "items": _ITEM, "minItems": 1000},
    },
    "required": ["name", "owner", "items"],
    "additionalProperties": False,
}
# The compile-time schema: shaped as tests/serving/edge/test_structured_outputs.py's (its tags' items
# differ: _ITEM's).
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": _ITEM, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "address"],
    "additionalProperties": False,
}


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}


@dataclass(slots=True, frozen=True)
class RoundResult:
    tokens_per_s: float  # decode tokens over the decode steps' time (the first step, the prefill, left out)
    step_ms: float  # mean decode step
    mask_ms: float  # mean time in mask_logits per decode step
    advance_ms: float  # mean time advancing the matchers (Constraint.advance) per decode step

    @property
    def grammar_share(self) -> float:
        """The share of this run's steps spent on the grammars: masks and matchers."""
        return (self.mask_ms + self.advance_ms) / self.step_ms


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", help="a causal LM directory (default: the bench model, --vocab)")
    parser.add_argument(
        "--vocab",
        type=int,
        default=32000,
        help="the bench model's vocabulary: a BPE tokenizer of this size trained here (0: the demo's ~735)",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--constrained-share", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=11, help="rounds, alternating which system goes first")
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default (every core)")
    parser.add_argument("--seed", type=int, default=0)


def _stdlib_lines() -> Iterator[str]:
    """The standard library's top-level sources, line by line: a corpus large enough for 32k merges."""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        yield from path.read_text(errors="replace").splitlines()


def ensure_vocab_model(model_dir: Path, vocab_size: int, log: Log) -> Path:
    """The bench model's shapes with a byte-level BPE tokenizer of `vocab_size` tokens, built once."""
    if (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors")):
        return model_dir
    from serving.benchmarks.bench_model import BENCH_MODEL_SPEC
    from serving.engine.demo_model import build_demo_model, build_tokenizer

    log(f"training a {vocab_size}-token BPE tokenizer and building the bench model in {model_dir}")
    tokenizer = build_tokenizer(vocab_size, corpus=_stdlib_lines())
    return build_demo_model(model_dir, BENCH_MODEL_SPEC, tokenizer=tokenizer)


def _median_ms(fn: Callable[[], object], times: int) -> float:
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def run_round(engine: Any, grammar: Any, prompts: list[list[int]], options: dict[str, Any]) -> RoundResult:
    """One system: the whole batch added at once, stepped until every sequence is done."""
    import serving.engine.engine as engine_module
    from serving.engine.constraint import Constraint
    from serving.engine.grammar_mask import mask_logits
    from serving.engine.sequence import SamplingParams

    mask_s = advance_s = 0.0
    advance = Constraint.advance

    def timed_mask(logits: Any, seqs: Any) -> Any:
        nonlocal mask_s
        start = time.perf_counter()
        try:
            return mask_logits(logits, seqs)
        finally:
            mask_s += time.perf_counter() - start

    def timed_advance(self: Constraint, token_id: int) -> bool:
        nonlocal advance_s
        start = time.perf_counter()
        try:
            return advance(self, token_id)
        finally:
            advance_s += time.perf_counter() - start

    num_constrained = round(len(prompts) * float(options["constrained_share"])) if grammar else 0
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_tokens=int(options["max_tokens"]),
            temperature=1.0,
            seed=int(options["seed"]) + i,
            grammar=grammar if i < num_constrained else None,
        )
        engine.add_request(f"r{i}", prompt, params)
    # Timed where the engine calls them (this benchmark's own wrappers, put back afterwards).
    engine_module.mask_logits = timed_mask  # type: ignore[attr-defined]
    Constraint.advance = timed_advance  # type: ignore[method-assign]
    try:
        engine.step()  # every prompt's prefill
        mask_s = advance_s = 0.0
        tokens, steps, start = 0, 0, time.perf_counter()
        while engine.has_unfinished():
            tokens += sum(len(out.new_token_ids) for out in engine.step())
            steps += 1
        elapsed = time.perf_counter() - start
    finally:
        engine_module.mask_logits = mask_logits  # type: ignore[attr-defined]
        Constraint.advance = advance  # type: ignore[method-assign]
    return RoundResult(
        tokens / elapsed, elapsed / steps * 1000, mask_s / steps * 1000, advance_s / steps * 1000
    )


def run_structured_from_options(options: dict[str, Any], *, default_model_dir: Path, log: Log = print) -> str:
    import os

    import torch

    from serving.benchmarks.bench_model import ensure_bench_model
    from serving.edge.response_format import compile_error
    from serving.engine.engine import Engine, EngineConfig
    from serving.engine.grammar import GrammarCompiler

    batch, vocab = int(options["batch"]), int(options["vocab"])
    if batch < 1 or int(options["max_tokens"]) < 2 or int(options["repeat"]) < 1:
        raise ValueError("--batch >= 1, --max-tokens >= 2 and --repeat >= 1")
    if not 0 < float(options["constrained_share"]) <= 1:
        raise ValueError("--constrained-share must be in (0, 1]")
    if int(options["torch_threads"]):
        torch.set_num_threads(int(options["torch_threads"]))
    if options.get("model_dir"):
        model_dir = Path(options["model_dir"])
    elif vocab:
        model_dir = ensure_vocab_model(default_model_dir.parent / f"bench-model-vocab{vocab}", vocab, log)
    else:
        model_dir = ensure_bench_model(default_model_dir, log=log)
    engine = Engine(
        model_dir,
        config=EngineConfig(
            max_num_seqs=batch, max_num_batched_tokens=max(512, batch * 32), device="cpu", seed=0
        ),
    )
    engine.warmup()
    text = "Write the inventory as JSON: every item with its label, kind, weight and count."
    base = engine.encode(text)
    prompts = [base[: 8 + i % 8] for i in range(batch)]  # 8-15 tokens: prefixes of one text
    grammar = engine.grammars.compile(_format(LONG_SCHEMA))

    systems = {"none": None, "constrained": grammar}
    rounds: dict[str, list[RoundResult]] = {name: [] for name in systems}
    for index in range(int(options["repeat"])):
        order = list(systems) if index % 2 == 0 else list(systems)[::-1]
        for name in order:
            result = run_round(engine, systems[name], prompts, options)
            rounds[name].append(result)
            log(
                f"round {index + 1} {name}: {result.tokens_per_s:.1f} tokens/s, "
                f"step {result.step_ms:.2f} ms, mask {result.mask_ms:.3f} ms, "
                f"matchers {result.advance_ms:.3f} ms"
            )

    # Compile times: a fresh compiler each time (no cache), then a cache hit; the tokenizer's view once.
    vocab_size, eos = engine.runner.vocab_size, engine.grammars.eos_token_ids
    tokenizer_ms = _median_ms(
        lambda: GrammarCompiler(engine.tokenizer, vocab_size=vocab_size, eos_ids=eos).tokenizer(), 3
    )
    uncached = GrammarCompiler(engine.tokenizer, vocab_size=vocab_size, eos_ids=eos, cache_size=0)
    uncached.tokenizer()  # built once, before the timing: only the grammar is timed
    compile_ms = _median_ms(lambda: uncached.compile(_format(TYPICAL_SCHEMA)), 20)
    hit_ms = _median_ms(lambda: engine.grammars.compile(_format(TYPICAL_SCHEMA)), 20)
    compact = json.dumps(TYPICAL_SCHEMA, sort_keys=True, separators=(",", ":"))
    edge_ms = _median_ms(lambda: compile_error.__wrapped__(compact), 20)

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in rounds[name])

    ratios = [
        c.tokens_per_s / n.tokens_per_s for n, c in zip(rounds["none"], rounds["constrained"], strict=True)
    ]
    per_round = ", ".join(f"{r:.3f}" for r in ratios)
    num_constrained = round(batch * float(options["constrained_share"]))
    lines = [
        f"Switchyard structured-output benchmark: {model_dir} (vocabulary {vocab_size}), "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs",
        f"batch {batch} decoding {options['max_tokens']} tokens each at temperature 1; constrained: "
        f"{num_constrained} of them to a nested JSON schema; {options['repeat']} rounds, the order "
        "alternating; medians over the rounds",
        "",
        f"{'system':<14}{'tokens/s':>10}{'step ms':>10}{'mask ms/step':>14}{'matchers ms/step':>18}",
    ]
    for name in systems:
        lines.append(
            f"{name:<14}{median(name, 'tokens_per_s'):>10.1f}{median(name, 'step_ms'):>10.2f}"
            f"{median(name, 'mask_ms'):>14.3f}{median(name, 'advance_ms'):>18.3f}"
        )
    share = statistics.median(r.grammar_share for r in rounds["constrained"])
    lines += [
        # The median of the rounds' own ratios: each round's two runs are seconds apart, so a shared
        # machine's load moves both; the medians of each column can come from different rounds.
        f"constrained / none: throughput x{statistics.median(ratios):.3f}, the median of the rounds' "
        f"(per round {per_round})",
        f"the grammars' own share of a constrained step (masks and matchers, timed in the same steps): "
        f"{100 * share:.2f}%",
        "",
        f"compile, typical nested schema ({len(compact)} bytes): {compile_ms:.2f} ms for the model's "
        f"tokenizer (median of 20), {hit_ms * 1000:.1f} us from the cache; the edge's check "
        f"{edge_ms:.2f} ms; llguidance's view of the tokenizer {tokenizer_ms:.0f} ms, once per replica",
    ]
    return "\n".join(lines) + "\n"
