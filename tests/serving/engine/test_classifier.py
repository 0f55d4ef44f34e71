"""The encoder engine serving a text classifier: the same batching as an embedding model's, a score per
label from the checkpoint's own classification head, scored as transformers' pipeline scores them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from serving.engine.encoder import EncoderConfig, EncoderEngine
from serving.engine.loading import ModelLoadError

TEXTS = [
    "hello",
    "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.",
    "Once upon a time there was a little train",
    "Readability counts.",
]


def _run(engine: EncoderEngine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        wait = engine.seconds_until_ready()
        if wait:
            time.sleep(wait)  # nothing else can arrive here
        outputs.update({out.request_id: out for out in engine.step()})
    return outputs


def _classifier(model_dir: Path, **config: object) -> EncoderEngine:
    return EncoderEngine(
        model_dir, kind="classifier", config=EncoderConfig(max_batch_size=8, max_wait_s=0.0, **config)
    )


def _pipeline_scores(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """transformers' own text-classification pipeline: every label's score, in the model's label order."""
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(model_dir), top_k=None, device="cpu")
    labels = [json.loads((model_dir / "config.json").read_text())["id2label"][str(i)] for i in range(2)]
    rows = []
    for result in classify(texts):
        by_label = {r["label"]: r["score"] for r in result}
        rows.append([by_label[label] for label in labels])
    return torch.tensor(rows)


def test_scores_in_one_batch_equal_the_transformers_pipeline(demo_classifier_model_dir: Path) -> None:
    engine = _classifier(demo_classifier_model_dir)
    assert engine.head.labels == ("negative", "positive")
    engine.add_request("r", [engine.encode(t) for t in TEXTS])
    out = _run(engine)["r"]
    assert out.result_field == "scores" and out.labels == ("negative", "positive")
    assert out.vectors.shape == (len(TEXTS), 2)
    # padded together to the longest, each row still scores its own text only
    torch.testing.assert_close(
        out.vectors, _pipeline_scores(demo_classifier_model_dir, TEXTS), atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(out.vectors.sum(dim=1), torch.ones(len(TEXTS)))
    # Four texts, four scores. Not rounded: the demo model's scores lie within ~1e-4 of each other, and
    # two of them rounded to 6 places came out equal in a CI run.
    assert len({float(row[0]) for row in out.vectors}) == len(TEXTS)


def _with_config(source: Path, target: Path, **changes: object) -> Path:
    target.mkdir()
    for path in source.iterdir():
        if path.is_file():
            (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("problem_type", "sums_to_one"),
    [("multi_label_classification", False), ("regression", False), ("single_label_classification", True)],
)
def test_each_problem_type_is_scored_as_the_pipeline_scores_it(
    demo_classifier_model_dir: Path, tmp_path: Path, problem_type: str, sums_to_one: bool
) -> None:
    """Multi-label: a sigmoid per label; regression: the raw logits; single-label: a softmax."""
    model_dir = _with_config(demo_classifier_model_dir, tmp_path / "m", problem_type=problem_type)
    engine = _classifier(model_dir)
    engine.add_request("r", [engine.encode(t) for t in TEXTS])
    scores = _run(engine)["r"].vectors
    torch.testing.assert_close(scores, _pipeline_scores(model_dir, TEXTS), atol=1e-5, rtol=1e-4)
    assert torch.allclose(scores.sum(dim=1), torch.ones(len(TEXTS))) == sums_to_one


def test_a_single_logit_is_scored_by_a_sigmoid(demo_classifier_model_dir: Path, tmp_path: Path) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig.from_pretrained(demo_classifier_model_dir, num_labels=1, id2label={0: "toxic"})
    config.problem_type = None
    model_dir = _with_config(demo_classifier_model_dir, tmp_path / "one")
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(model_dir, safe_serialization=True)
    engine = _classifier(model_dir)
    assert engine.head.labels == ("toxic",) and engine.head.activation == "sigmoid"
    engine.add_request("r", [engine.encode(t) for t in TEXTS])
    scores = _run(engine)["r"].vectors
    with torch.inference_mode():
        logits = engine.model(**_padded(engine, TEXTS)).logits
    torch.testing.assert_close(scores, torch.sigmoid(logits), atol=1e-5, rtol=1e-4)


def _padded(engine: EncoderEngine, texts: list[str]) -> dict[str, torch.Tensor]:
    ids = [engine.encode(t) for t in texts]
    longest = max(len(i) for i in ids)
    return {
        "input_ids": torch.tensor([i + [0] * (longest - len(i)) for i in ids]),
        "attention_mask": torch.tensor([[1] * len(i) + [0] * (longest - len(i)) for i in ids]),
    }


def test_a_classifier_whose_weights_lack_the_head_is_refused(
    demo_classifier_model_dir: Path, tmp_path: Path
) -> None:
    """The config says classifier, but the head's weights are not in the file: transformers would
    initialise them at random and only warn."""
    from safetensors.torch import load_file, save_file

    model_dir = _with_config(demo_classifier_model_dir, tmp_path / "headless")
    weights = load_file(model_dir / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if not k.startswith("classifier.")}, model_dir / "model.safetensors"
    )
    with pytest.raises(ModelLoadError, match=r"lacks weights the model needs \(classifier\."):
        _classifier(model_dir)


def test_a_checkpoint_without_a_classification_head_is_refused(demo_embedding_model_dir: Path) -> None:
    # Loaded as a classifier anyway, it would get a random head and answer with confident nonsense.
    with pytest.raises(ModelLoadError, match="not a sequence classifier"):
        _classifier(demo_embedding_model_dir)


def test_an_unknown_kind_is_refused(demo_classifier_model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="no encoder head"):
        EncoderEngine(demo_classifier_model_dir, kind="causal-lm")
