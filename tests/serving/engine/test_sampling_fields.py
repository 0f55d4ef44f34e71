"""vLLM's sampling fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos), each as
transformers' logits processor of the same name computes it on the same logits, row by row inside a
batch whose other rows they leave alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from serving.engine.demo_model import build_demo_model
from serving.engine.logit_adjust import adjust_logits
from serving.engine.sampling import Sampler
from serving.engine.sequence import SamplingParams, Sequence
from tests.serving.engine.test_engine import DEMO_SPEC, Arrival, greedy, make_engine, run

VOCAB = 64


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo"), DEMO_SPEC)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_is_transformers_over_the_prompt_and_the_output() -> None:
    logits = _logits(3)
    seq = Sequence("r", [5, 9, 9, 12], SamplingParams(max_tokens=8, repetition_penalty=1.3))
    for token_id in (12, 40, 5):
        seq.append_token(token_id)
    plain = Sequence("p", [5, 9], SamplingParams(max_tokens=8))
    out = adjust_logits(logits, [0, 2], [seq, plain])
    processor = RepetitionPenaltyLogitsProcessor(1.3)
    expected = processor(torch.tensor([seq.token_ids]), logits[0:1].clone())[0]
    assert torch.allclose(out[0], expected, atol=1e-6)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[2], logits[2])  # rows it does not ask for


def test_min_tokens_holds_back_the_ends_as_transformers_min_new_tokens_does() -> None:
    logits = _logits(1)
    params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(7,))
    seq = Sequence("m", [1, 2, 3], params)
    seq.append_token(11)
    out = adjust_logits(logits, [0], [seq], eos_ids=(2,))
    processor = MinNewTokensLengthLogitsProcessor(
        prompt_length_to_skip=3, min_new_tokens=3, eos_token_id=[2, 7]
    )
    expected = processor(torch.tensor([seq.token_ids]), logits.clone())
    assert torch.equal(out, expected)
    for token_id in (12, 13):  # three out: the ends are allowed again
        seq.append_token(token_id)
    assert torch.equal(adjust_logits(logits, [0], [seq], eos_ids=(2,)), logits)


@pytest.mark.parametrize(
    ("temperature", "top_k", "min_p"), [(1.0, None, 0.2), (0.7, 10, 0.05), (1.3, 3, 0.5)]
)
def test_sampled_tokens_are_always_among_those_transformers_warpers_keep(
    temperature: float, top_k: int | None, min_p: float
) -> None:
    logits = _logits(1, seed=3)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    scores = MinPLogitsWarper(min_p)(None, scores)
    kept = set(torch.isfinite(scores[0]).nonzero().flatten().tolist())
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, min_p=min_p)
    sampler = Sampler(seed=0)
    drawn = {int(sampler(logits, [params])[0]) for _ in range(400)}
    assert drawn <= kept
    assert len(drawn) == len(kept) or len(kept) > 8  # every kept token is reachable, for small sets


def test_in_one_batch_each_row_gets_what_transformers_generate_gives_it_alone(demo_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_dir).eval()
    prompt = [1, 17, 33, 17, 52, 8, 33]
    n = 16
    cases = {
        "plain": greedy(n, ignore_eos=True),
        "repetition": greedy(n, repetition_penalty=1.5, ignore_eos=True),
        "gentle": greedy(n, repetition_penalty=0.8, ignore_eos=True),
    }
    results = run(make_engine(demo_dir), [Arrival(0, name, prompt, p) for name, p in cases.items()])
    for name, params in cases.items():
        with torch.inference_mode():
            generated = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                repetition_penalty=params.repetition_penalty,
            )
        assert results[name].token_ids == generated[0, len(prompt) :].tolist(), name
    assert results["repetition"].token_ids != results["plain"].token_ids  # not vacuous


def test_min_tokens_keeps_a_sequence_going_past_an_end_it_would_take(demo_dir: Path) -> None:
    # The demo model names no end of sequence: a stop token stands for one, which min_tokens holds back
    # alike (logit_adjust.py), first whenever it may be.
    ending = {"stop_token_ids": (9,), "logit_bias": ((9, 100.0),)}
    results = run(
        make_engine(demo_dir),
        [
            Arrival(0, "free", [1, 5, 6], greedy(12, **ending)),
            Arrival(0, "held", [1, 5, 6], greedy(12, min_tokens=5, **ending)),
        ],
    )
    assert results["free"].token_ids == [9] and results["free"].final.finish_reason == "stop"
    assert len(results["held"].token_ids) == 6 and results["held"].final.finish_reason == "stop"
    assert 9 not in results["held"].token_ids[:5] and results["held"].token_ids[5] == 9


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20}, "must not exceed max_tokens"),
    ],
)
def test_bad_fields_are_refused_before_anything_is_allocated(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(max_tokens=16, **fields).validate()  # type: ignore[arg-type]


def test_min_tokens_holds_stop_strings_back_until_that_many_tokens_are_out(demo_dir: Path) -> None:
    # vLLM's min_tokens: a stop string is not looked for before the min_tokens-th token, so one the greedy
    # output says early does not end it; the first that ends at or after that token does.
    prompt = [1, 17, 33, 17, 52, 8, 33]
    free = run(make_engine(demo_dir), [Arrival(0, "free", prompt, greedy(24))])["free"]
    stop = free.outputs[0].new_text  # the first token's text
    again = free.text.find(stop, 1)
    assert stop and again > 0, f"the demo output {free.text!r} should say {stop!r} twice"
    stopping = {"stop": (stop,)}
    arrivals = [
        Arrival(0, "early", prompt, greedy(24, **stopping)),
        Arrival(0, "held", prompt, greedy(24, min_tokens=3, **stopping)),
    ]
    results = run(make_engine(demo_dir), arrivals)
    assert results["early"].text == "" and results["early"].final.finish_reason == "stop"
    held = results["held"]
    assert held.final.finish_reason == "stop" and held.text == free.text[:again]
    assert held.token_ids == free.token_ids[: len(held.token_ids)] and len(held.token_ids) > 3

    # The stop string's last token counts as the min_tokens-th; one more and it is never looked for again.
    n = len(held.token_ids)
    edge = run(
        make_engine(demo_dir),
        [
            Arrival(0, "at", prompt, greedy(24, min_tokens=n, **stopping)),
            Arrival(0, "past", prompt, greedy(24, min_tokens=n + 1, **stopping)),
        ],
    )
    assert edge["at"].token_ids == held.token_ids and edge["at"].final.finish_reason == "stop"
    past_stops = [i for i in range(again + 1, len(free.text)) if free.text.startswith(stop, i)]
    if not past_stops:
        assert edge["past"].final.finish_reason == "length" and edge["past"].text == free.text
