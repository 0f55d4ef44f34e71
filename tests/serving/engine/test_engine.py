"""Engine end to end on real transformers models: greedy output equals model.generate token for token
(staggered arrivals, chunked prefill, preemption, shared prefixes), seeded sampling reproduces, abort
frees blocks, bad input is refused with nothing allocated, stop strings and finish reasons, KV stats.

Two models: a tiny random demo Llama built here (GQA, byte-level BPE tokenizer) and the pretrained
stories260k (skipped when absent). Engines are pinned to CPU fp32 so that greedy comparisons with an
fp32 `generate` test the engine, not bf16 rounding."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.demo_model import DemoModelSpec, build_demo_model
from serving.engine.engine import Engine, EngineConfig, EngineStats, RequestOutput
from serving.engine.half_blocks import TailCopy, half_of, is_half
from serving.engine.loading import load_tokenizer
from serving.engine.sequence import SamplingParams
from serving.engine.token_bytes import token_bytes_reader

BLOCK_SIZE = 16
DEMO_SPEC = DemoModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
BOS = 1  # both models' BOS id
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her "
    "big red ball. One day, her friend Tom came to visit. Tom had a small dog named Max. Max liked to run "
    "and jump and bark at the birds. Lily and Tom played with the ball in the park all day long. When the "
    "sun went down, Lily's mom called them inside for dinner. They ate soup and bread and drank warm milk. "
    'After dinner, Lily said, "Thank you, Mom! Today was the best day ever." Her mom smiled and gave her '
    "a big hug. Then Lily went to bed and dreamed of balls, dogs and birds that could sing."
)


def greedy(max_tokens: int, **overrides: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **overrides)


# --- models and references ------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """These models are tiny: a second intra-op thread buys nothing, and on busy cores its barrier
    waits made this file 5x slower (measured 40 s against 8 s)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo"), DEMO_SPEC)


@pytest.fixture(scope="module", params=["demo", "stories260k"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue("demo_dir" if request.param == "demo" else "stories_dir")
    return path


class Reference:
    """The plain transformers model (SDPA attention) and its tokenizer; generate() results memoised."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        from serving.engine.loading import MODEL_LOAD_LOCK

        self.model_dir = model_dir
        with MODEL_LOAD_LOCK:  # as every load in the process does
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, attn_implementation="sdpa", use_safetensors=True, dtype=torch.float32
            ).eval()
        self.tokenizer = load_tokenizer(model_dir)
        # Prompts are slices of real text, so the pretrained model sees something it can continue.
        self.text_ids: list[int] = list(self.tokenizer(STORY, add_special_tokens=False)["input_ids"])
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.bytes_per_block = (
            2 * config.num_hidden_layers * BLOCK_SIZE * config.num_key_value_heads * head_dim * 4
        )
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids: list[int] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def prompt(self, length: int, *, start: int = 0) -> list[int]:
        """BOS then `length - 1` tokens of the story from `start` (wrapping round)."""
        ids = self.text_ids
        return [BOS, *(ids[(start + i) % len(ids)] for i in range(length - 1))]

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._greedy:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            self._greedy[key] = out[0, len(prompt) :].tolist()
        return self._greedy[key]

    def output_text(self, prompt: list[int], output_ids: list[int]) -> str:
        """The text output_ids add after the prompt, as a whole-sequence decode spells it."""
        decode = self.tokenizer.decode
        before = decode(prompt, skip_special_tokens=True)
        after = decode(prompt + output_ids, skip_special_tokens=True)
        assert after.startswith(before)
        return str(after[len(before) :])


_references: dict[Path, Reference] = {}


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> Reference:
    if model_dir not in _references:
        _references[model_dir] = Reference(model_dir)
    return _references[model_dir]


@pytest.fixture(scope="module")
def demo_ref(demo_dir: Path) -> Reference:
    if demo_dir not in _references:
        _references[demo_dir] = Reference(demo_dir)
    return _references[demo_dir]


def make_engine(model_dir: Path, **overrides: Any) -> Engine:
    fields: dict[str, Any] = {
        "kv_cache_bytes": 1 << 20,
        "device": "cpu",
        "block_size": BLOCK_SIZE,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "seed": 0,
        **overrides,
    }
    return Engine(model_dir, config=EngineConfig(**fields))


# --- driving an engine ----------------------------------------------------------------------------


@dataclass
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    tenant_id: str = "default"
    cache_group: str | None = None


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]


def collect(results: dict[str, Result], outputs: list[RequestOutput]) -> None:
    for out in outputs:
        result = results.setdefault(out.request_id, Result())
        assert not (result.outputs and result.final.is_finished), f"{out.request_id}: output after finish"
        result.outputs.append(out)
        result.token_ids += out.new_token_ids
        result.text += out.new_text
        assert out.num_output_tokens == len(result.token_ids)
        assert (out.finish_reason is not None) == out.is_finished


def run(
    engine: Engine,
    arrivals: list[Arrival],
    *,
    after_step: Callable[[Engine], None] | None = None,
    results: dict[str, Result] | None = None,
    max_steps: int = 2000,
) -> dict[str, Result]:
    """Add each request at its step, step until all finish; every request must finish exactly once.
    `results` names requests already in the engine (with what was collected so far); they are driven too."""
    pending = sorted(arrivals, key=lambda a: a.step)
    results = {} if results is None else results
    expected_ids = {*results, *(a.request_id for a in arrivals)}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(
                a.request_id, a.prompt, a.params, tenant_id=a.tenant_id, cache_group=a.cache_group
            )
        collect(results, engine.step())
        if after_step is not None:
            after_step(engine)
        step += 1
        assert step < max_steps, "the engine made no progress"
    assert set(results) == expected_ids
    for a in arrivals:
        final = results[a.request_id].final
        assert final.is_finished
        assert final.num_prompt_tokens == len(a.prompt)
        assert final.first_token_time is not None and final.finished_time is not None
        assert final.arrival_time <= final.first_token_time <= final.finished_time
    return results


def assert_greedy_matches(ref: Reference, arrivals: list[Arrival], results: dict[str, Result]) -> None:
    for a in arrivals:
        expected = ref.greedy(a.prompt, a.params.max_tokens)
        got = results[a.request_id].token_ids
        assert got == expected, f"{a.request_id}: engine {got} != generate {expected}"
        reason = "stop" if expected[-1] in ref.eos_token_ids else "length"
        assert results[a.request_id].final.finish_reason == reason, a.request_id


def kv_snapshot(engine: Engine) -> tuple[float, int, int, int]:
    stats = engine.stats()
    return (stats.kv_cache_usage, engine.kv_cache.num_free_blocks, stats.num_running, stats.num_waiting)


# --- 1-3: greedy equals generate ------------------------------------------------------------------


def staggered_arrivals(ref: Reference) -> list[Arrival]:
    """Mixed lengths (1 token, block-exact, block + 1, several blocks) arriving at steps 0, 2, 5, 9."""
    spec = [  # step, prompt length, start in the story, max_tokens
        (0, 3, 0, 14),
        (0, 16, 7, 9),
        (0, 17, 30, 12),
        (0, 45, 11, 8),
        (2, 40, 50, 10),
        (2, 1, 0, 11),
        (5, 33, 90, 9),
        (5, 9, 120, 13),
        (9, 28, 140, 7),
    ]
    return [
        Arrival(step, f"r{i}-len{n}", ref.prompt(n, start=start), greedy(max_tokens))
        for i, (step, n, start, max_tokens) in enumerate(spec)
    ]


def test_greedy_equals_generate_with_staggered_arrivals_and_chunked_prefill(
    model_dir: Path, ref: Reference
) -> None:
    budget = 16  # the 33-, 40- and 45-token prompts take several steps each
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    steps: list[EngineStats] = []
    arrivals = staggered_arrivals(ref)
    results = run(engine, arrivals, after_step=lambda e: steps.append(e.stats()))

    assert_greedy_matches(ref, arrivals, results)
    assert all(s.num_batched_tokens <= budget for s in steps)
    assert max(s.num_scheduled_seqs for s in steps) >= 4, "requests were batched together"
    assert engine.stats().num_preemptions == 0


def test_greedy_equals_generate_under_preemption(model_dir: Path, ref: Reference) -> None:
    num_blocks = 7  # each request alone needs 3-4 blocks; three running need 9 or more
    engine = make_engine(
        model_dir, kv_cache_bytes=num_blocks * ref.bytes_per_block, max_num_batched_tokens=32
    )
    assert engine.kv_cache.num_blocks == num_blocks
    arrivals = [
        Arrival(0, "a", ref.prompt(20, start=0), greedy(28)),
        Arrival(0, "b", ref.prompt(12, start=40), greedy(30)),
        Arrival(1, "c", ref.prompt(25, start=80), greedy(24)),
        Arrival(3, "d", ref.prompt(6, start=120), greedy(36)),
        Arrival(4, "e", ref.prompt(30, start=150), greedy(20)),
    ]

    def check(e: Engine) -> None:
        e.scheduler.check_invariants()

    results = run(engine, arrivals, after_step=check)

    assert engine.stats().num_preemptions > 0
    assert_greedy_matches(ref, arrivals, results)
    assert engine.stats().kv_cache_usage == 0.0


def test_greedy_equals_generate_as_tails_share_blocks_and_move_out_of_them(
    model_dir: Path, ref: Reference
) -> None:
    """Tails of up to half a block share blocks (half_blocks.py); a tail that outgrows its half moves
    into a whole block, copied before the step reads it, or takes its block's free other half. Every
    token still equals generate()'s."""
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    assert engine.kv_cache.half_block_tails
    moves: list[TailCopy] = []
    take_copies = engine.kv_cache.take_copies

    def recorded() -> list[TailCopy]:
        copies = take_copies()
        moves.extend(copies)
        return copies

    engine.kv_cache.take_copies = recorded  # type: ignore[method-assign]
    num_shared = 0

    def check(e: Engine) -> None:
        nonlocal num_shared
        halves = [
            half_of(seq.block_table[-1]) for seq in e.scheduler.running_seqs() if is_half(seq.block_table[-1])
        ]
        num_shared += len(halves) - len({block for block, _ in halves})
        e.scheduler.check_invariants()

    arrivals = staggered_arrivals(ref)
    results = run(engine, arrivals, after_step=check)

    assert num_shared > 0, "two tails shared a block"
    assert moves, "a tail moved out of its half"
    assert_greedy_matches(ref, arrivals, results)


def test_seeded_sampling_survives_preemption(model_dir: Path, ref: Reference) -> None:
    """A preempted request recomputes its tokens, but never redraws them: the seeded output matches
    the same request run alone."""
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    prompt = ref.prompt(10, start=70)
    alone = run(make_engine(model_dir), [Arrival(0, "s", prompt, params)])["s"].token_ids
    engine = make_engine(model_dir, kv_cache_bytes=6 * ref.bytes_per_block, max_num_batched_tokens=32)
    arrivals = [
        Arrival(0, "g1", ref.prompt(14, start=0), greedy(40, ignore_eos=True)),
        Arrival(0, "s", prompt, params),
        Arrival(1, "g2", ref.prompt(20, start=30), greedy(30, ignore_eos=True)),
    ]
    results = run(engine, arrivals)
    assert engine.stats().num_preemptions > 0
    assert results["s"].token_ids == alone


def test_cached_prompt_tokens_never_exceed_the_prompt_after_preemption(
    demo_dir: Path, demo_ref: Reference
) -> None:
    engine = make_engine(demo_dir, kv_cache_bytes=5 * demo_ref.bytes_per_block, max_num_batched_tokens=32)
    arrivals = [
        Arrival(0, "a", demo_ref.prompt(2, start=0), greedy(60)),
        Arrival(0, "b", demo_ref.prompt(2, start=50), greedy(60)),
    ]
    results = run(engine, arrivals)
    assert engine.stats().num_preemptions > 0
    assert_greedy_matches(demo_ref, arrivals, results)
    for a in arrivals:
        # A 2-token prompt has no full block, so nothing of it can come from the prefix cache.
        cached = [o.num_cached_prompt_tokens for o in results[a.request_id].outputs]
        assert cached == [0] * len(cached), a.request_id


def test_shared_prefix_hits_the_cache_within_a_tenant_only(model_dir: Path, ref: Reference) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=32)
    base = ref.prompt(40, start=3)  # blocks 0 and 1 are full prompt blocks
    tail = ref.prompt(12, start=170)[1:]
    shared = [*base[:35], *tail]  # 2 full blocks in common with base, then a different third block

    first = run(engine, [Arrival(0, "owner", base, greedy(10), tenant_id="acme")])
    assert first["owner"].final.num_cached_prompt_tokens == 0

    # After the owner finished: the same tenant reuses its 2 full blocks; another tenant does not.
    after = [
        Arrival(0, "acme-after", shared, greedy(12), tenant_id="acme"),
        Arrival(0, "globex-same-prompt", shared, greedy(12), tenant_id="globex"),
    ]
    results = run(engine, after)
    assert results["acme-after"].final.num_cached_prompt_tokens == 2 * BLOCK_SIZE
    assert results["globex-same-prompt"].final.num_cached_prompt_tokens == 0
    assert_greedy_matches(ref, after, results)

    # While its owner is still running (prompt computed, still decoding).
    other = ref.prompt(50, start=60)
    engine.add_request("runner", other, greedy(30), tenant_id="acme")
    live: dict[str, Result] = {}
    while not live.get("runner", Result()).token_ids:
        collect(live, engine.step())
    assert engine.scheduler.get("runner") is not None, "the owner is still running"
    rider = [*other[:40], *ref.prompt(9, start=200)[1:]]
    engine.add_request("rider", rider, greedy(12), tenant_id="acme")
    engine.add_request("rider-other-tenant", rider, greedy(12), tenant_id="initech")
    while engine.has_unfinished():
        collect(live, engine.step())
    assert live["rider"].final.num_cached_prompt_tokens == 2 * BLOCK_SIZE
    assert live["rider-other-tenant"].final.num_cached_prompt_tokens == 0
    for request_id, prompt, max_tokens in [("runner", other, 30), ("rider", rider, 12)]:
        assert live[request_id].token_ids == ref.greedy(prompt, max_tokens), request_id

    # Tenants that opt into one cache group share prefixes with each other, and only with each other.
    grouped = ref.prompt(36, start=100)
    run(engine, [Arrival(0, "g-a", grouped, greedy(4), tenant_id="a", cache_group="consortium")])
    group_results = run(
        engine,
        [
            Arrival(0, "g-b", grouped, greedy(6), tenant_id="b", cache_group="consortium"),
            Arrival(0, "g-c", grouped, greedy(6), tenant_id="a"),  # tenant a outside the group
        ],
    )
    assert group_results["g-b"].final.num_cached_prompt_tokens == 2 * BLOCK_SIZE
    assert group_results["g-c"].final.num_cached_prompt_tokens == 0
    assert group_results["g-b"].token_ids == ref.greedy(grouped, 6)
    assert engine.stats().prefix_cache_hit_rate > 0

    # An identical block-exact prompt: the last block is recomputed, since its last token gives logits.
    exact = ref.prompt(3 * BLOCK_SIZE, start=130)
    run(engine, [Arrival(0, "exact-1", exact, greedy(5), tenant_id="acme")])
    repeat = run(engine, [Arrival(0, "exact-2", exact, greedy(5), tenant_id="acme")])["exact-2"]
    assert repeat.final.num_cached_prompt_tokens == 2 * BLOCK_SIZE
    assert repeat.token_ids == ref.greedy(exact, 5)


def test_shared_prefix_with_an_owner_mid_prefill_and_identical_twins(model_dir: Path, ref: Reference) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    owner = ref.prompt(70, start=20)
    rider = [*owner[:50], *ref.prompt(8, start=180)[1:]]
    twin = ref.prompt(37, start=140)
    engine.add_request("owner", owner, greedy(8))
    results = {"owner": Result()}
    for _ in range(2):  # 32 of its 70 prompt tokens computed: two full blocks
        collect(results, engine.step())
    assert engine.scheduler.get("owner").num_computed_tokens == 32  # type: ignore[union-attr]
    arrivals = [
        Arrival(0, "rider", rider, greedy(9)),
        Arrival(0, "twin-1", twin, greedy(7)),
        Arrival(0, "twin-2", twin, greedy(7)),
    ]
    run(engine, arrivals, after_step=lambda e: e.scheduler.check_invariants(), results=results)
    assert results["rider"].final.num_cached_prompt_tokens >= 2 * BLOCK_SIZE
    assert results["owner"].token_ids == ref.greedy(owner, 8)
    assert_greedy_matches(ref, arrivals, results)


def test_prefix_caching_can_be_disabled(model_dir: Path, ref: Reference) -> None:
    engine = make_engine(model_dir, enable_prefix_caching=False)
    prompt = ref.prompt(40, start=3)
    run(engine, [Arrival(0, "first", prompt, greedy(6))])
    again = run(engine, [Arrival(0, "again", prompt, greedy(6))])["again"]
    assert again.final.num_cached_prompt_tokens == 0
    assert again.token_ids == ref.greedy(prompt, 6)
    assert engine.stats().prefix_cache_hit_rate == 0.0


# --- 4: seeded sampling ---------------------------------------------------------------------------


def test_seeded_sampling_reproduces_across_engines_runs_and_batches(model_dir: Path, ref: Reference) -> None:
    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True)

    prompt = ref.prompt(21, start=5)
    alone = make_engine(model_dir, seed=1)
    first = run(alone, [Arrival(0, "s", prompt, sampled(7))])["s"].token_ids
    # The same engine again: the prompt now comes from the prefix cache.
    again = run(alone, [Arrival(0, "s-again", prompt, sampled(7))])["s-again"]
    assert again.final.num_cached_prompt_tokens > 0
    assert again.token_ids == first

    # Another engine, another shared-sampler seed, a chunked budget, and company arriving around it.
    crowded = make_engine(model_dir, seed=2, max_num_batched_tokens=16)
    company = [
        Arrival(0, "greedy", ref.prompt(30, start=60), greedy(20)),
        Arrival(0, "unseeded", ref.prompt(14, start=90), SamplingParams(max_tokens=30, temperature=1.0)),
        Arrival(1, "s", prompt, sampled(7)),
        Arrival(2, "other-seed", prompt, sampled(8)),
        Arrival(3, "seeded-neighbour", ref.prompt(40, start=110), sampled(7)),
    ]
    results = run(crowded, company)
    assert results["s"].token_ids == first
    assert len(first) == 24
    assert results["other-seed"].token_ids != first
    assert len(set(first)) > 3, "sampling, not a constant"


def test_logprobs_are_the_models_own_for_each_token_sampled_or_not(model_dir: Path, ref: Reference) -> None:
    """Each output token's log probability and its top alternatives, as log_softmax of the plain model's
    logits at that position gives them (before temperature), in a batch with requests that ask none."""
    prompt = ref.prompt(19, start=3)
    sampled = SamplingParams(max_tokens=12, temperature=1.3, seed=5, ignore_eos=True, logprobs=3)
    arrivals = [
        Arrival(0, "greedy", prompt, greedy(12, logprobs=0)),
        Arrival(0, "sampled", prompt, sampled),
        Arrival(1, "none", ref.prompt(25, start=40), greedy(8)),
    ]
    results = run(make_engine(model_dir, max_num_batched_tokens=16), arrivals)
    assert all(out.logprobs is None for out in results["none"].outputs)
    for request_id, k in (("greedy", 0), ("sampled", 3)):
        result = results[request_id]
        entries = [e for out in result.outputs for e in (out.logprobs or [])]
        assert len(entries) == len(result.token_ids) == 12
        with torch.inference_mode():
            logits = ref.model(torch.tensor([prompt + result.token_ids])).logits[0]
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
        read = token_bytes_reader(ref.tokenizer)
        for position, (entry, token_id) in enumerate(zip(entries, result.token_ids, strict=True)):
            row = expected[position]
            assert bytes(entry.bytes) == read(token_id)
            assert entry.token == read(token_id).decode("utf-8", errors="replace")
            assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-3)
            top = row.topk(k)
            assert [bytes(b) for _, _, b in entry.top] == [read(t) for t in top.indices.tolist()]
            assert [v for _, v, _ in entry.top] == pytest.approx(top.values.tolist(), abs=1e-3)
            if request_id == "greedy":  # the likeliest token, whose log probability is the row's largest
                assert entry.logprob == pytest.approx(row.max().item(), abs=1e-3)
        # What a client rebuilds the text from: the tokens' bytes, spaces and split characters included
        # (the text holds back a character the last token left unfinished).
        joined = bytes(b for entry in entries for b in entry.bytes).decode("utf-8", errors="replace")
        assert joined.rstrip("\ufffd") == result.text.rstrip("\ufffd")


def _penalized_greedy(ref: Reference, prompt: list[int], params: SamplingParams) -> list[int]:
    """What greedy decoding with OpenAI's logit_bias and penalties gives, one position at a time from
    the plain model's logits: the reference for the engine's batched version."""
    output: list[int] = []
    for _ in range(params.max_tokens):
        with torch.inference_mode():
            logits = ref.model(torch.tensor([prompt + output])).logits[0, -1].float().clone()
        logits = logits.clone()  # out of inference mode, to edit
        for token_id, bias in params.logit_bias:
            logits[token_id] += bias
        for token_id in set(output):
            count = output.count(token_id)
            logits[token_id] -= params.frequency_penalty * count + params.presence_penalty
        output.append(int(logits.argmax()))
    return output


def test_logit_bias_and_penalties_change_the_choice_as_openai_defines_them(
    model_dir: Path, ref: Reference
) -> None:
    """In one batch with a plain request (which they must not touch): a penalty on what was generated
    so far, a bias on named tokens. The log probabilities stay the model's own."""
    prompt = ref.prompt(21, start=5)
    n = 24
    plain = ref.greedy(prompt, n)
    banned, favoured = plain[0], plain[3]
    cases = {
        "frequency": greedy(n, frequency_penalty=2.0, ignore_eos=True),
        "presence": greedy(n, presence_penalty=-1.5, ignore_eos=True),  # negative: repeat more
        "bias": greedy(n, logit_bias=((banned, -100.0), (favoured, 7.5)), ignore_eos=True, logprobs=0),
        "both": greedy(n, logit_bias=((favoured, 3.0),), frequency_penalty=1.0, ignore_eos=True),
    }
    arrivals = [Arrival(0, "plain", prompt, greedy(n, ignore_eos=True))]
    arrivals += [Arrival(0, name, prompt, params) for name, params in cases.items()]
    results = run(make_engine(model_dir), arrivals)
    assert results["plain"].token_ids == plain
    for name, params in cases.items():
        assert results[name].token_ids == _penalized_greedy(ref, prompt, params), name
    assert banned not in results["bias"].token_ids
    assert any(results[name].token_ids != plain for name in ("frequency", "presence"))  # not vacuous
    entries = [e for out in results["bias"].outputs for e in (out.logprobs or [])]
    with torch.inference_mode():
        logits = ref.model(torch.tensor([prompt + results["bias"].token_ids])).logits[0]
    raw = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
    chosen = raw.gather(1, torch.tensor(results["bias"].token_ids)[:, None]).squeeze(1)
    assert [e.logprob for e in entries] == pytest.approx(chosen.tolist(), abs=1e-3)


def test_adjusting_bf16_logits_made_in_inference_mode_leaves_them_as_they_were() -> None:
    """As on a GPU: the model's logits in bf16, inference tensors. The adjusted copy is float32, its
    values the float32 computation's; the rows nobody adjusts are the logits, upcast."""
    from serving.engine.logit_adjust import adjust_logits as _adjust_logits
    from serving.engine.sequence import Sequence

    with torch.inference_mode():
        logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before = logits.clone()
    biased = Sequence("b", [1, 2], greedy(4, logit_bias=((7, 2.5), (9, -100.0))))
    penalized = Sequence("p", [1, 2], greedy(4, frequency_penalty=0.5, presence_penalty=1.0))
    for token_id in (7, 7, 3):
        penalized.append_token(token_id)
    out = _adjust_logits(logits, [0, 2], [biased, penalized])
    assert out.dtype == torch.float32 and torch.equal(logits, before)
    expected = logits.float()
    expected[0, 7] += 2.5
    expected[0, 9] -= 100.0
    expected[2, 7] -= 0.5 * 2 + 1.0
    expected[2, 3] -= 0.5 * 1 + 1.0
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"logit_bias": ((5, 101.0),)}, "from -100 to 100"),
        ({"logit_bias": ((-1, 1.0),)}, "token ids"),
        ({"logit_bias": ((10**6, 1.0),)}, "vocabulary"),
        ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "at most 300"),
    ],
)
def test_bad_penalties_and_biases_are_refused_with_nothing_allocated(
    demo_dir: Path, fields: dict[str, Any], message: str
) -> None:
    engine = make_engine(demo_dir)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", [1, 2, 3], greedy(4, **fields))
    assert not engine.has_unfinished() and kv_snapshot(engine)[1] == engine.kv_cache.num_blocks


# --- 5: abort -------------------------------------------------------------------------------------


def test_abort_frees_blocks_of_waiting_and_running_requests(demo_dir: Path, demo_ref: Reference) -> None:
    engine = make_engine(demo_dir, max_num_seqs=1, max_num_batched_tokens=16)
    empty = kv_snapshot(engine)
    num_blocks = engine.kv_cache.num_blocks
    assert empty == (0.0, num_blocks, 0, 0)

    engine.add_request("running", demo_ref.prompt(40), greedy(20))
    engine.step()  # the first 16-token chunk of its prompt
    engine.add_request("waiting", demo_ref.prompt(30, start=50), greedy(20))
    engine.step()  # max_num_seqs=1 keeps it waiting
    usage, num_free, num_running, num_waiting = kv_snapshot(engine)
    assert (num_running, num_waiting) == (1, 1)
    assert num_free < num_blocks and usage > 0

    assert engine.abort("waiting") is True
    assert kv_snapshot(engine) == (usage, num_free, 1, 0)  # it held nothing

    assert engine.abort("running") is True
    assert kv_snapshot(engine) == empty
    assert not engine.has_unfinished()
    assert engine.step() == []

    assert engine.abort("running") is False, "already gone"
    assert engine.abort("never-added") is False


def test_abort_of_a_decoding_request_spares_its_neighbours(demo_dir: Path, demo_ref: Reference) -> None:
    engine = make_engine(demo_dir, max_num_batched_tokens=32)
    keep, drop = demo_ref.prompt(20, start=10), demo_ref.prompt(35, start=80)
    engine.add_request("keep", keep, greedy(24))
    engine.add_request("drop", drop, greedy(24))
    results: dict[str, Result] = {}
    while len(results.get("drop", Result()).token_ids) < 3:
        collect(results, engine.step())
    before = engine.stats()
    seq_of_drop = engine.scheduler.get("drop")
    assert seq_of_drop is not None
    # Its whole blocks return, and the block its tail's half is in unless another tail holds the other half.
    blocks_of_drop = sum(not is_half(entry) for entry in seq_of_drop.block_table)
    if is_half(tail := seq_of_drop.block_table[-1]):
        others = [seq.block_table[-1] for seq in engine.scheduler.running_seqs() if seq is not seq_of_drop]
        blocks_of_drop += half_of(tail)[0] not in {half_of(e)[0] for e in others if is_half(e)}
    num_free = engine.kv_cache.num_free_blocks

    assert engine.abort("drop") is True
    after = engine.stats()
    assert after.num_running == before.num_running - 1
    assert engine.kv_cache.num_free_blocks == num_free + blocks_of_drop
    assert after.kv_cache_usage < before.kv_cache_usage

    # Its freed blocks go to a newcomer; neither the survivor nor the newcomer is disturbed.
    late = demo_ref.prompt(26, start=150)
    engine.add_request("late", late, greedy(10))
    while engine.has_unfinished():
        out = engine.step()
        assert all(o.request_id != "drop" for o in out)
        collect(results, out)
    assert results["keep"].token_ids == demo_ref.greedy(keep, 24)
    assert results["late"].token_ids == demo_ref.greedy(late, 10)
    assert engine.abort("keep") is False, "finished requests cannot be aborted"


def test_abort_of_a_prefix_owner_keeps_the_blocks_its_rider_shares(model_dir: Path, ref: Reference) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=64)
    owner = ref.prompt(40, start=15)
    rider = [*owner[:36], *ref.prompt(10, start=160)[1:]]
    engine.add_request("owner", owner, greedy(30))
    results: dict[str, Result] = {}
    collect(results, engine.step())  # the owner's prompt is computed
    engine.add_request("rider", rider, greedy(20))
    collect(results, engine.step())
    collect(results, engine.step())
    assert results["rider"].outputs[-1].num_cached_prompt_tokens == 2 * BLOCK_SIZE
    owner_blocks = list(engine.scheduler.get("owner").block_table)  # type: ignore[union-attr]
    rider_blocks = set(engine.scheduler.get("rider").block_table)  # type: ignore[union-attr]
    num_shared = sum(b in rider_blocks for b in owner_blocks)
    assert num_shared == 2
    num_free = engine.kv_cache.num_free_blocks

    assert engine.abort("owner") is True
    assert engine.kv_cache.num_free_blocks == num_free + len(owner_blocks) - num_shared
    while engine.has_unfinished():
        collect(results, engine.step())
    assert results["rider"].token_ids == ref.greedy(rider, 20)
    assert engine.stats().kv_cache_usage == 0.0


# --- 6: bad input ---------------------------------------------------------------------------------

IN_FLIGHT = "in-flight"  # a valid request already running when the bad one arrives
BAD_INPUTS: dict[str, Callable[[Engine], tuple[str, list[int], SamplingParams]]] = {
    "prompt-as-long-as-the-context": lambda e: ("bad", [5] * e.max_model_len, greedy(1)),
    "prompt-longer-than-the-context": lambda e: ("bad", [5] * (e.max_model_len + 7), greedy(1)),
    "max-tokens-beyond-the-context": lambda e: ("bad", [5, 6], greedy(e.max_model_len + 1)),
    "max-tokens-zero": lambda e: ("bad", [5, 6], greedy(0)),
    "negative-temperature": lambda e: ("bad", [5, 6], SamplingParams(temperature=-0.1)),
    "nan-temperature": lambda e: ("bad", [5, 6], SamplingParams(temperature=float("nan"))),
    "top-p-zero": lambda e: ("bad", [5, 6], SamplingParams(top_p=0.0)),
    "top-p-above-one": lambda e: ("bad", [5, 6], SamplingParams(top_p=1.5)),
    "top-k-zero": lambda e: ("bad", [5, 6], SamplingParams(top_k=0)),
    "empty-stop-string": lambda e: ("bad", [5, 6], SamplingParams(stop=("",))),
    "empty-prompt": lambda e: ("bad", [], greedy(4)),
    "token-id-equal-to-vocab-size": lambda e: ("bad", [5, e.runner.vocab_size], greedy(4)),
    "negative-token-id": lambda e: ("bad", [5, -1], greedy(4)),
    "duplicate-request-id": lambda e: (IN_FLIGHT, [5, 6, 7], greedy(4)),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_value_error_with_nothing_allocated(
    demo_dir: Path, demo_ref: Reference, case: str
) -> None:
    # A fresh engine stays empty.
    engine = make_engine(demo_dir)
    request_id, prompt, params = BAD_INPUTS[case](engine)
    if request_id != IN_FLIGHT:
        with pytest.raises(ValueError, match=r"\S"):
            engine.add_request(request_id, prompt, params)
        assert not engine.has_unfinished()
        assert kv_snapshot(engine) == (0.0, engine.kv_cache.num_blocks, 0, 0)
        assert engine.step() == []

    # An engine with a request in flight: the bad one changes nothing, and the good one is unharmed.
    good = demo_ref.prompt(24, start=30)
    engine.add_request(IN_FLIGHT, good, greedy(8))
    results: dict[str, Result] = {}
    collect(results, engine.step())
    before = kv_snapshot(engine)
    with pytest.raises(ValueError, match=r"\S"):
        engine.add_request(request_id, prompt, params)
    assert kv_snapshot(engine) == before
    while engine.has_unfinished():
        collect(results, engine.step())
    assert list(results) == [IN_FLIGHT]
    assert results[IN_FLIGHT].token_ids == demo_ref.greedy(good, 8)
    assert kv_snapshot(engine)[0] == 0.0


def test_a_seed_out_of_range_is_refused_with_nothing_queued(demo_dir: Path) -> None:
    engine = make_engine(demo_dir)
    with pytest.raises(ValueError, match=r"\S"):
        engine.add_request("bad-seed", [BOS, 5, 6], SamplingParams(max_tokens=4, seed=2**64))
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_a_non_integer_token_id_is_refused_at_add_request(demo_dir: Path, demo_ref: Reference) -> None:
    engine = make_engine(demo_dir)
    good = demo_ref.prompt(12, start=3)
    engine.add_request("good", good, greedy(4))
    with pytest.raises(ValueError, match=r"\S"):
        engine.add_request("float-token", [BOS, 7.0], greedy(4))  # type: ignore[list-item]
    results = run(engine, [], results={"good": Result()})
    assert results["good"].token_ids == demo_ref.greedy(good, 4)


def test_a_request_that_can_never_fit_the_kv_pool_is_refused(demo_dir: Path, demo_ref: Reference) -> None:
    engine = make_engine(demo_dir, kv_cache_bytes=4 * demo_ref.bytes_per_block)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("huge", demo_ref.prompt(50), greedy(30))  # 79 positions: 5 blocks
    assert not engine.has_unfinished()
    assert kv_snapshot(engine) == (0.0, 4, 0, 0)
    fits = demo_ref.prompt(50)
    results = run(engine, [Arrival(0, "fits", fits, greedy(14))])  # 63 positions: 4 blocks
    assert results["fits"].token_ids == demo_ref.greedy(fits, 14)


# --- 7: stop strings ------------------------------------------------------------------------------


def pick_stop_string(ref: Reference, prompt: list[int], output_ids: list[int]) -> str:
    """A substring of the greedy text that starts inside one token and ends inside a later one,
    chosen from the middle, and whose first occurrence is where we took it."""
    token_ends = [len(ref.output_text(prompt, output_ids[: i + 1])) for i in range(len(output_ids))]
    text = ref.output_text(prompt, output_ids)
    for i in range(len(output_ids) // 3, len(output_ids) - 2):
        start, end = token_ends[i] - 1, token_ends[i + 1] + 1  # last char of token i .. first of i+2
        stop = text[start:end]
        if (
            token_ends[i] - token_ends[i - 1] >= 2  # so the stop starts mid-token
            and token_ends[i + 2] > end - 1
            and len(stop.strip()) >= 2
            and "\ufffd" not in stop
            and text.find(stop) == start
        ):
            return stop
    raise AssertionError(f"no stop string spanning tokens in {text!r}")


def test_stop_string_cuts_the_text_before_it_and_finishes_with_stop(model_dir: Path, ref: Reference) -> None:
    prompt = ref.prompt(18, start=20)
    output_ids = ref.greedy(prompt, 40)
    full_text = ref.output_text(prompt, output_ids)
    stop = pick_stop_string(ref, prompt, output_ids)
    engine = make_engine(model_dir)

    results = run(
        engine,
        [
            Arrival(0, "stopped", prompt, greedy(40, stop=("never in this text \u2603", stop))),
            Arrival(0, "no-match", prompt, greedy(40, stop=("never in this text \u2603",))),
        ],
    )

    stopped = results["stopped"]
    assert stopped.final.finish_reason == "stop"
    assert stopped.text == full_text[: full_text.find(stop)]
    assert stop not in stopped.text
    for out in stopped.outputs:
        assert stop not in out.new_text
    assert len(stopped.token_ids) < len(output_ids)
    assert stopped.token_ids == output_ids[: len(stopped.token_ids)]
    # The stop string was only completed by the last token: one token fewer would not contain it.
    assert stop not in ref.output_text(prompt, stopped.token_ids[:-1])
    assert stop in ref.output_text(prompt, stopped.token_ids)

    # Held-back text is flushed when the request ends without a match.
    no_match = results["no-match"]
    assert no_match.final.finish_reason == "length"
    assert no_match.token_ids == output_ids
    assert no_match.text == full_text.rstrip("\ufffd")


def test_text_deltas_add_up_to_the_decoded_output(model_dir: Path, ref: Reference) -> None:
    arrivals = staggered_arrivals(ref)[:5]
    results = run(make_engine(model_dir), arrivals)
    for a in arrivals:
        result = results[a.request_id]
        # A character left unfinished by the last token is dropped rather than sent as U+FFFD.
        assert result.text == ref.output_text(a.prompt, result.token_ids).rstrip("\ufffd"), a.request_id


def test_a_request_ending_at_any_token_emits_its_whole_text(model_dir: Path, ref: Reference) -> None:
    """One request per end point: each final text is the decoded output, less only a character the
    last token left unfinished (byte-level tokens split UTF-8 characters)."""
    prompts = [ref.prompt(7, start=start) for start in (0, 61, 122)]
    arrivals = [
        Arrival(0, f"p{i}-end{n}", prompt, greedy(n, ignore_eos=True))
        for i, prompt in enumerate(prompts)
        for n in range(1, 25)
    ]
    results = run(make_engine(model_dir, max_num_seqs=len(arrivals), max_num_batched_tokens=256), arrivals)
    for a in arrivals:
        result = results[a.request_id]
        assert result.text == ref.output_text(a.prompt, result.token_ids).rstrip("\ufffd"), a.request_id


# --- 8: finish reasons ----------------------------------------------------------------------------


def test_max_tokens_finishes_with_length(model_dir: Path, ref: Reference) -> None:
    prompt = ref.prompt(10, start=40)
    result = run(make_engine(model_dir), [Arrival(0, "r", prompt, greedy(5, ignore_eos=True))])["r"]
    assert result.final.finish_reason == "length"
    assert len(result.token_ids) == result.final.num_output_tokens == 5
    assert [o.is_finished for o in result.outputs] == [False] * (len(result.outputs) - 1) + [True]
    assert all(o.finish_reason is None for o in result.outputs[:-1])


@pytest.mark.parametrize("num_free_positions", [1, 3])
def test_context_limit_finishes_with_length(model_dir: Path, ref: Reference, num_free_positions: int) -> None:
    engine = make_engine(model_dir, kv_cache_bytes=4 << 20, max_num_batched_tokens=256)
    prompt = ref.prompt(engine.max_model_len - num_free_positions, start=9)
    result = run(engine, [Arrival(0, "r", prompt, greedy(20, ignore_eos=True))])["r"]
    assert result.final.finish_reason == "length"
    assert len(result.token_ids) == num_free_positions  # the context is full
    assert result.token_ids == ref.greedy(prompt, num_free_positions)


def test_stop_token_id_finishes_with_stop(model_dir: Path, ref: Reference) -> None:
    prompt = ref.prompt(12, start=100)
    expected = ref.greedy(prompt, 20)
    stop_token = expected[2]
    params = greedy(20, stop_token_ids=(stop_token,))
    result = run(make_engine(model_dir), [Arrival(0, "r", prompt, params)])["r"]
    assert result.final.finish_reason == "stop"
    assert result.token_ids == expected[: expected.index(stop_token) + 1]


def demo_with_eos(demo_dir: Path, out: Path, eos_token_ids: list[int]) -> Path:
    """A copy of the demo model whose generation config names these EOS ids."""
    for path in demo_dir.iterdir():
        shutil.copy(path, out / path.name)
    config = json.loads((out / "generation_config.json").read_text())
    config["eos_token_id"] = eos_token_ids
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("position", [0, 1], ids=["first-eos-id", "second-eos-id"])
def test_eos_finishes_with_stop_unless_ignored(
    demo_dir: Path, demo_ref: Reference, tmp_path: Path, position: int
) -> None:
    prompt = demo_ref.prompt(12, start=100)
    plain = demo_ref.greedy(prompt, 20)  # the demo model has no EOS in its generation config
    eos = plain[2]  # an EOS the model produces; its real <|eos|> (2) is never picked
    # With several EOS ids the engine stops on the first in the scheduler, on the rest as stop tokens.
    eos_token_ids = [eos, 2] if position == 0 else [2, eos]
    model_dir = demo_with_eos(demo_dir, tmp_path, eos_token_ids)
    results = run(
        make_engine(model_dir),
        [
            Arrival(0, "eos", prompt, greedy(20)),
            Arrival(0, "ignore-eos", prompt, greedy(20, ignore_eos=True)),
        ],
    )
    assert results["eos"].final.finish_reason == "stop"
    assert results["eos"].token_ids == plain[: plain.index(eos) + 1]
    assert results["eos"].token_ids == Reference(model_dir).greedy(prompt, 20)  # generate agrees
    assert results["ignore-eos"].final.finish_reason == "length"
    assert results["ignore-eos"].token_ids == plain


# --- 9: KV stats ----------------------------------------------------------------------------------


@pytest.mark.parametrize("half_block_tails", [False, True])
def test_kv_stats_waste_stays_under_one_block_per_running_sequence(
    model_dir: Path, ref: Reference, half_block_tails: bool
) -> None:
    # 10 blocks: tight enough that one sequence is preempted on the way.
    engine = make_engine(
        model_dir,
        kv_cache_bytes=10 * ref.bytes_per_block,
        max_num_batched_tokens=24,
        half_block_tails=half_block_tails,
    )
    arrivals = [
        *staggered_arrivals(ref),
        Arrival(1, "sampled", ref.prompt(19, start=33), SamplingParams(max_tokens=25, seed=3)),
        Arrival(4, "shared", ref.prompt(45, start=11)[:40] + ref.prompt(6)[1:], greedy(15)),
    ]
    seen: list[EngineStats] = []
    num_tails_in_halves = 0
    # A tail in half a block leaves at most half a block less one empty; a whole last block holds a tail
    # longer than half, so it too.
    max_empty = (BLOCK_SIZE // 2 if half_block_tails else BLOCK_SIZE) - 1

    def check(e: Engine) -> None:
        nonlocal num_tails_in_halves
        s = e.stats()
        seen.append(s)
        waste = s.kv_allocated_slots - s.kv_used_slots
        assert s.kv_allocated_slots >= s.kv_used_slots
        assert 0 <= waste <= max_empty * s.num_running, s
        assert 0.0 <= s.kv_cache_usage <= 1.0
        assert s.num_running == len(e.scheduler.running_seqs())
        e.scheduler.check_invariants()
        num_tails_in_halves += sum(is_half(seq.block_table[-1]) for seq in e.scheduler.running_seqs())

    run(engine, arrivals, after_step=check)
    assert (num_tails_in_halves > 0) == half_block_tails
    assert max(s.num_running for s in seen) >= 3
    assert engine.stats().num_preemptions > 0, "the workload also covers recompute"
    assert engine.stats().prefix_cache_hit_rate > 0, "and shared prefix blocks"
    assert max(s.kv_used_slots for s in seen) > 4 * BLOCK_SIZE
    final = engine.stats()
    assert (final.num_running, final.num_waiting, final.kv_allocated_slots, final.kv_used_slots) == (
        0,
        0,
        0,
        0,
    )


def test_a_probe_between_steps_leaves_every_request_as_it_was(demo_dir: Path, demo_ref: Reference) -> None:
    """The model thread probes the device between steps while requests hold blocks, one of them
    named as a caller might name it: each still generates what generate() does, and every block
    comes back."""
    engine = make_engine(demo_dir)
    baseline = kv_snapshot(engine)
    arrivals = [
        Arrival(0, "probe", demo_ref.prompt(20), greedy(4 * BLOCK_SIZE)),  # takes blocks after probes
        Arrival(0, "other", demo_ref.prompt(9, start=30), greedy(10)),
    ]
    results = run(engine, arrivals, after_step=lambda e: e.probe())
    assert_greedy_matches(demo_ref, arrivals, results)
    assert kv_snapshot(engine) == baseline


def test_a_probe_keeps_the_prefix_cache_as_it_was(demo_dir: Path, demo_ref: Reference) -> None:
    """With every block holding a cached prefix, a probe checks the device without evicting one (the
    next request that shares the prefix still skips it) and without counting in the cache's hit rate."""
    engine = make_engine(demo_dir, kv_cache_bytes=4 * BLOCK_SIZE * 512)  # 4 blocks: 512 bytes a token
    assert engine.kv_cache.num_blocks == 4

    def serve(request_id: str, prompt: list[int]) -> Result:
        return run(engine, [Arrival(0, request_id, prompt, greedy(1))])[request_id]

    story = demo_ref.prompt(3 * BLOCK_SIZE)
    serve("story", story)
    again = serve("story-again", story)
    assert again.final.num_cached_prompt_tokens == 2 * BLOCK_SIZE  # a hit, so the rate is above 0
    serve("other", demo_ref.prompt(BLOCK_SIZE, start=60))  # the last empty block now caches this
    assert engine.kv_cache.prefix_cache.num_cached_blocks == 4
    hit_rate = engine.stats().prefix_cache_hit_rate
    assert hit_rate > 0

    engine.probe()

    assert engine.stats().prefix_cache_hit_rate == hit_rate
    assert engine.kv_cache.prefix_cache.num_cached_blocks == 4
    longer = serve("story-longer", [*story, *demo_ref.prompt(1, start=70)])
    assert longer.final.num_cached_prompt_tokens == 3 * BLOCK_SIZE
