"""Dynamic batching for non-generative models (embedding models, classifiers): a batch closes when it
is full or when its oldest item has waited `max_wait_s`, whichever comes first, as Triton's dynamic
batcher and TorchServe's batch size / max batch delay do.

    batcher = DynamicBatcher(BatcherConfig(max_batch_size=32, max_wait_s=0.005))
    batcher.add(BatchItem(key, length=num_tokens, arrived_at=now, payload=token_ids))
    batcher.wait_s(now)   # None: nothing pending; 0: a batch is due now; else how long until one is
    batch = batcher.take(now)   # None until one is due

A batch is padded to its longest item, so items of like length are grouped: the oldest item always goes
(it is the one whose wait closes the batch), then those nearest it in length, earlier arrivals first
among equals. So no item waits behind more batches than there are items older than it. Under a backlog
every item has waited its delay; serving those first, oldest first, padded a MiniLM batch of 10-63-token
texts to 1.6 times its tokens (docs/benchmarks.md, "Embedding models"). Pure Python with no clock of its
own (the caller passes `now`), so tests drive time. Not thread-safe: one thread (the replica's model
thread) owns a batcher."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any


class CloseReason(enum.StrEnum):
    FULL = "full"
    TIMEOUT = "timeout"


@dataclass(slots=True, frozen=True)
class BatcherConfig:
    max_batch_size: int = 32
    max_wait_s: float = 0.005
    # Padded tokens (items x the longest item) one batch may hold: bounds the activations' memory.
    max_batch_tokens: int = 16_384

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {self.max_batch_size}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be at least 0, got {self.max_wait_s}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be at least 1, got {self.max_batch_tokens}")


@dataclass(slots=True, frozen=True)
class BatchItem:
    key: Hashable  # unique among pending items
    length: int  # tokens: what the batch is padded to
    arrived_at: float
    payload: Any = None


@dataclass(slots=True, frozen=True)
class Batch:
    items: tuple[BatchItem, ...]
    reason: CloseReason
    fill_time_s: float  # from its oldest item's arrival to its close

    @property
    def padded_tokens(self) -> int:
        return len(self.items) * max(item.length for item in self.items)


class DynamicBatcher:
    def __init__(self, config: BatcherConfig | None = None) -> None:
        self.config = config or BatcherConfig()
        self._pending: dict[Hashable, BatchItem] = {}  # in arrival order
        self.num_closed: dict[CloseReason, int] = dict.fromkeys(CloseReason, 0)

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, item: BatchItem) -> None:
        """Raises ValueError, adding nothing, for an item no batch could hold or a key already pending."""
        if item.key in self._pending:
            raise ValueError(f"{item.key!r} is already pending")
        if not 1 <= item.length <= self.config.max_batch_tokens:
            raise ValueError(
                f"an item of {item.length} tokens does not fit a batch of {self.config.max_batch_tokens}"
            )
        self._pending[item.key] = item

    def remove(self, key: Hashable) -> bool:
        """Drop a pending item (its request was aborted). False if it was not pending."""
        return self._pending.pop(key, None) is not None

    def wait_s(self, now: float) -> float | None:
        """How long until a batch is due: 0 when one is due now, None when nothing is pending."""
        if not self._pending:
            return None
        if len(self._pending) >= self.config.max_batch_size:
            return 0.0
        oldest = next(iter(self._pending.values()))
        return max(0.0, oldest.arrived_at + self.config.max_wait_s - now)

    def take(self, now: float) -> Batch | None:
        """The next batch if one is due (see wait_s), its items no longer pending; else None."""
        due = self.wait_s(now)
        if due is None or due > 0:
            return None
        reason = CloseReason.FULL if len(self._pending) >= self.config.max_batch_size else CloseReason.TIMEOUT
        oldest, *rest = self._pending.values()
        # By distance in length from the oldest, which the batch is closed for; sort() is stable and
        # `rest` is in arrival order, so ties go to the earlier arrival.
        rest.sort(key=lambda item: abs(item.length - oldest.length))
        chosen = [oldest]
        longest = oldest.length
        for item in rest:
            if len(chosen) == self.config.max_batch_size:
                break
            padded = (len(chosen) + 1) * max(longest, item.length)
            if padded > self.config.max_batch_tokens:
                continue  # a shorter item further on may still fit
            chosen.append(item)
            longest = max(longest, item.length)
        for item in chosen:
            del self._pending[item.key]
        self.num_closed[reason] += 1
        return Batch(tuple(chosen), reason, max(0.0, now - oldest.arrived_at))
