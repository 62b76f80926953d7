"""`FairShare`: deficit round robin over tenants, deciding whose waiting request is admitted next.

A visit adds `weight x quantum` to a tenant's deficit; its next request (in the policy's order) is admitted once
the deficit covers its cost, rows x remaining steps. A tenant whose queue empties keeps no credit (DRR's rule).

>>> share = FairShare({"alice": 1.0, "bob": 2.0})
>>> nxt = share.pick({"alice": [r1, r2], "bob": [r3]}); share.charge(nxt)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def request_cost(request: Any) -> float:
    """Row-steps a request will take: its rows in each forward times the steps it has left (at least 1)."""
    return max(request.num_rows * max(request.remaining_steps, 1), 1)


class FairShare:
    """DRR state over tenants (None is a tenant too: requests without one)."""

    def __init__(self, weights: Mapping[str, float] | None = None, default_weight: float = 1.0):
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self.deficit: dict[Any, float] = {}
        self._ring: list[Any] = []  # tenants with a backlog, in visiting order
        self._turn = 0

    def weight(self, tenant: Any) -> float:
        return self.weights.get(tenant, self.default_weight)

    def pick(self, queues: Mapping[Any, Sequence[Any]]) -> Any:
        """The next request to admit: the head of the tenant whose turn it is once its deficit covers it."""
        backlogged = [tenant for tenant, queue in queues.items() if queue]
        if not backlogged:
            return None
        self._sync_ring(backlogged)
        quantum = max(request_cost(queues[tenant][0]) for tenant in backlogged)
        while True:  # NOTE: ends within two rounds: each visit adds at least weight x the largest head cost
            tenant = self._ring[self._turn % len(self._ring)]
            head = queues[tenant][0]
            if self.deficit[tenant] >= request_cost(head):
                return head
            self.deficit[tenant] += self.weight(tenant) * quantum / max(self._min_weight(backlogged), 1e-9)
            self._turn += 1

    def charge(self, request: Any) -> None:
        """`request` was admitted: its tenant's deficit pays for it."""
        tenant = getattr(request, "tenant", None)
        self.deficit[tenant] = self.deficit.get(tenant, 0.0) - request_cost(request)

    def _min_weight(self, tenants: Sequence[Any]) -> float:
        return min(self.weight(tenant) for tenant in tenants)

    def _sync_ring(self, backlogged: Sequence[Any]) -> None:
        current = self._ring[self._turn % len(self._ring)] if self._ring else None
        for tenant in [t for t in self._ring if t not in backlogged]:  # idle: it keeps no credit
            self._ring.remove(tenant)
            self.deficit.pop(tenant, None)
        for tenant in backlogged:
            if tenant not in self._ring:
                self._ring.append(tenant)
                self.deficit[tenant] = 0.0
        self._turn = self._ring.index(current) if current in self._ring else 0
