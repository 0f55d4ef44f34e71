"""A variant's accuracy against its parent on held-out text: perplexity of each, and greedy-token
agreement (docs/architecture.md, "Quantized siblings").

Both models read the same tokens (the parent's tokenizer's), in windows of the context length (at most
MAX_WINDOW) laid end to end (no overlap; each window predicts its own tokens after the first). At every
predicted position:

- perplexity = exp(mean negative log-likelihood of the text's next token), for each model;
- greedy agreement = the share of positions where the two models' most likely next token is the same
  (teacher-forced: both read the text, not their own output, so one early difference does not make
  every later position differ).

On the CPU in fp32, deterministic for a given machine and thread count. The held-out text shipped with
the platform is `heldout.txt` beside this file: short stories written for it, in TinyStories' plain
English, so that a model trained on TinyStories (stories260k) gets a meaningful perplexity, and any model
a finite one."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from serving.engine.loading import load_causal_lm, load_tokenizer

DEFAULT_TEXT = Path(__file__).with_name("heldout.txt")
MAX_WINDOW = 1024  # tokens a window may hold: a long-context model's whole context would be slow on a CPU


@dataclass(frozen=True, slots=True)
class QualityReport:
    parent_perplexity: float
    perplexity: float
    greedy_agreement: float  # share of predicted positions where both argmaxes agree
    num_tokens: int  # the text's tokens
    num_predictions: int  # positions scored (num_tokens less one per window)
    text_sha256: str

    @property
    def perplexity_delta(self) -> float:
        return self.perplexity - self.parent_perplexity

    @property
    def perplexity_increase(self) -> float:
        """The relative increase: 0.02 is 2% above the parent's perplexity."""
        return self.perplexity / self.parent_perplexity - 1.0

    def as_record(self) -> dict[str, Any]:
        """What the registry records as the version's `quality` (JSON)."""
        return {
            **asdict(self),
            "perplexity_delta": self.perplexity_delta,
            "perplexity_increase": self.perplexity_increase,
        }


@dataclass(slots=True)
class _Totals:
    nll_parent: float = 0.0
    nll: float = 0.0
    agreed: int = 0
    count: int = 0


@torch.inference_mode()
def compare(parent: Any, model: Any, token_ids: list[int], *, window: int, text_sha256: str) -> QualityReport:
    """Score `model` against `parent` (loaded causal LMs, same vocabulary) on `token_ids`."""
    if len(token_ids) < 2:
        raise ValueError("the held-out text must have at least two tokens")
    totals = _Totals()
    for start in range(0, len(token_ids), window):
        chunk = token_ids[start : start + window]
        if len(chunk) < 2:
            break
        ids = torch.tensor([chunk], dtype=torch.long, device=parent.device)
        targets = ids[0, 1:]
        logp_parent = torch.log_softmax(parent(input_ids=ids).logits[0, :-1].float(), dim=-1)
        logp = torch.log_softmax(model(input_ids=ids.to(model.device)).logits[0, :-1].float(), dim=-1)
        logp = logp.to(logp_parent.device)
        rows = torch.arange(targets.numel(), device=targets.device)
        totals.nll_parent -= float(logp_parent[rows, targets].double().sum())
        totals.nll -= float(logp[rows, targets].double().sum())
        totals.agreed += int((logp_parent.argmax(dim=-1) == logp.argmax(dim=-1)).sum())
        totals.count += int(targets.numel())
    return QualityReport(
        parent_perplexity=math.exp(totals.nll_parent / totals.count),
        perplexity=math.exp(totals.nll / totals.count),
        greedy_agreement=totals.agreed / totals.count,
        num_tokens=len(token_ids),
        num_predictions=totals.count,
        text_sha256=text_sha256,
    )


def evaluate(parent_dir: str | Path, model_dir: str | Path, *, text: str) -> QualityReport:
    """Load both directories on the CPU in fp32 and compare them on `text`."""
    tokenizer = load_tokenizer(parent_dir)
    token_ids = list(tokenizer(text)["input_ids"])
    parent = load_causal_lm(parent_dir, device="cpu", dtype=torch.float32)
    model = load_causal_lm(model_dir, device="cpu", dtype=torch.float32)
    window = min(MAX_WINDOW, int(parent.config.get_text_config().max_position_embeddings))
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return compare(parent, model, token_ids, window=window, text_sha256=digest)
