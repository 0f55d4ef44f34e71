"""The systems the engine is measured against, each over the same workload and the same weights:

(a) naive: `NaiveGenerator` (`model.generate`), one request at a time in arrival order;
(b) static batching: `model.generate` on left-padded batches, each batch run to its longest request;
(c) transformers' own continuous batching: its `ContinuousBatchingManager` (what `generate_batch` wraps),
    with each request's own `max_new_tokens`.

Each system's `run(requests)` returns one `RequestRecord` per request, timed from its own start, so the
metrics are computed the same way for all of them. A request never starts before its arrival time."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from serving.benchmarks.workload import BenchRequest, RequestRecord, new_records


def sleep_until(deadline: float, clock: Any = time.perf_counter) -> None:
    remaining = deadline - clock()
    if remaining > 0:
        time.sleep(remaining)


class NaiveSystem:
    """(a) One request at a time, first come first served, through the platform's original path."""

    name = "naive"

    def __init__(self, model_dir: str | Path) -> None:
        from serving.engine.naive import NaiveGenerator

        self.generator = NaiveGenerator(model_dir, device="cpu")

    def run(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        records = new_records(requests)
        started = time.perf_counter()
        for request in sorted(requests, key=lambda r: r.arrival_s):
            sleep_until(started + request.arrival_s)
            first_token_at: list[float] = []

            def on_token(token_id: int, index: int, delta: str, first: list[float] = first_token_at) -> bool:
                if not first:
                    first.append(time.perf_counter())
                return True

            result = self.generator.generate(list(request.prompt_token_ids), request.params, on_token)
            record = records[request.request_id]
            record.finished_s = time.perf_counter() - started
            record.first_token_s = first_token_at[0] - started if first_token_at else None
            record.num_output_tokens = len(result.output_token_ids)
        return list(records.values())


class _FirstTokenTimer:
    """The streamer protocol `generate` calls: put() with the prompt first, then each step's tokens."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class StaticBatchSystem:
    """(b) `model.generate` on left-padded batches of up to `max_batch_size` requests, taken in arrival
    order from those already waiting when the previous batch ends. A batch runs until its longest
    request's max_tokens; shorter requests keep decoding (wasted work) and return with the batch."""

    name = "static"

    def __init__(
        self, model_dir: str | Path, *, max_batch_size: int = 32, cache_implementation: str | None = "static"
    ) -> None:
        from serving.engine.loading import load_causal_lm, load_tokenizer

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = load_causal_lm(model_dir, device="cpu")
        tokenizer = load_tokenizer(model_dir)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.max_batch_size = max_batch_size
        self.cache_implementation = cache_implementation

    def run(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        records = new_records(requests)
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        started = time.perf_counter()
        while pending:
            sleep_until(started + pending[0].arrival_s)
            now_s = time.perf_counter() - started
            batch: list[BenchRequest] = []
            while pending and len(batch) < self.max_batch_size and pending[0].arrival_s <= now_s:
                batch.append(pending.popleft())
            self._run_batch(batch, started, records)
        return list(records.values())

    def _run_batch(
        self, batch: list[BenchRequest], started: float, records: dict[str, RequestRecord]
    ) -> None:
        max_prompt_tokens = max(len(r.prompt_token_ids) for r in batch)
        max_new_tokens = max(r.max_tokens for r in batch)
        rows, masks = [], []
        for request in batch:
            num_pad = max_prompt_tokens - len(request.prompt_token_ids)
            rows.append([self.pad_token_id] * num_pad + list(request.prompt_token_ids))
            masks.append([0] * num_pad + [1] * len(request.prompt_token_ids))
        timer = _FirstTokenTimer()
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": max_new_tokens,  # ignore_eos for every row: EOS is never chosen early
            "do_sample": False,
            "pad_token_id": self.pad_token_id,
            "streamer": timer,
        }
        if self.cache_implementation is not None:
            kwargs["cache_implementation"] = self.cache_implementation
        with torch.inference_mode():
            output = self.model.generate(torch.tensor(rows), attention_mask=torch.tensor(masks), **kwargs)
        finished_s = time.perf_counter() - started
        num_generated = output.shape[1] - max_prompt_tokens
        first_token_s = timer.first_token_at - started if timer.first_token_at is not None else None
        # Per-request finish is not observable inside generate: every request ends with its batch, and
        # its time per output token is the batch's.
        tpot_s = None
        if first_token_s is not None and num_generated > 1:
            tpot_s = (finished_s - first_token_s) / (num_generated - 1)
        for request in batch:
            record = records[request.request_id]
            record.first_token_s = first_token_s
            record.finished_s = finished_s
            record.num_output_tokens = min(num_generated, request.max_tokens)
            record.tpot_s = tpot_s


class _DropPsutilNotices(logging.Filter):
    """transformers logs an ERROR when psutil is missing, only to size the cache from free memory; the
    cache here is sized explicitly, so the notice is noise. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


def _quiet_transformers_cb_logger() -> None:
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    cb_logger.setLevel(logging.WARNING)  # its INFO lines describe its set-up on every run
    if not any(isinstance(f, _DropPsutilNotices) for f in cb_logger.filters):
        cb_logger.addFilter(_DropPsutilNotices())


class HFContinuousSystem:
    """(c) transformers' continuous batching (paged cache, its own scheduler, a background thread), fed
    each request at its arrival with its own max_new_tokens and per-token timestamps."""

    name = "hf-continuous"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 512,
    ) -> None:
        from serving.engine.loading import load_causal_lm

        _quiet_transformers_cb_logger()
        self.model = load_causal_lm(model_dir, device="cpu")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len

    def _manager(self) -> Any:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        page_size = 256  # transformers' default
        # Sized explicitly: left to itself on CPU it takes 60% of free RAM. Enough pages that no request
        # ever waits for cache, so the comparison is about batching, not about a small cache.
        num_blocks = self.max_num_seqs * -(-self.max_model_len // page_size) + 2
        config = ContinuousBatchingConfig(
            page_size=page_size,
            num_blocks=num_blocks,
            max_batch_tokens=self.max_num_batched_tokens,
            max_requests_per_batch=self.max_num_seqs,
        )
        generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)  # type: ignore[no-untyped-call]
        return self.model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=config
        )

    def run(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        records = new_records(requests)
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        manager = self._manager()
        with torch.inference_mode():
            manager.start()
        try:
            started = time.perf_counter()
            num_finished = 0
            while num_finished < len(requests):
                now_s = time.perf_counter() - started
                while pending and pending[0].arrival_s <= now_s:
                    request = pending.popleft()
                    manager.add_request(
                        list(request.prompt_token_ids),
                        request_id=request.request_id,
                        max_new_tokens=request.max_tokens,
                        record_timestamps=True,
                        eos_token_id=-1,
                    )
                wait_s = pending[0].arrival_s - now_s if pending else 0.5
                result = manager.get_result(timeout=max(0.001, min(wait_s, 0.5)))
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped early")
                    continue
                if not result.is_finished():
                    continue
                if result.error is not None:
                    raise RuntimeError(f"{result.request_id} failed in transformers: {result.error}")
                record = records[result.request_id]
                stamps = result.timestamps or []
                record.first_token_s = stamps[0] - started if stamps else None
                record.finished_s = stamps[-1] - started if stamps else None
                record.num_output_tokens = len(result.generated_tokens)
                num_finished += 1
        finally:
            manager.stop(block=True)
            manager.destroy()
        return list(records.values())
