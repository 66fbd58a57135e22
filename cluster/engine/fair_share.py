"""Weighted fair shares of one engine among tenants (tenant_scheduling: fair).

Each tenant has a virtual service: the tokens the engine computed for it divided by its weight.
Under contention the waiting request admitted next is the oldest one of the tenant with the least
virtual service, so a tenant that floods the engine is served after the others, each tenant in
proportion to its weight, whatever the arrival order. A tenant that was idle starts level with
the least-served active tenant instead of with the credit of its idle time (start-time fair
queueing), so it cannot take the engine over when it comes back.

Seats (max_num_seqs) are shared the same way: when the running batch is full and the next
waiting request's tenant holds fewer seats than its share (max_num_seqs x its weight / the active
tenants' weights), the newest running request of the tenant furthest over its share gives up its
seat (preempted: recomputed later, mostly from the prefix cache). Without that, a light tenant's
request would wait for one of the flooding tenant's requests to finish.

With one tenant (or none named) this is first come, first served, exactly.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from cluster.engine.request import Request


class FairShares:
    def __init__(self):
        self.service: dict[str | None, float] = {}  # virtual service of each tenant seen

    def join(self, request: Request, active: Sequence[Request]) -> None:
        """A request arrives; `active` are the requests the engine holds (waiting or running)."""
        levels = [self.service.get(r.tenant, 0.0) for r in active if r.tenant != request.tenant]
        own = [r for r in active if r.tenant == request.tenant]
        if not own:  # (re)joining: level with the least-served active tenant, never below its past
            self.service[request.tenant] = max(self.service.get(request.tenant, 0.0), min(levels, default=0.0))

    def charge(self, request: Request, num_tokens: int) -> None:
        self.service[request.tenant] = self.service.get(request.tenant, 0.0) + num_tokens / request.weight

    def next_waiting(self, waiting: Iterable[Request], running: list[Request]) -> Request:
        """The oldest waiting request of the least-served tenant (a preempted request, which
        went back to the front, is its tenant's oldest); between equals, the tenant running
        fewer requests, then the earlier arrival."""
        first: dict[str | None, Request] = {}
        for request in waiting:
            first.setdefault(request.tenant, request)
        seats = Counter(r.tenant for r in running)
        return min(first.values(), key=lambda r: (self.service.get(r.tenant, 0.0), seats[r.tenant]))

    def seat_for(self, request: Request, running: list[Request], waiting: Iterable[Request],
                 max_num_seqs: int) -> Request | None:
        """The running request that gives `request` its seat, or None when its tenant holds its
        share already (or no tenant is over its share)."""
        seats = Counter(r.tenant for r in running)
        weights = {r.tenant: r.weight for r in (*running, *waiting)}
        total = sum(weights.values())

        def share(tenant) -> float:
            return max_num_seqs * weights[tenant] / total

        if seats[request.tenant] >= share(request.tenant):
            return None
        over = max(seats, key=lambda t: seats[t] - share(t))
        if over == request.tenant or seats[over] <= share(over):
            return None
        return next(r for r in reversed(running) if r.tenant == over)  # its newest
