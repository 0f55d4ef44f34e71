"""Fairness across tenants: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024). Each tenant has a counter of the service it has received, in weighted
tokens; the scheduler admits from the backlogged tenant with the least. A tenant that comes back from
idle is lifted to the least counter among active tenants, so idling earns no credit to spend later."""

from __future__ import annotations

import collections
from collections.abc import Iterable


class VirtualTokenCounter:
    """Per-tenant service counters. A tenant never charged nor lifted has received 0.0."""

    def __init__(self, *, prompt_token_weight: float, output_token_weight: float) -> None:
        # `not >=` also rejects NaN.
        if not (prompt_token_weight >= 0 and output_token_weight >= 0):
            raise ValueError(
                f"token weights must be >= 0, got prompt {prompt_token_weight!r}, "
                f"output {output_token_weight!r}"
            )
        self.prompt_token_weight = prompt_token_weight
        self.output_token_weight = output_token_weight
        self._tenant_to_service: collections.defaultdict[str, float] = collections.defaultdict(float)

    def service_of(self, tenant_id: str) -> float:
        return self._tenant_to_service.get(tenant_id, 0.0)

    def charge_prompt(self, tenant_id: str, num_tokens: int) -> None:
        self._tenant_to_service[tenant_id] += self.prompt_token_weight * num_tokens

    def charge_output(self, tenant_ids: Iterable[str]) -> None:
        """One sampled token per entry of `tenant_ids`: a tenant with three tokens appears three times.
        A whole step's tokens in one call: one call per token measurably slows the scheduler's update()."""
        tenant_to_service = self._tenant_to_service
        weight = self.output_token_weight
        for tenant_id in tenant_ids:
            tenant_to_service[tenant_id] += weight

    def lift(self, tenant_id: str, *, active_tenant_ids: Iterable[str]) -> None:
        """Call when `tenant_id` turns active again (neither waiting nor running before). It starts at
        no less than the least counter among `active_tenant_ids`; with none active it keeps its own."""
        own = self.service_of(tenant_id)
        active = [self.service_of(other) for other in active_tenant_ids]
        self._tenant_to_service[tenant_id] = max(own, min(active)) if active else own

    def least_served(self, tenant_ids: Iterable[str]) -> str:
        """The tenant with the least service; the first of them on a tie. Raises ValueError if empty."""
        return min(tenant_ids, key=self.service_of)
