"""KVConnector: every piece of KV that is not (yet) in a device block, with one owner, keyed by
request id. As vLLM v1 splits its connector, it has two sides:

  scheduler side, counts only:  how many of a request's tokens are ready without compute (pages
      from a lower tier, a swap copy, a prefill engine's KV), which block indices a step installs,
      where computing must stop (the next restorable run);
  worker side, bytes:  the payloads each step writes into blocks (restored pages, imported KV),
      the KV it exports, and copies read out of blocks before they are overwritten (swap copies,
      pages spilled to the lower tiers).

    arrival ──on_add──> prefetch from the tiers (a thread) while the request waits
    admission ──admit / restorable_run──> block indices ──plan──> engine ──take_pages──> payloads
    preemption (swap) ──on_preempt──> block ids ──save_before_step──> a swap copy, held here
    step ran ──on_exported──> parts, handed out with the request's last token (take_exported)

`Request` keeps its own state only; nothing here imports torch (the scheduler calls it).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cache_service import BlockHash, KVCacheManager
from cache_service.offload import KVOffload

if TYPE_CHECKING:
    from cluster.engine.executor import Executor
    from cluster.engine.request import Request
    from model.kv_transfer import KVPart


class SwapSpace(Protocol):
    """Host memory for swap copies, counted in blocks: `take` room for one (False: there is none,
    and the preempted request is recomputed instead), `give_back` once the copy is gone."""

    def take(self, num_blocks: int) -> bool: ...

    def give_back(self, num_blocks: int) -> None: ...


class SwapBudget:
    """A swap space of its own (swap_space_bytes), where this process has no host tier to draw
    from (cache_service/offload.py's HostTierSwapSpace)."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self.used_blocks = 0

    def take(self, num_blocks: int) -> bool:
        if self.used_blocks + num_blocks > self.capacity_blocks:
            return False
        self.used_blocks += num_blocks
        return True

    def give_back(self, num_blocks: int) -> None:
        self.used_blocks -= num_blocks


@dataclass(slots=True)
class _PendingKV:
    # Lower tiers: the pages of the blocks from `first block` on, loading while the request
    # waits (first block, future), taken at admission.
    prefetch: tuple[int, Future] | None = None
    prefetch_taken: bool = False
    # Loaded pages not yet installed (a tier's, or a swap copy's): block index -> payload.
    pages: dict[int, bytes] = field(default_factory=dict)
    swapped_tokens: int | None = None  # a swap copy covers this many tokens (its last block partly)
    swap_out: list[int] | None = None  # block ids to copy before the step (preempted with swap)
    swap_blocks: int = 0  # taken from the swap space for that copy
    # Disaggregation, decode side: the prompt's KV from a prefill engine, installed on admission
    # from the first position the prefix cache did not have.
    imported: list[KVPart] | None = None
    import_from: int = 0
    # Prefill side: the KV exported so far, and up to which position.
    exporting: bool = False
    exported: list[KVPart] = field(default_factory=list)
    num_exported_tokens: int = 0


class KVConnector:
    def __init__(self, kv_cache: KVCacheManager, offload: KVOffload | None, executor: Executor,
                 swap_space: SwapSpace | None = None, prefetch: bool = True):
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.offload = offload  # the tiers below device memory, if any
        self.executor = executor
        self.swap_space = swap_space or SwapBudget(0)
        self.prefetch_enabled = prefetch and offload is not None and kv_cache.pool.enable_prefix_caching
        self.num_swapped_in = 0  # preempted requests that came back from their swap copy
        self._pending: dict[str, _PendingKV] = {}

    def _get(self, request_id: str) -> _PendingKV:
        pending = self._pending.get(request_id)
        if pending is None:
            pending = self._pending[request_id] = _PendingKV()
        return pending

    # ---- scheduler side: counts ----------------------------------------------------------

    def on_add(self, request: Request, imported: list[KVPart] | None = None, export: bool = False) -> None:
        """A request arrived: with KV from a prefill engine (`imported`), exporting its own
        (`export`), or else its prefix starts loading from the lower tiers while it waits."""
        if imported is not None or export:
            pending = self._get(request.request_id)
            pending.imported, pending.exporting = imported, export
        if self.prefetch_enabled and imported is None:
            cached, _ = self.kv_cache.find_cached_prefix(
                request.request_id, request.token_ids, request.salt, request.media_segments)
            hashes = self.kv_cache.block_hashes(request.request_id, start=len(cached))
            self._get(request.request_id).prefetch = (len(cached), self.offload.prefetch(hashes))

    def admit(self, request: Request, num_device_blocks: int) -> tuple[list[int], int]:
        """A waiting request whose first `num_device_blocks` blocks are in device memory: the
        block indices this step would install and the tokens ready without compute. Asking again
        (it may wait for blocks over several steps) gives the same answer."""
        pending = self._pending.get(request.request_id)
        num_cached = num_device_blocks * self.block_size
        if pending is not None and pending.imported is not None:
            return [], max(num_cached, request.num_prompt_tokens)
        if pending is not None and pending.swapped_tokens is not None:  # its last block may be partial
            return self.restorable_run(request.request_id, num_cached), max(num_cached, pending.swapped_tokens)
        self._load_offloaded(request.request_id, num_device_blocks)
        run = self.restorable_run(request.request_id, num_cached)
        return run, num_cached + len(run) * self.block_size

    def _load_offloaded(self, request_id: str, num_device_blocks: int) -> None:
        """Hold the pages that the lower tiers have of the blocks after the device hit (checked),
        from the request's prefetch when it started at the same block."""
        if self.offload is None or not self.kv_cache.pool.enable_prefix_caching:
            return
        pending = self._get(request_id)
        if pending.prefetch is not None and pending.prefetch[0] == num_device_blocks:
            future = pending.prefetch[1]
            # an earlier attempt to admit it may have taken it already (it ran out of blocks)
            payloads = future.result() if pending.prefetch_taken else self.offload.take_prefetched(future)
        else:
            if pending.prefetch is not None:
                self.offload.stats.prefetch_stale += 1
            payloads = self.offload.load_now(self.kv_cache.block_hashes(request_id, start=num_device_blocks))
            future = Future()
            future.set_result(payloads)
        pending.prefetch, pending.prefetch_taken = (num_device_blocks, future), True
        pending.pages = {num_device_blocks + i: p for i, p in enumerate(payloads) if p is not None}

    def restorable_run(self, request_id: str, num_computed_tokens: int) -> list[int]:
        """Block indices of the held pages that continue the request from num_computed_tokens
        without a gap; empty unless that is a block boundary."""
        pending = self._pending.get(request_id)
        if pending is None or not pending.pages or num_computed_tokens % self.block_size:
            return []
        run, index = [], num_computed_tokens // self.block_size
        while index in pending.pages:
            run.append(index)
            index += 1
        return run

    def next_restorable_token(self, request_id: str, num_tokens: int) -> int | None:
        """The first token at or after num_tokens that a held page covers (where computing stops)."""
        pending = self._pending.get(request_id)
        starts = [i * self.block_size for i in pending.pages if i * self.block_size >= num_tokens] if pending else []
        return min(starts, default=None)

    def on_admitted(self, request_id: str, run: list[int], num_device_tokens: int) -> None:
        """The request was admitted with `run` to install (its pages wait for `take_pages`) and
        `num_device_tokens` in the prefix cache: an import starts after those, and a swap copy is
        used up (its blocks before the run were in device memory still)."""
        pending = self._pending.get(request_id)
        if pending is None:
            return
        pending.prefetch = None
        pending.import_from = num_device_tokens
        if pending.swapped_tokens is not None:
            pending.swapped_tokens, pending.pages = None, {i: pending.pages[i] for i in run}
            self._drop_swap_copy(pending)
            self.num_swapped_in += 1

    def on_preempt(self, request: Request, num_computed_blocks: int, swap: bool) -> None:
        """The request lost its blocks and starts again from 0: what it held is dropped (an import
        too: the prefix is recomputed here). With `swap`, its computed blocks are copied to host
        memory before this step overwrites them, if the swap space has room."""
        pending = self._get(request.request_id)
        pending.prefetch, pending.pages, pending.imported = None, {}, None
        pending.swapped_tokens = None
        self._drop_swap_copy(pending)
        if swap and num_computed_blocks > 0 and self.swap_space.take(num_computed_blocks):
            pending.swap_out = self.kv_cache.block_ids(request.request_id)[:num_computed_blocks]
            pending.swapped_tokens, pending.swap_blocks = request.num_computed_tokens, num_computed_blocks

    def _drop_swap_copy(self, pending: _PendingKV) -> None:
        self.swap_space.give_back(pending.swap_blocks)
        pending.swap_blocks = 0

    @property
    def num_swapped_blocks(self) -> int:
        """Blocks that preempted requests hold in host memory now (or will, after this step)."""
        return sum(p.swap_blocks for p in list(self._pending.values()))

    def free(self, request_id: str) -> None:
        """The request ended: whatever it held goes (swap copy, loaded pages, parts)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._drop_swap_copy(pending)

    # ---- worker side: bytes --------------------------------------------------------------

    def save_before_step(self) -> None:
        """Copy out of device blocks what this step's new contents would overwrite: swap copies
        of the requests just preempted, and cached blocks handed out anew (spilled down)."""
        for pending in self._pending.values():
            if pending.swap_out is not None:
                pending.pages = dict(enumerate(self.executor.read_blocks(pending.swap_out)))
                pending.swap_out = None
        if self.offload is not None:
            self.spill(self.kv_cache.pool.take_evicted())

    def store_shared(self) -> None:
        """After a step: blocks first shared (and, write-through, just filled) go down once."""
        if self.offload is not None:
            self.spill(self.kv_cache.pool.take_to_store())

    def spill(self, cached: list[tuple[int, BlockHash]]) -> int:
        """(block id, block hash) of cached blocks: their KV, copied now, goes to the lower tiers
        (written in the background)."""
        if cached:
            payloads = self.executor.read_blocks([block_id for block_id, _ in cached])
            self.offload.spill([(block_hash, payload) for (_, block_hash), payload in zip(cached, payloads)])
        return len(cached)

    def take_pages(self, request_id: str, run: list[int]) -> list[bytes]:
        """The payloads of the planned run's blocks, for the step that writes them in."""
        pending = self._pending.get(request_id)
        return [pending.pages.pop(index) for index in run] if run else []

    def take_import(self, request_id: str) -> tuple[list[KVPart], int] | None:
        """A prefill engine's KV for this request's first step (then dropped), and the first
        position to install (before it, the prefix cache had the KV)."""
        pending = self._pending.get(request_id)
        if pending is None or pending.imported is None:
            return None
        imported, pending.imported = pending.imported, None
        return imported, pending.import_from

    def export_from(self, request_id: str) -> int | None:
        """The first position whose KV this step exports (from 0 on the first chunk: a prefix-cache
        hit must travel too); None for a request that does not export."""
        pending = self._pending.get(request_id)
        return pending.num_exported_tokens if pending is not None and pending.exporting else None

    def on_exported(self, request_id: str, parts: list[KVPart], num_computed_tokens: int) -> None:
        pending = self._pending.get(request_id)
        if pending is not None and pending.exporting:
            pending.exported += parts
            pending.num_exported_tokens = num_computed_tokens

    def take_exported(self, request_id: str) -> list[KVPart] | None:
        """An exporting request's parts (its last token was sampled); None if it does not export."""
        pending = self._pending.get(request_id)
        return pending.exported if pending is not None and pending.exporting else None
