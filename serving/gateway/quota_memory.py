"""Quota counters in process memory: exact for one server process (the embedded default)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from registry.selectors import TenantContext
from serving.gateway.quota import (
    QuotaLimits,
    QuotaUsage,
    Ticket,
    admit_then_send,
    check_fits_quota,
    quota_usage,
    refilled,
    refusal,
)


@dataclass(slots=True)
class _TenantState:
    request_tokens: float
    token_tokens: float
    updated_at: float
    # Admitted and not yet released, by ticket id: a second release of one ticket frees no other's slot,
    # as in the Redis store, whose in-flight requests are leases by ticket id.
    in_flight: set[str] = field(default_factory=set)


class MemoryQuotaStore:
    """Per-process counters: exact for one server process (the embedded default)."""

    def __init__(self, clock: object = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[int, _TenantState] = {}
        self._num_refused: dict[int, int] = {}  # tenant id -> 429s since this process started
        self._lock = threading.Lock()

    def _refill(self, context: TenantContext, now: float) -> _TenantState:
        state = self._states.get(context.tenant_id)
        if state is None:
            state = _TenantState(max(1.0, context.requests_per_second), float(context.tokens_per_minute), now)
            self._states[context.tenant_id] = state
        state.request_tokens, state.token_tokens = refilled(
            context,
            request_tokens=state.request_tokens,
            token_tokens=state.token_tokens,
            elapsed_s=now - state.updated_at,
        )
        state.updated_at = now
        return state

    def admit(self, context: TenantContext, *, tokens: int, room_for: int = 1) -> Ticket:
        check_fits_quota(context, tokens)
        ticket = Ticket(uuid.uuid4().hex, context.tenant_id, tokens)
        with self._lock:
            state = self._refill(context, self._clock())  # type: ignore[operator]
            refused = refusal(
                context,
                request_tokens=state.request_tokens,
                token_tokens=state.token_tokens,
                num_in_flight=len(state.in_flight),
                tokens=tokens,
                room_for=room_for,
            )
            if refused is not None:
                self._num_refused[context.tenant_id] = self._num_refused.get(context.tenant_id, 0) + 1
                raise refused
            state.request_tokens -= 1.0
            state.token_tokens -= tokens
            state.in_flight.add(ticket.ticket_id)
        return ticket

    def release(self, ticket: Ticket, *, used_tokens: int) -> None:
        with self._lock:
            state = self._states.get(ticket.tenant_id)
            if state is None or ticket.ticket_id not in state.in_flight:
                return  # released already, or never admitted: it holds nothing to give back
            state.in_flight.remove(ticket.ticket_id)
            # Settle the estimate charged at admission against what the request really used.
            state.token_tokens += ticket.charged_tokens - used_tokens

    # No I/O: the event loop may call the sync methods directly (the lock is never held across I/O).
    async def aadmit(self, context: TenantContext, *, tokens: int, room_for: int = 1) -> Ticket:
        return self.admit(context, tokens=tokens, room_for=room_for)

    async def arelease(self, ticket: Ticket, *, used_tokens: int) -> None:
        self.release(ticket, used_tokens=used_tokens)

    def sends_with_admission(self, context: TenantContext) -> bool:
        return False  # admission costs no round trip here: admit before anything else is built

    async def aadmit_and_send(
        self,
        context: TenantContext,
        *,
        tokens: int,
        layer: Any,
        channel: str,
        message: dict[str, Any],
        room_for: int = 1,
    ) -> Ticket:
        return await admit_then_send(
            self, context, tokens=tokens, layer=layer, channel=channel, message=message, room_for=room_for
        )

    async def arenew(self) -> None:
        pass  # the counts are this process's own, and go with it

    def refusals(self) -> dict[int, int]:
        """429s per tenant id since this process started."""
        with self._lock:
            return dict(self._num_refused)

    def usage(self, limits: Iterable[QuotaLimits]) -> dict[int, QuotaUsage]:
        """Each tenant's usage now, in this process; reading refills nothing (admission does that)."""
        with self._lock:
            now = self._clock()  # type: ignore[operator]
            result = {}
            for tenant in limits:
                state = self._states.get(tenant.tenant_id)
                result[tenant.tenant_id] = quota_usage(
                    tenant,
                    request_tokens=state.request_tokens if state else None,
                    token_tokens=state.token_tokens if state else None,
                    num_in_flight=len(state.in_flight) if state else 0,
                    elapsed_s=now - state.updated_at if state else 0.0,
                )
            return result
