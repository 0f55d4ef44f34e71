from __future__ import annotations

import pytest
import torch

from serving.engine.sampling import Sampler, make_generator
from serving.engine.sequence import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def random_logits(num_rows: int, vocab_size: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def draw(logits: torch.Tensor, params: SamplingParams, num_draws: int, *, seed: int = 0) -> torch.Tensor:
    """num_draws samples of one row, as num_draws rows of one batch."""
    sampler = Sampler(seed=seed)
    return sampler(logits.expand(num_draws, -1), [params] * num_draws)


def test_greedy_is_argmax() -> None:
    logits = random_logits(8)
    assert Sampler()(logits, [GREEDY] * 8).tolist() == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = random_logits(6)
    params = [GREEDY, SamplingParams(temperature=1.0, seed=1)] * 3
    tokens = Sampler(seed=0)(logits, params, [make_generator(p) for p in params])
    assert tokens[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_seeded_sampling_reproduces_and_differs_across_seeds() -> None:
    logits = random_logits(1).expand(1, -1)

    def sequence_of_draws(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed)
        generator = make_generator(params)
        sampler = Sampler()  # unseeded: seeded rows must not depend on it
        return [int(sampler(logits, [params], [generator])) for _ in range(40)]

    assert sequence_of_draws(7) == sequence_of_draws(7)
    assert sequence_of_draws(7) != sequence_of_draws(8)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=42), SamplingParams(temperature=1.0, seed=42)],
    ids=["with top-k and top-p cuts", "without a cut (OpenAI's defaults)"],
)
def test_seeded_row_does_not_depend_on_the_rest_of_the_batch(params: SamplingParams) -> None:
    """Whatever shares its steps, a row with a cut among them (which sorts its own distribution)."""
    row = random_logits(1, seed=3)
    alone_generator = make_generator(params)
    alone = [int(Sampler()(row, [params], [alone_generator])[0]) for _ in range(30)]

    batched_generator = make_generator(params)
    others = [SamplingParams(temperature=1.5), GREEDY, SamplingParams(temperature=0.5, top_p=0.3, seed=1)]
    batched = []
    for step in range(30):
        logits = torch.cat([random_logits(1, seed=100 + step), row, random_logits(2, seed=200 + step)])
        all_params = [others[0], params, others[1], others[2]]
        generators = [None, batched_generator, None, make_generator(others[2])]
        batched.append(int(Sampler()(logits, all_params, generators)[1]))
    assert alone == batched


@pytest.mark.parametrize("temperature", [1e-6, 1e-39, 1e-50])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature: float) -> None:
    """1e-39 overflows float32 when the logits are divided by it and 1e-50 is zero there: every
    probability came out NaN and the pick fell on the vocabulary's last token."""
    logits = random_logits(8)
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(8)]
    assert Sampler(seed=0)(logits, params).tolist() == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(16)
    params = [SamplingParams(temperature=1.3, top_k=1)] * 16
    assert Sampler(seed=0)(logits, params).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-6, 1e-50])  # 1e-50 is 0 in float32: it drew the least likely token
def test_tiny_top_p_equals_greedy(top_p: float) -> None:
    logits = random_logits(16)
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * 16
    assert Sampler(seed=0)(logits, params).tolist() == logits.argmax(-1).tolist()


def test_top_p_draws_exactly_the_nucleus() -> None:
    probs = torch.tensor([0.05, 0.4, 0.02, 0.25, 0.13, 0.1, 0.05])
    logits = probs.log()[None]
    # Sorted: 0.4 (1), 0.25 (3), 0.13 (4), 0.1 (5), ... Mass before token 5 is 0.78 < 0.8: it is needed
    # to reach 0.8; mass before the next (0.88) already reaches it.
    drawn = draw(logits, SamplingParams(temperature=1.0, top_p=0.8), 4000)
    assert set(drawn.tolist()) == {1, 3, 4, 5}
    counts = torch.bincount(drawn, minlength=7).float() / len(drawn)
    kept = probs[[1, 3, 4, 5]] / probs[[1, 3, 4, 5]].sum()
    torch.testing.assert_close(counts[[1, 3, 4, 5]], kept, atol=0.03, rtol=0)


def test_top_k_draws_only_the_k_most_likely() -> None:
    logits = random_logits(1, vocab_size=30)
    drawn = draw(logits, SamplingParams(temperature=2.0, top_k=3), 2000)
    assert set(drawn.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_temperature_sampling_follows_the_softmax() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    drawn = draw(probs.log()[None], SamplingParams(temperature=1.0), 6000)
    torch.testing.assert_close(torch.bincount(drawn, minlength=3).float() / 6000, probs, atol=0.03, rtol=0)


def test_small_temperature_approaches_greedy() -> None:
    logits = random_logits(64, vocab_size=200)
    tokens = Sampler(seed=0)(logits, [SamplingParams(temperature=1e-3)] * 64)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_masked_vocabulary_is_never_drawn() -> None:
    logits = torch.full((1, 10), float("-inf"))
    logits[0, 6] = 0.0
    logits[0, 2] = 0.5
    drawn = draw(logits, SamplingParams(temperature=1.0, top_p=0.999), 500)
    assert set(drawn.tolist()) <= {2, 6}


def test_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="SamplingParams"):
        Sampler()(random_logits(2), [GREEDY])
    with pytest.raises(ValueError, match="generators"):
        Sampler()(random_logits(2), [GREEDY, GREEDY], [None])


def test_make_generator_only_for_seeded_requests() -> None:
    assert make_generator(SamplingParams()) is None
    generator = make_generator(SamplingParams(seed=3))
    assert generator is not None
    assert (
        torch.rand(1, generator=generator).item()
        == torch.rand(1, generator=torch.Generator().manual_seed(3)).item()
    )
