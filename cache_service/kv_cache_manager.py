"""Per-request block tables on top of the BlockPool, with prefix-cache lookup.

The scheduler asks three things of it, each a pure bookkeeping step:
  find_cached_prefix(id, tokens) -> blocks it can reuse and how many tokens they cover
  allocate_slots(id, num_tokens, cached) -> bool: hold enough blocks for num_tokens, or change nothing
  cache_full_blocks(id, tokens, num_computed) after a step, so later requests can hit them
and free(id) when a request ends or is preempted.

Which of a request's pages come from elsewhere (lower tiers, swap copies, another engine) is
the engine's KV connector's business (cluster/engine/kv_connector.py); this is bookkeeping only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_service.block_pool import Block, BlockPool
from typing import Sequence

from cache_service.hashing import BlockHash, MediaSpan, hash_full_blocks, root_hash


@dataclass(slots=True)
class _RequestBlocks:
    root: BlockHash
    media: Sequence[MediaSpan] = ()
    blocks: list[Block] = field(default_factory=list)
    # Hashes of this request's full blocks, in order, as far as they have been computed.
    hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_identity: str,
        enable_prefix_caching: bool = True,
        lower_tiers: bool = False,
        write_through: bool = False,
    ):
        """lower_tiers: cached blocks go down when they leave device memory (and once when first
        shared), or with write_through every block as soon as it is full and computed, so that a
        crash loses none; the pool records which (BlockPool.take_evicted / take_to_store)."""
        self.block_size = block_size
        self.model_identity = model_identity
        self.pool = BlockPool(num_blocks, enable_prefix_caching, record_evictions=lower_tiers,
                              record_shared=lower_tiers, record_cached=lower_tiers and write_through)
        self._requests: dict[str, _RequestBlocks] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        entry = self._requests.get(request_id)
        return [b.block_id for b in entry.blocks] if entry else []

    def _entry(self, request_id: str, salt: str | None, media: Sequence[MediaSpan]) -> _RequestBlocks:
        entry = self._requests.get(request_id)
        if entry is None:
            entry = self._requests[request_id] = _RequestBlocks(root_hash(self.model_identity, salt), media)
        return entry

    def _extend_hashes(self, entry: _RequestBlocks, token_ids: list[int], num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        if num_full > len(entry.hashes):
            parent = entry.hashes[-1] if entry.hashes else entry.root
            entry.hashes += hash_full_blocks(
                token_ids[: num_full * self.block_size], self.block_size, parent, len(entry.hashes), entry.media
            )

    def find_cached_prefix(
        self, request_id: str, token_ids: list[int], salt: str | None = None, media: Sequence[MediaSpan] = ()
    ) -> tuple[list[Block], int]:
        """The longest run of cached blocks that starts the sequence. The last token is never
        served from the cache: the model must run on at least one token to produce logits.
        salt and media (where the prompt's media placeholders are) join the block hashes."""
        if not self.pool.enable_prefix_caching:
            return [], 0
        entry = self._entry(request_id, salt, media)
        self._extend_hashes(entry, token_ids, len(token_ids) - 1)
        hits: list[Block] = []
        for i, block_hash in enumerate(entry.hashes):
            start = i * self.block_size
            block = self.pool.get_cached_block(block_hash, tuple(token_ids[start : start + self.block_size]))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def block_hashes(self, request_id: str, start: int = 0) -> list[BlockHash]:
        """The hashes of the request's full blocks from block `start` on, as far as the last
        lookup or step got."""
        entry = self._requests.get(request_id)
        return entry.hashes[start:] if entry else []

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once its request is admitted (a request may be looked up again while
        it waits for blocks; those retries are not queries)."""
        self.pool.stats.num_queried_tokens += num_tokens
        self.pool.stats.num_hit_tokens += num_hit_tokens

    def can_allocate_slots(self, request_id: str, num_tokens: int, cached: list[Block] = ()) -> bool:
        entry = self._requests.get(request_id)
        num_held = (len(entry.blocks) if entry else 0) + len(cached)
        num_new = max(0, self.num_blocks_for(num_tokens) - num_held)
        # Cached blocks that sit in the free queue leave it when taken.
        num_taken_from_free = sum(1 for b in cached if b.ref_cnt == 0)
        return num_new + num_taken_from_free <= self.pool.num_free_blocks

    def allocate_slots(
        self, request_id: str, num_tokens: int, cached: list[Block] = (), salt: str | None = None,
        media: Sequence[MediaSpan] = (),
    ) -> bool:
        """Make the request hold blocks for `num_tokens` tokens in all, starting with `cached`
        (only on its first allocation). Returns False, changing nothing, when blocks run short."""
        if not self.can_allocate_slots(request_id, num_tokens, cached):
            return False
        entry = self._entry(request_id, salt, media)
        if cached:
            assert not entry.blocks, "cached prefix blocks are taken on the first allocation only"
            self.pool.touch(list(cached))
            entry.blocks.extend(cached)
            entry.num_cached_blocks = len(cached)
        num_new = self.num_blocks_for(num_tokens) - len(entry.blocks)
        if num_new > 0:
            entry.blocks.extend(self.pool.allocate(num_new))
        return True

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the blocks that are full and whose KV has been computed."""
        entry = self._requests.get(request_id)
        if entry is None or not self.pool.enable_prefix_caching:
            return
        self._extend_hashes(entry, token_ids, num_computed_tokens)
        num_full = min(num_computed_tokens // self.block_size, len(entry.blocks))
        for i in range(entry.num_cached_blocks, num_full):
            start = i * self.block_size
            self.pool.cache_block(
                entry.blocks[i], entry.hashes[i], tuple(token_ids[start : start + self.block_size])
            )
        entry.num_cached_blocks = max(entry.num_cached_blocks, num_full)

    def free(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.pool.free(list(reversed(entry.blocks)))
