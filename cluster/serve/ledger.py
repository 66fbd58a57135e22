"""TenantLedger: the one place that knows every tenant's running requests and spent compute units,
whichever ingress replica took them (a Serve deployment of one replica, beside the ingress).

    Ingress replica ── admit(tenant, request_id, size) ──> TenantLedger
                    <── Admission: max_tokens under the tenant's caps, or why not (429 / 400 / 409)
                    ── finish(usage) ──> charged to the rolling window, appended to the usage log,
                                         counted in Prometheus (per tenant)
    a client's cancel(request_id), at any ingress replica ──> TenantLedger ──> the replica running
        it, which waits on next_cancellations() (one long poll per replica, not per request)

Compute units are deterministic: prompt tokens, output tokens and media items at their prices
(ComputeUnitPrices). A request is admitted only if it can produce at least one token within the
tenant's caps; its max_tokens is lowered to what its per-request cap and the budget left allow,
and that much is reserved until it ends, so a budget is never overspent by requests running
together. It is charged for what it consumed: its prompt once it produced anything, and the tokens
it produced.

Request ids are scoped by tenant: (tenant, request_id) names a request, so a tenant sees and
cancels only its own, and two tenants may use the same id.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass, field

from cluster.serve.tenants import ComputeUnitPrices, TenantConfig, TenantsFile
from cluster.serve.usage_log import UsageLog, read_usage

logger = logging.getLogger("pagoda.ledger")

# An ingress replica that has not polled for cancellations this long is gone (Serve replaced
# it): its requests no longer hold their tenants' concurrency places or reservations.
POLL_TIMEOUT_S = 20.0
REPLICA_GONE_AFTER_S = 3 * POLL_TIMEOUT_S
# When a budget is held by requests still running (reserved, not yet charged), when to look again.
RETRY_WHILE_RESERVED_S = 1


@dataclass(frozen=True, slots=True)
class RequestSize:
    prompt_tokens: int
    media_items: int
    n: int
    max_tokens: int | None  # per candidate; None: up to the model's context


@dataclass(frozen=True, slots=True)
class Admission:
    """admit()'s answer: admitted with `max_tokens`, or refused (`refusal` says why)."""

    max_tokens: int | None = None
    # The compute units this request may cost at most, when a cap or the budget lowered max_tokens.
    units_limit: float | None = None
    refusal: str | None = None  # "quota" (429), "too_large" (400), "duplicate" (409)
    reason: str = ""
    retry_after_s: float | None = None


@dataclass(slots=True)
class Usage:
    """What one request consumed (counted by the ingress from its deltas)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    media_items: int = 0

    def units(self, prices: ComputeUnitPrices) -> float:
        return prices.units(self.prompt_tokens, self.output_tokens, self.media_items)


@dataclass(slots=True)
class RequestMeter:
    """One request's count of what it consumed, kept by the ingress as its deltas pass, and what
    its usage reports beyond tokens."""

    prices: ComputeUnitPrices
    media_items: int
    units_limit: float | None = None  # set when a cap or the budget lowered max_tokens
    usage: Usage = field(default_factory=Usage)

    def count(self, delta) -> None:
        if not self.usage.prompt_tokens:  # the prompt (and its media) is consumed once it ran
            self.usage.prompt_tokens, self.usage.cached_tokens = delta.num_prompt_tokens, delta.num_cached_tokens
            self.usage.media_items = self.media_items
        self.usage.output_tokens += len(delta.new_token_ids)

    @property
    def compute_units(self) -> float:
        return self.usage.units(self.prices)


@dataclass(slots=True)
class _Running:
    replica: str
    reserved: float
    created: float  # wall-clock time


@dataclass(slots=True)
class _Replica:
    last_seen: float = field(default_factory=time.monotonic)
    cancelled: list = field(default_factory=list)  # (tenant, request_id) to stop
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class TenantLedger:
    def __init__(self, tenants: TenantsFile | None = None, usage_log: str | None = None):
        self.prices: ComputeUnitPrices = tenants.compute_units if tenants else ComputeUnitPrices()
        self.limits: dict[str, TenantConfig] = dict(tenants.tenants) if tenants else {}
        self.running: dict[str, dict[str, _Running]] = collections.defaultdict(dict)
        self.charges: dict[str, collections.deque] = collections.defaultdict(collections.deque)  # (time, units)
        self.spent: dict[str, float] = collections.defaultdict(float)  # the sum of each tenant's charges
        self.replicas: dict[str, _Replica] = {}
        self.log = UsageLog(usage_log) if usage_log else None
        if usage_log:
            self._replay(usage_log)
        from cluster.serve.metrics import TenantMetrics

        self.metrics = TenantMetrics()

    def _replay(self, path: str) -> None:
        """The charges still inside their tenants' windows, from the log of an earlier run."""
        now = time.time()
        for record in read_usage(path):
            budget = self._budget(record.get("tenant") or "")
            if budget is not None and record["time"] > now - budget.window_s and record["compute_units"] > 0:
                self._charge(record["tenant"], record["time"], record["compute_units"])

    # ---- admission -------------------------------------------------------------------------

    async def admit(self, tenant: str | None, request_id: str, replica: str, size: RequestSize) -> Admission:
        tenant = tenant or ""
        self._forget_gone_replicas()
        self.replicas.setdefault(replica, _Replica()).last_seen = time.monotonic()
        running = self.running[tenant]
        if request_id in running:
            return Admission(refusal="duplicate", reason=f"a request with id {request_id!r} is already running")
        admission = self._within_limits(tenant, size)
        if admission.refusal is not None:
            self.metrics.refused(tenant, admission.refusal)
            return admission
        reserved = self.prices.units(size.prompt_tokens, size.n * (admission.max_tokens or 0), size.media_items)
        running[request_id] = _Running(replica, reserved, time.time())
        return admission

    def _within_limits(self, tenant: str, size: RequestSize) -> Admission:
        limits = self.limits.get(tenant)
        if limits is None:  # an open server
            return Admission(max_tokens=size.max_tokens)
        fixed = self.prices.units(size.prompt_tokens, 0, size.media_items)
        per_token = self.prices.output_token * size.n  # one more token of every candidate
        # A request that no wait would let run is a client error (400), before any 429.
        for name, most in (("max_units_per_request", limits.max_units_per_request),
                           ("budget", limits.budget.units if limits.budget else None)):
            if most is not None and fixed + per_token > most:
                return Admission(refusal="too_large", reason=(
                    f"the prompt costs {fixed:g} compute units and each output token {per_token:g}; "
                    f"the tenant's {name} is {most:g}"))
        running = self.running[tenant]
        if limits.max_concurrent_requests is not None and len(running) >= limits.max_concurrent_requests:
            return Admission(refusal="quota", retry_after_s=RETRY_WHILE_RESERVED_S,
                             reason=f"tenant {tenant} has {len(running)} requests running, its limit")
        allowed = limits.max_units_per_request or math.inf
        if limits.budget is not None:
            available = limits.budget.units - self._spent(tenant, limits) - sum(r.reserved for r in running.values())
            if fixed + per_token > available:
                return Admission(refusal="quota", retry_after_s=self._retry_after(tenant, limits, fixed + per_token - available),
                                 reason=(f"tenant {tenant} has {max(available, 0):g} of its {limits.budget.units:g} "
                                         f"compute units per {limits.budget.window_s:g} s left; this request needs "
                                         f"{fixed + per_token:g}"))
            allowed = min(allowed, available)
        if math.isinf(allowed) or per_token == 0:
            return Admission(max_tokens=size.max_tokens)
        most = int((allowed - fixed) / per_token + 1e-9)
        if size.max_tokens is not None and size.max_tokens <= most:
            return Admission(max_tokens=size.max_tokens)
        return Admission(max_tokens=most, units_limit=fixed + per_token * most)

    def _budget(self, tenant: str):
        limits = self.limits.get(tenant)
        return limits.budget if limits is not None else None

    def _charge(self, tenant: str, at: float, units: float) -> None:
        self.charges[tenant].append((at, units))
        self.spent[tenant] += units

    def _spent(self, tenant: str, limits: TenantConfig) -> float:
        """The tenant's charges inside its window (older ones leave it here)."""
        charges, since = self.charges[tenant], time.time() - limits.budget.window_s
        while charges and charges[0][0] <= since:
            self.spent[tenant] -= charges.popleft()[1]
        return self.spent[tenant]

    def _retry_after(self, tenant: str, limits: TenantConfig, shortfall: float) -> float:
        """Seconds until enough of the tenant's charges leave the window to cover `shortfall`."""
        freed, now = 0.0, time.time()
        for at, units in self.charges[tenant]:
            freed += units
            if freed >= shortfall:
                return max(1, math.ceil(at + limits.budget.window_s - now))
        return RETRY_WHILE_RESERVED_S  # the rest is reserved by running requests

    # ---- the end of a request --------------------------------------------------------------

    async def finish(self, tenant: str | None, request_id: str, usage: Usage, outcome: str) -> float:
        """Charge, log and count a request that ended; returns its compute units."""
        tenant = tenant or ""
        entry = self.running[tenant].pop(request_id, None)
        units = usage.units(self.prices)
        now = time.time()
        if units > 0 and self._budget(tenant) is not None:
            self._charge(tenant, now, units)
        if self.log is not None:
            self.log.append({"time": round(now, 3), "tenant": tenant or None, "request_id": request_id,
                             "replica": entry.replica if entry else None, "prompt_tokens": usage.prompt_tokens,
                             "cached_tokens": usage.cached_tokens, "output_tokens": usage.output_tokens,
                             "media_items": usage.media_items, "compute_units": units, "outcome": outcome})
        self.metrics.finished(tenant, usage, units, outcome)
        return units

    # ---- seeing and cancelling one's own requests ------------------------------------------

    async def requests(self, tenant: str | None) -> list[dict]:
        """The tenant's running requests, oldest first."""
        entries = sorted(self.running[tenant or ""].items(), key=lambda item: item[1].created)
        return [{"id": request_id, "created": int(entry.created)} for request_id, entry in entries]

    async def cancel(self, tenant: str | None, request_id: str) -> bool:
        """Stop the tenant's request `request_id`; False when the tenant runs none of that id."""
        entry = self.running[tenant or ""].get(request_id)
        if entry is None:
            return False
        replica = self.replicas.setdefault(entry.replica, _Replica())
        replica.cancelled.append((tenant or "", request_id))
        replica.wake.set()
        return True

    async def next_cancellations(self, replica: str) -> list[tuple[str, str]]:
        """(tenant, request_id) of this replica's requests that their tenants cancelled; waits up
        to POLL_TIMEOUT_S for one. Also this replica's sign of life."""
        state = self.replicas.setdefault(replica, _Replica())
        state.last_seen = time.monotonic()
        if not state.cancelled:
            state.wake.clear()
            try:
                await asyncio.wait_for(state.wake.wait(), POLL_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
        state.last_seen = time.monotonic()
        cancelled, state.cancelled = state.cancelled, []
        return cancelled

    def _forget_gone_replicas(self) -> None:
        now = time.monotonic()
        gone = {name for name, state in self.replicas.items() if now - state.last_seen > REPLICA_GONE_AFTER_S}
        if not gone:
            return
        for tenant, running in self.running.items():
            for request_id in [rid for rid, entry in running.items() if entry.replica in gone]:
                logger.warning("forgetting request %s of tenant %r: its ingress replica is gone", request_id, tenant)
                del running[request_id]
        for name in gone:
            del self.replicas[name]
