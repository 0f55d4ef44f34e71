"""Small Llama-style causal LMs built locally: random weights and a byte-level BPE tokenizer trained on
a short built-in text. No download. The text such a model writes is not meaningful; it exists so the
platform, its tests and its benchmarks run anywhere."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_CORPUS = """
Switchyard serves trained models behind an API on a shared fleet of accelerators. A request arrives at
the gateway, which checks the key, the tenant and the quota. The router picks a version and a replica.
The replica batches many requests together, step after step, and streams tokens back as they appear.
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Special cases aren't special enough to break the rules. Although practicality beats
purity. Errors should never pass silently. Unless explicitly silenced. In the face of ambiguity, refuse
the temptation to guess. There should be one, and preferably only one, obvious way to do it.
Now is better than never. If the implementation is hard to explain, it's a bad idea. If the
implementation is easy to explain, it may be a good idea. Namespaces are one honking great idea.
Once upon a time there was a little train that carried letters and parcels between the hills and the
sea. Every morning it woke early, counted its wagons, and listened for the whistle of the station master.
The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. 0123456789.
Hello, world! How are you today? The weather is fine, the river is calm, and the models are warm.
"""

_CORPUS_LINES = [line for line in _CORPUS.splitlines() if line]  # both tokenizers train on these
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # the demo BERTs' tokenizer


@dataclass(frozen=True, slots=True)
class DemoModelSpec:
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 2048
    vocab_size: int = 1024  # upper bound; the trained tokenizer may be smaller
    seed: int = 0


def build_tokenizer(vocab_size: int, corpus: Iterable[str] = _CORPUS_LINES) -> object:
    """A byte-level BPE tokenizer of `vocab_size` tokens (with the demo's special tokens) trained on
    `corpus`, its lines: the demo's own text by default, or a larger one (the structured-outputs
    benchmark's 32k vocabulary trains on the standard library's sources)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=2048
    )


def build_demo_model(
    out_dir: str | Path, spec: DemoModelSpec | None = None, *, tokenizer: object | None = None
) -> Path:
    """The demo model with the spec's shapes; `tokenizer` (a fast Hugging Face tokenizer with the demo's
    special tokens): another vocabulary than the built-in text's ~735 tokens, as a benchmark needs one
    of a real model's size (serving/benchmarks/structured_bench.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or DemoModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(spec.vocab_size)
    vocab = len(tokenizer)  # type: ignore[arg-type]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        # No EOS for generation: random weights would end outputs at random points; the demo is more
        # useful when a request runs to its max_tokens. The tokenizer still knows the token.
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Random weights would sometimes pick a special token (pad, BOS, EOS); zero rows give those a
        # zero logit, below the largest of the others, so greedy output is always ordinary text.
        for token_id in tokenizer.all_special_ids:  # type: ignore[attr-defined]
            model.lm_head.weight[token_id].zero_()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]
    (out / "README.md").write_text(
        "Switchyard demo model: a Llama-style causal LM with seeded RANDOM weights and a byte-level BPE\n"
        "tokenizer trained on a few built-in sentences. Its output is not meaningful text.\n"
        f"Spec: {json.dumps(asdict(spec))}\n"
    )
    return out


@dataclass(frozen=True, slots=True)
class DemoEmbeddingSpec:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    vocab_size: int = 1024  # upper bound; the counted vocabulary may be smaller
    seed: int = 0


def build_wordpiece_tokenizer(vocab_size: int) -> object:
    """A BERT-style tokenizer (lower-cased WordPiece, [CLS] text [SEP]) over the built-in text's words.
    The vocabulary is counted here, not trained by the tokenizers library: its WordPiece trainer numbered
    tokens of equal count differently in each process, so two builds of the same demo model had different
    embeddings for the same text (wordpiece_vocab)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok = Tokenizer(
        models.WordPiece(wordpiece_vocab(vocab_size, normalizer, pre_tokenizer), unk_token="[UNK]")
    )
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.WordPiece()
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
    )


def wordpiece_vocab(vocab_size: int, normalizer: Any, pre_tokenizer: Any) -> dict[str, int]:
    """The same vocabulary in every process: the special tokens, every character of the built-in text
    both as a word's start and as its continuation ("##e"), so that any word of those characters can be
    spelled, then the text's whole words, most frequent first (ties alphabetical), while fewer than
    `vocab_size` tokens are taken."""
    counts: Counter[str] = Counter()
    for line in _CORPUS_LINES:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line)))
    alphabet = sorted({char for word in counts for char in word})
    tokens = [*WORDPIECE_SPECIALS, *alphabet, *("##" + char for char in alphabet)]
    known = set(tokens)
    for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(tokens) >= vocab_size:
            break
        if word not in known:
            tokens.append(word)
            known.add(word)
    return {token: index for index, token in enumerate(tokens)}


def build_demo_embedding_model(out_dir: str | Path, spec: DemoEmbeddingSpec | None = None) -> Path:
    """A small BERT encoder with seeded random weights, saved as a sentence-embedding model (mean pooling,
    normalized). Its vectors are deterministic but carry no meaning."""
    from transformers import BertModel

    spec = spec or DemoEmbeddingSpec()
    out = _save_bert(BertModel, out_dir, spec)
    # The sentence-transformers description of the pipeline, which the engine reads for its pooling.
    (out / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": spec.hidden_size, "pooling_mode_mean_tokens": True})
    )
    (out / "README.md").write_text(
        "Switchyard demo embedding model: a small BERT encoder with seeded RANDOM weights and a WordPiece\n"
        "tokenizer trained on a few built-in sentences, mean-pooled and normalized. Its vectors carry no\n"
        f"meaning.\nSpec: {json.dumps(asdict(spec))}\n"
    )
    return out


DEMO_CLASSIFIER_LABELS = ("negative", "positive")


def build_demo_classifier_model(out_dir: str | Path, spec: DemoEmbeddingSpec | None = None) -> Path:
    """A small BERT text classifier with seeded random weights and two labels. Its scores are
    deterministic but carry no meaning."""
    from transformers import BertForSequenceClassification

    spec = spec or DemoEmbeddingSpec()
    out = _save_bert(
        BertForSequenceClassification,
        out_dir,
        spec,
        id2label=dict(enumerate(DEMO_CLASSIFIER_LABELS)),
        label2id={label: i for i, label in enumerate(DEMO_CLASSIFIER_LABELS)},
        problem_type="single_label_classification",
    )
    (out / "README.md").write_text(
        "Switchyard demo classifier: a small BERT encoder and classification head with seeded RANDOM\n"
        "weights, labels negative and positive, and a WordPiece tokenizer trained on a few built-in\n"
        f"sentences. Its scores carry no meaning.\nSpec: {json.dumps(asdict(spec))}\n"
    )
    return out


def _save_bert(model_class: Any, out_dir: str | Path, spec: DemoEmbeddingSpec, **config_fields: Any) -> Path:
    """A BERT of the spec's size, of model_class, with seeded random weights and the WordPiece tokenizer,
    saved as safetensors."""
    import torch
    from transformers import BertConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_wordpiece_tokenizer(spec.vocab_size)
    config = BertConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        **config_fields,
    )
    torch.manual_seed(spec.seed)
    model_class(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]
    return out
