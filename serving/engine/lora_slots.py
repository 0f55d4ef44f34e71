"""The adapters resident in one engine: at most `max_loras`, installed on first use, least recently used
evicted first, never one a live sequence holds.

A request for an adapter is registered when it is queued (`register`, after Engine.add_request has
checked the adapter against its model, with nothing allocated). It takes a slot when admission seats
it (`can_seat`, then `seat`: installing the adapter if it is not resident, evicting the least recently
used adapter that no sequence holds) and holds it until it finishes, preempted or not (`release`).
When every slot is held by adapters with live sequences, a request for another adapter waits in the
queue: admission skips it (admission.py; with its tenant's requests queued behind it, a FIFO per tenant
and tier) and, so that the held slots drain and it cannot starve, seats no new request of any adapter
that is not waiting for a slot, until it is seated. Requests of the base never wait for a slot."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from serving.engine.sequence import Sequence


class _Adapter(Protocol):
    @property
    def adapter_id(self) -> str: ...


A = TypeVar("A", bound=_Adapter)  # an adapter as requests bring it (lora.LoraAdapter)
W = TypeVar("W")  # its weights installed in the runner's layout (lora_batch.FusedLoraWeights)


@dataclass(frozen=True, slots=True)
class AdapterStats:
    max_loras: int
    resident: tuple[str, ...]  # adapter ids, least recently used first
    num_loads: int  # installs since start (a reload after eviction counts again)
    num_evictions: int
    num_waiting_for_slot: int  # adapters whose requests wait because every slot is held


class AdapterSlots(Generic[A, W]):
    """The engine's resident adapters and who holds them. Model thread only. Imports no torch: the
    scheduler's policy reads it."""

    def __init__(
        self,
        *,
        max_loras: int,
        prepare: Callable[[A], W],
    ) -> None:
        """`prepare`: the adapter in the runner's layout, on its device (its install)."""
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {max_loras!r}")
        self.max_loras = max_loras
        self._prepare = prepare
        self._resident: collections.OrderedDict[str, W] = collections.OrderedDict()
        self._num_holders: collections.Counter[str] = collections.Counter()  # seated live sequences
        self._seated: set[str] = set()  # request ids
        # Adapters of live requests (waiting or running), with how many reference each.
        self._wanted: dict[str, tuple[A, int]] = {}
        self._starving: set[str] = set()  # adapters whose requests found every slot held
        self.num_loads = 0
        self.num_evictions = 0

    def register(self, seq: Sequence, adapter: A) -> None:
        """A queued request for `adapter` (checked by the engine), whose sequence carries its id."""
        assert seq.adapter_id == adapter.adapter_id
        known, count = self._wanted.get(adapter.adapter_id, (adapter, 0))
        self._wanted[adapter.adapter_id] = (known, count + 1)

    def can_seat(self, seq: Sequence) -> bool:
        """Whether admission may seat `seq` now: the base's, one seated before (preempted since), or an
        adapter that is resident or has a slot to take, unless another adapter starves for one."""
        adapter_id = seq.adapter_id
        if adapter_id is None or seq.request_id in self._seated:
            return True
        if self._starving and adapter_id not in self._starving:
            return False  # the held slots drain for the adapter waiting longest
        if adapter_id in self._resident or self._has_free_slot():
            return True
        self._starving.add(adapter_id)
        return False

    def _has_free_slot(self) -> bool:
        return len(self._resident) < self.max_loras or any(
            not self._num_holders[adapter_id] for adapter_id in self._resident
        )

    def seat(self, seq: Sequence) -> None:
        """Hold `seq`'s adapter for it until it finishes, installing it first if it is not resident
        (can_seat said there is room)."""
        adapter_id = seq.adapter_id
        if adapter_id is None or seq.request_id in self._seated:
            return
        if adapter_id not in self._resident:
            if len(self._resident) >= self.max_loras:
                victim = next(a for a in self._resident if not self._num_holders[a])
                del self._resident[victim]
                self.num_evictions += 1
            self._resident[adapter_id] = self._prepare(self._wanted[adapter_id][0])
            self.num_loads += 1
        self._resident.move_to_end(adapter_id)
        self._num_holders[adapter_id] += 1
        self._seated.add(seq.request_id)
        self._starving.discard(adapter_id)

    def release(self, seq: Sequence) -> None:
        """`seq` finished (or was aborted, waiting or running): its hold and its registration end."""
        adapter_id = seq.adapter_id
        if adapter_id is None or adapter_id not in self._wanted:
            return
        if seq.request_id in self._seated:
            self._seated.remove(seq.request_id)
            self._num_holders[adapter_id] -= 1
            if not self._num_holders[adapter_id]:
                del self._num_holders[adapter_id]
            if adapter_id in self._resident:
                self._resident.move_to_end(adapter_id)  # its last use
        adapter, count = self._wanted[adapter_id]
        if count > 1:
            self._wanted[adapter_id] = (adapter, count - 1)
        else:
            del self._wanted[adapter_id]
            self._starving.discard(adapter_id)

    @property
    def has_holders(self) -> bool:
        """Whether any live sequence holds an adapter (else a step has no adapter row)."""
        return bool(self._seated)

    def weights(self, adapter_id: str) -> W:
        """A resident adapter's installed weights."""
        return self._resident[adapter_id]

    def stats(self) -> AdapterStats:
        return AdapterStats(
            max_loras=self.max_loras,
            resident=tuple(self._resident),
            num_loads=self.num_loads,
            num_evictions=self.num_evictions,
            num_waiting_for_slot=len(self._starving),
        )

    def check_invariants(self) -> None:
        """For tests: holders only of resident adapters, within the slots."""
        assert len(self._resident) <= self.max_loras
        assert set(self._num_holders) <= set(self._resident), "a held adapter is resident"
        assert sum(self._num_holders.values()) == len(self._seated)
        assert self._starving <= set(self._wanted), "only live requests starve"


def _never_installed(adapter: _Adapter) -> None:
    raise ValueError(f"adapter {adapter.adapter_id!r}: this scheduler serves no adapters")


def no_adapters() -> AdapterSlots[Any, None]:
    """The slots of a scheduler given none: the base's sequences are seated as ever, and nothing
    registers an adapter (Engine.add_request does, with slots of its own)."""
    return AdapterSlots(max_loras=1, prepare=_never_installed)
