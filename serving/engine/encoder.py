"""The engine of a non-generative model's replica (an embedding model or a text classifier): requests
wait in a dynamic batcher, and each step that finds a batch due runs one padded forward pass through
the encoder and its head.

    engine = EncoderEngine(model_dir, kind="embedding", config=EncoderConfig(max_batch_size=32))
    engine.add_request("r1", [ids_of_text_1, ids_of_text_2])
    while engine.has_unfinished():
        time.sleep(engine.seconds_until_ready())   # the replica waits on its inbox instead
        for out in engine.step(): ...   # out.vectors: one row per input, float32

It offers the replica what the generative Engine does (add_request, abort, step, stats, encode), so one
replica loop serves every kind. A request may carry several inputs (the OpenAI API takes a list); each is
its own batch item, and the request finishes when its last input is done.

The head is what differs by kind:
- an embedding model pools the last hidden states as the model's sentence-transformers files say
  (modules.json: mean or CLS pooling, normalized if a Normalize module follows); a plain encoder
  directory gets mean pooling, normalized, as OpenAI's embeddings are;
- a classifier (a `...ForSequenceClassification` checkpoint) gives each label a score: softmax over the
  labels for single-label models, a sigmoid each for multi-label ones and for a single logit, the raw
  value for regression, as transformers' text-classification pipeline scores them.

An input longer than the model takes is refused, never cut."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from serving.engine.batcher import Batch, BatcherConfig, BatchItem, DynamicBatcher
from serving.engine.engine import EngineStats, StepFailed, probe_device
from serving.engine.loading import (
    ModelLoadError,
    load_classifier,
    load_encoder,
    load_tokenizer,
    prompt_encoder,
)

MAX_INPUTS_PER_REQUEST = 2048  # as the OpenAI API


# How long a batch's oldest input may wait for company when the config does not say. On a CPU a forward
# pass costs about in proportion to its tokens, so waiting buys nothing: batches form from what arrives
# during the pass before, and a 5 ms wait only added latency at light load (docs/benchmarks.md,
# "Embedding models"). On a GPU a batch of 32 costs little more than one; 5 ms is a starting point there,
# not measured here.
CPU_MAX_WAIT_S = 0.0
GPU_MAX_WAIT_S = 0.005
# The most inputs a batch holds when the config does not say. On a CPU a larger batch pads more and runs
# slower per input: with a backlog, one thread served the most inputs/s at 8-16 (all-MiniLM-L6-v2: 74-76
# against 53 at 32; the demo model: 564 at 8 against 391 at 32), and 8 kept the lowest tails once the
# arrivals neared that (docs/benchmarks.md, "The batching sweep"). On a GPU, 32: not measured here.
CPU_MAX_BATCH_SIZE = 8
GPU_MAX_BATCH_SIZE = 32


@dataclass(slots=True, frozen=True)
class EncoderConfig:
    max_batch_size: int | None = None  # None: CPU_MAX_BATCH_SIZE or GPU_MAX_BATCH_SIZE, by the device
    max_wait_s: float | None = None  # None: CPU_MAX_WAIT_S or GPU_MAX_WAIT_S, by the model's device
    max_batch_tokens: int = 16_384
    device: str | None = None


@dataclass(slots=True, frozen=True)
class Pooling:
    mode: str = "mean"  # or "cls"
    normalize: bool = True


@dataclass(slots=True)
class EncoderOutput:
    """A finished request. Carries the fields the replica reads from a generative RequestOutput, and
    the result: `vectors` under the name `result_field` gives it (an embedding's "embeddings", a
    classifier's "scores", with the names of the labels they score)."""

    request_id: str
    vectors: torch.Tensor  # (number of inputs, the head's dimension), float32 on the CPU
    result_field: str
    labels: tuple[str, ...] | None
    num_prompt_tokens: int
    arrival_time: float
    finished_time: float
    first_scheduled_time: float | None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    is_finished: bool = True
    finish_reason: str = "stop"
    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0

    @property
    def first_token_time(self) -> float:  # the result is the first and only thing a request gets
        return self.finished_time


@dataclass(slots=True)
class _Request:
    request_id: str
    num_prompt_tokens: int
    arrival_time: float
    vectors: list[torch.Tensor | None]
    num_left: int
    first_scheduled_time: float | None = None


def read_pooling(model_dir: str | Path) -> Pooling:
    """The pooling a sentence-transformers directory declares; mean and normalized without one."""
    path = Path(model_dir)
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return Pooling()
    modules = json.loads(modules_file.read_text())
    types = [str(module.get("type", "")) for module in modules]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling_module = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling_module is None:
        return Pooling("mean", normalize)
    config = json.loads((path / pooling_module.get("path", "") / "config.json").read_text())
    if config.get("pooling_mode_mean_tokens"):
        mode = "mean"
    elif config.get("pooling_mode_cls_token"):
        mode = "cls"
    else:
        raise ModelLoadError(f"pooling {config} is not supported (mean or CLS token only)")
    return Pooling(mode, normalize)


class EmbeddingHead:
    """Pools the encoder's last hidden states into one vector per input."""

    result_field = "embeddings"
    labels: tuple[str, ...] | None = None

    def __init__(self, model_dir: Path) -> None:
        self.pooling = read_pooling(model_dir)

    def load(self, model_dir: Path, device: str | None) -> Any:
        return load_encoder(model_dir, device=device)

    def dimension(self, model: Any) -> int:
        return int(model.config.hidden_size)

    def describe(self) -> str:
        return f"{self.pooling.mode} pooling{', normalized' if self.pooling.normalize else ''}"

    def __call__(self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
        pooled: torch.Tensor
        if self.pooling.mode == "cls":
            pooled = hidden[:, 0]
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        if self.pooling.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
        return pooled


class ClassifierHead:
    """Scores each of the model's labels for each input."""

    result_field = "scores"

    def __init__(self, model_dir: Path) -> None:
        config_file = model_dir / "config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        architectures = config.get("architectures") or []
        # Loaded as a classifier, a checkpoint without a trained classification head would get a random
        # one and answer with confident nonsense (load_classifier also refuses weights it lacks).
        if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
            raise ModelLoadError(
                f"{model_dir} is not a sequence classifier (architectures: {architectures or 'none'}); "
                "a classifier needs a ...ForSequenceClassification checkpoint"
            )
        self.labels: tuple[str, ...] = ()
        self.activation = "softmax"

    def load(self, model_dir: Path, device: str | None) -> Any:
        """The model; its labels and how they are scored come from its own config, as the pipeline's."""
        model = load_classifier(model_dir, device=device)
        config = model.config
        self.labels = tuple(str(config.id2label[i]) for i in range(config.num_labels))
        if config.problem_type == "regression":
            self.activation = "none"
        elif config.problem_type == "multi_label_classification" or config.num_labels == 1:
            self.activation = "sigmoid"
        else:
            self.activation = "softmax"
        return model

    def dimension(self, model: Any) -> int:
        return len(self.labels)

    def describe(self) -> str:
        return f"labels {', '.join(self.labels)}, scored by {self.activation}"

    def __call__(self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = model(input_ids=input_ids, attention_mask=mask).logits.float()
        if self.activation == "softmax":
            return torch.softmax(logits, dim=-1)
        if self.activation == "sigmoid":
            return torch.sigmoid(logits)
        return logits


def _position_offset(model: Any) -> int:
    """Positions the model's inputs cannot use. RoBERTa's family (XLM-R, CamemBERT, MPNet...) numbers
    positions from its padding index + 1, so of max_position_embeddings = 514 only 512 hold tokens; a
    longer input indexes past the table and the forward pass fails, every request of its batch with it."""
    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, torch.nn.Embedding):
            return 0 if module.padding_idx is None else module.padding_idx + 1
    return 0


HEADS: dict[str, type[EmbeddingHead] | type[ClassifierHead]] = {
    "embedding": EmbeddingHead,
    "classifier": ClassifierHead,
}


def _max_input_tokens(model_dir: Path, model: Any, tokenizer: Any) -> int:
    limits = [int(model.config.max_position_embeddings) - _position_offset(model)]
    st_config = model_dir / "sentence_bert_config.json"
    if st_config.exists():
        limits.append(int(json.loads(st_config.read_text()).get("max_seq_length") or limits[0]))
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and model_max > 0:  # transformers says "no limit" with a huge number
        limits.append(model_max)
    return min(limits)


class EncoderEngine:
    def __init__(
        self, model_dir: str | Path, *, kind: str = "embedding", config: EncoderConfig | None = None
    ) -> None:
        """kind: "embedding" or "classifier", as the registry names the model's kind."""
        self.config = config = config or EncoderConfig()
        path = Path(model_dir)
        if kind not in HEADS:
            raise ModelLoadError(f"no encoder head for a model of kind {kind!r}")
        self.head = HEADS[kind](path)
        self.model: Any = self.head.load(path, config.device)
        self.device = next(self.model.parameters()).device
        self.tokenizer: Any = load_tokenizer(path)
        self._encode = prompt_encoder(self.tokenizer)
        self.max_input_tokens = _max_input_tokens(path, self.model, self.tokenizer)
        self.dimension = self.head.dimension(self.model)
        self._vocab_size = int(self.model.config.vocab_size)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self._pad_id = int(pad) if pad is not None else 0
        max_wait_s = config.max_wait_s
        if max_wait_s is None:
            max_wait_s = GPU_MAX_WAIT_S if self.device.type == "cuda" else CPU_MAX_WAIT_S
        if config.max_batch_size is None:  # resolved here, so that what reads the config reads a number
            on_gpu = self.device.type == "cuda"
            self.config = config = replace(
                config, max_batch_size=GPU_MAX_BATCH_SIZE if on_gpu else CPU_MAX_BATCH_SIZE
            )
        assert config.max_batch_size is not None
        self.batcher = DynamicBatcher(
            BatcherConfig(
                max_batch_size=config.max_batch_size,
                max_wait_s=max_wait_s,
                max_batch_tokens=max(config.max_batch_tokens, self.max_input_tokens),  # any one input fits
            )
        )
        self._requests: dict[str, _Request] = {}
        self.last_batch: Batch | None = None
        self._num_steps = 0

    def encode(self, text: str) -> list[int]:
        """The input's ids, special tokens included. Safe from another thread than the stepping one."""
        return self._encode(text)

    def warmup(self) -> None:
        """One full-size batch, so the first requests do not pay for first-call allocations."""
        ids = [[self._pad_id] * 16] * self.batcher.config.max_batch_size
        self._forward(ids)

    # --- requests ----------------------------------------------------------------------------------

    def expire_waiting(self, max_wait_s: float) -> list[str]:
        """None: a batch closes by its own maximum wait (the generative engine's queue timeout)."""
        return []

    def add_request(
        self,
        request_id: str,
        inputs: list[list[int]],
        params: Any = None,  # a generative request's sampling; nothing to sample here
        *,
        tenant_id: str = "default",
        cache_group: str | None = None,
        arrival_time: float | None = None,
        tier: int = 1,  # the generative engine's; a batch closes by size or wait, whatever the tier
        limits: Any = None,
    ) -> None:
        """Queue a request of one or more inputs (token ids each). Raises ValueError, queueing nothing,
        for an empty request, an empty or too-long input, or ids outside the vocabulary."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already queued")
        if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_INPUTS_PER_REQUEST:
            raise ValueError(f"a request holds 1 to {MAX_INPUTS_PER_REQUEST} inputs")
        for i, ids in enumerate(inputs):
            if not ids:
                raise ValueError(f"input {i} is empty")
            if len(ids) > self.max_input_tokens:
                raise ValueError(
                    f"input {i} is {len(ids)} tokens; this model takes at most {self.max_input_tokens}"
                )
            if any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self._vocab_size for t in ids
            ):
                raise ValueError(f"token ids must be integers in [0, {self._vocab_size})")
        now = time.monotonic()
        self._requests[request_id] = _Request(
            request_id,
            num_prompt_tokens=sum(len(ids) for ids in inputs),
            arrival_time=now if arrival_time is None else arrival_time,
            vectors=[None] * len(inputs),
            num_left=len(inputs),
        )
        for i, ids in enumerate(inputs):
            # The batcher's delay runs from here, not from the request's arrival at the gateway: it
            # bounds how long an input waits for company, whatever its way here cost.
            self.batcher.add(BatchItem((request_id, i), len(ids), now, ids))

    def abort(self, request_id: str) -> bool:
        """Drop a request and its inputs not yet run. False if it was unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for i, vector in enumerate(request.vectors):
            if vector is None:
                self.batcher.remove((request_id, i))
        return True

    def sequence(self, request_id: str) -> _Request | None:
        """The request's state while it is queued: the replica reads its first_scheduled_time."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def probe(self) -> None:
        """As Engine.probe: a round trip through the device, raising what it raises."""
        probe_device(self.device)

    def seconds_until_ready(self, now: float | None = None) -> float | None:
        """0 when a step would run a batch now, None when nothing is queued."""
        return self.batcher.wait_s(time.monotonic() if now is None else now)

    # --- the step ----------------------------------------------------------------------------------

    def step(self) -> list[EncoderOutput]:
        """Run the batch that is due, if one is; return the requests it finished. Raises StepFailed, as
        Engine.step does, naming the requests of a batch whose forward pass failed: the caller ends
        those (abort drops any of their inputs still queued); the others stay queued."""
        now = time.monotonic()
        batch = self.batcher.take(now)
        if batch is None:
            return []
        self.last_batch = batch
        self._num_steps += 1
        keys: list[tuple[str, int]] = [item.key for item in batch.items]  # type: ignore[misc]
        for request_id, _ in keys:
            request = self._requests[request_id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        try:
            vectors = self._forward([item.payload for item in batch.items])
        except Exception as exc:
            raise StepFailed(list(dict.fromkeys(request_id for request_id, _ in keys)), exc) from exc
        finished_time = time.monotonic()
        outputs = []
        for (request_id, index), vector in zip(keys, vectors, strict=True):
            request = self._requests[request_id]
            request.vectors[index] = vector
            request.num_left -= 1
            if request.num_left == 0:
                del self._requests[request_id]
                outputs.append(
                    EncoderOutput(
                        request_id=request_id,
                        vectors=torch.stack(request.vectors),  # type: ignore[arg-type]
                        result_field=self.head.result_field,
                        labels=self.head.labels,
                        num_prompt_tokens=request.num_prompt_tokens,
                        arrival_time=request.arrival_time,
                        finished_time=finished_time,
                        first_scheduled_time=request.first_scheduled_time,
                    )
                )
        return outputs

    @torch.inference_mode()
    def _forward(self, inputs: list[list[int]]) -> torch.Tensor:
        """One padded forward pass; (len(inputs), dimension) float32 on the CPU."""
        longest = max(len(ids) for ids in inputs)
        input_ids = torch.full((len(inputs), longest), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        for row, ids in enumerate(inputs):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        return self.head(self.model, input_ids, mask).cpu()

    # --- observability -----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        batch = self.last_batch
        return EngineStats(
            num_waiting=len(self.batcher),
            num_running=0,
            kv_cache_usage=0.0,
            num_batched_tokens=batch.padded_tokens if batch is not None else 0,
            num_scheduled_seqs=len(batch.items) if batch is not None else 0,
            kv_allocated_slots=0,
            kv_used_slots=0,
            num_preemptions=0,
            prefix_cache_hit_rate=0.0,
            num_steps=self._num_steps,
        )
