"""Iteration-level scheduler: each step, a plan of which requests run and how many tokens each.

There is no prefill phase and decode phase. Every request wants `num_tokens - num_computed_tokens`
more tokens computed; a step grants them under a token budget (max_num_batched_tokens) and a
sequence cap (max_num_seqs), running requests first, oldest first, then waiting ones in arrival
order. A long prompt therefore prefills in chunks alongside other requests' decodes.

KV that needs no compute (pages from a lower tier, a swap copy, a prefill engine's import) only
needs blocks: the KV connector says how many tokens are ready and which block indices a step
installs (`ScheduledRequest.restore`); the step jumps num_computed_tokens over them. A request
computes up to the next such run, so a block that no tier held is recomputed and the blocks after
it are still restored. The scheduler deals in counts and block indices only, never in bytes.

When blocks run out for a running request, the newest running request is preempted (its blocks
freed) until the older one fits. With preemption_mode "recompute" it starts again later, mostly
from the prefix cache; with "swap" the connector copies its KV to host memory before the step and
it comes back from there. No new request is admitted in a step that ran out of blocks.

Between tenants (Request.tenant, weighted), waiting requests are admitted by fair share, not by
arrival (cluster/engine/fair_share.py; tenant_scheduling "fair"), and a full batch gives up one
seat per step to a tenant below its share.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cache_service import KVCacheManager
from cluster.engine.fair_share import FairShares
from cluster.engine.kv_connector import KVConnector
from cluster.engine.request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # block indices whose pages (held by the KV connector) this step writes in before it runs
    restore: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step catches the request up, so the model samples its next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, kv_connector: KVConnector, max_num_batched_tokens: int,
                 max_num_seqs: int, preemption_mode: str = "recompute", tenant_scheduling: str = "fair"):
        self.kv_cache = kv_cache
        self.kv_connector = kv_connector
        self.swap = preemption_mode == "swap"
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.shares = FairShares() if tenant_scheduling == "fair" else None  # None: first come, first served

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        if self.shares is not None:
            self.shares.join(request, (*self.waiting, *self.running))
        self.waiting.append(request)

    def schedule(self) -> SchedulerPlan:
        plan = SchedulerPlan()
        budget = self.max_num_batched_tokens
        self._give_a_seat(plan)
        out_of_blocks = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            restore = self.kv_connector.restorable_run(request.request_id, request.num_computed_tokens)
            num_ready = request.num_computed_tokens + len(restore) * self.kv_cache.block_size
            num_new = self._num_new_tokens(request, num_ready, budget)
            while not self.kv_cache.allocate_slots(request.request_id, num_ready + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                out_of_blocks = True
                if victim is request:
                    break
            else:
                request.num_computed_tokens = num_ready
                self._schedule(plan, request, num_new, restore)
                budget -= num_new
                i += 1
        if out_of_blocks:
            return plan

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._next_waiting()
            cached, num_cached = self.kv_cache.find_cached_prefix(
                request.request_id, request.token_ids, request.salt, request.media_segments)
            # KV imported from a prefill engine, swapped out at preemption, or restored from a
            # lower tier needs no compute, only blocks (written in before the step).
            restore, num_ready = self.kv_connector.admit(request, len(cached))
            num_new = self._num_new_tokens(request, num_ready, budget)
            if not self.kv_cache.allocate_slots(request.request_id, num_ready + num_new, cached, request.salt,
                                             request.media_segments):
                break
            self.kv_cache.record_prefix_lookup(request.num_tokens, num_cached)
            self.kv_connector.on_admitted(request.request_id, restore, num_device_tokens=num_cached)
            self.waiting.remove(request)
            if request.num_preemptions == 0 and not request.num_cached_tokens:
                request.num_cached_tokens = min(num_ready, request.num_prompt_tokens)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_ready
            self.running.append(request)
            self._schedule(plan, request, num_new, restore)
            budget -= num_new
        return plan

    def _schedule(self, plan: SchedulerPlan, request: Request, num_new: int, restore: list[int]) -> None:
        plan.scheduled.append(ScheduledRequest(request, num_new, restore))
        if self.shares is not None:
            self.shares.charge(request, num_new)

    def _next_waiting(self) -> Request:
        return self.waiting[0] if self.shares is None else self.shares.next_waiting(self.waiting, self.running)

    def _give_a_seat(self, plan: SchedulerPlan) -> None:
        """A full batch and a waiting tenant below its share of seats: the newest running request
        of the tenant furthest over its share makes way (one per step)."""
        if self.shares is None or not self.waiting or len(self.running) < self.max_num_seqs:
            return
        victim = self.shares.seat_for(self._next_waiting(), self.running, self.waiting, self.max_num_seqs)
        if victim is not None:
            self.running.remove(victim)
            self._preempt(victim)
            plan.preempted.append(victim)

    def _num_new_tokens(self, request: Request, num_ready: int, budget: int) -> int:
        """Tokens to compute this step: up to the end, the budget, or the next run of pages that
        needs no compute (a later step installs it)."""
        end = request.num_tokens
        next_restorable = self.kv_connector.next_restorable_token(request.request_id, num_ready)
        if next_restorable is not None:
            end = min(end, next_restorable)
        return min(end - num_ready, budget)

    def update(self, plan: SchedulerPlan) -> None:
        """After the workers ran the plan: advance computed counts and cache the blocks that
        filled up. Finishing is the engine's call (it appends tokens first), via `finish`."""
        for s in plan.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            self.kv_cache.cache_full_blocks(request.request_id, request.token_ids, request.num_computed_tokens)

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)
        self.kv_connector.free(request.request_id)  # a swap copy's host memory goes now
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _preempt(self, request: Request) -> None:
        # with swap, the connector copies its blocks before the step (recomputed if swap space is full)
        self.kv_connector.on_preempt(request, self.kv_cache.num_blocks_for(request.num_computed_tokens), self.swap)
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

