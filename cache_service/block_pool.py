"""The pool of KV blocks: ids, reference counts, an LRU free queue and the prefix cache.

    allocate ──> in use (ref_cnt > 0) ──free──> free queue (LRU order, hash kept)
                        ^                          │        │
                        └──────── touch (hit) ─────┘        └─ allocate again: evict its hash

A freed block keeps its contents and its hash, so a later request with the same prefix can take it
back (`touch`) until it is handed out for something else; the free queue hands out the least
recently freed block first. Ref counts let many requests share one cached block.

With lower tiers, the pool also says which blocks to copy down (`take_evicted`, `take_to_store`):
a cached block when it is evicted, and before that, once, when a prefix hit first shares it (a
system prompt is shared by every chat and so never evicted; a crash or a new replica must still
find it below) or, with write-through, as soon as it is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cache_service.hashing import BlockHash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # The token ids the block holds once it is full and cached: a hit compares them, so a hash
    # collision can never serve the wrong page.
    token_ids: tuple[int, ...] | None = None
    stored_below: bool = False  # its contents were handed to the lower tiers (reset when evicted)


@dataclass(slots=True)
class PrefixCacheStats:
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True, record_evictions: bool = False,
                 record_shared: bool = False, record_cached: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> None, oldest freed first; an OrderedDict gives O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.stats = PrefixCacheStats()
        # With lower tiers: cached blocks handed out for new contents since the last
        # take_evicted(); the engine copies them down before the step overwrites them.
        self.record_evictions = record_evictions
        self._evicted: list[tuple[int, BlockHash]] = []
        # Blocks for the engine to copy down now: cached blocks on their first hit (record_shared),
        # every block as it is cached (record_cached: write-through).
        self.record_shared = record_shared
        self.record_cached = record_cached
        self._to_store: list[tuple[int, BlockHash]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> Block | None:
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids else None

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[Block]:
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            stored_below = block.stored_below
            evicted = self._evict(block)
            if evicted is not None and self.record_evictions and not stored_below:
                self._evicted.append((block_id, evicted))
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
            if self.record_shared:
                self._store(block)

    def free(self, blocks: list[Block]) -> None:
        """Drop a reference. Pass a request's blocks tail first: the tail of a prefix is then
        evicted before its head, which more requests share."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_block(self, block: Block, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Register a full block under its hash. If an equal block is cached already, the first
        one stays the one that hits; this one is freed as an ordinary block later."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block.block_id
        if self.record_cached:
            self._store(block)

    def _store(self, block: Block) -> None:
        if not block.stored_below and block.block_hash is not None:
            block.stored_below = True
            self._to_store.append((block.block_id, block.block_hash))

    def take_to_store(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the cached blocks to copy down since the last call: first shared
        ones, and with write-through every newly cached one. Each block once while it holds its
        contents (an eviction then does not copy it again)."""
        blocks, self._to_store = self._to_store, []
        return blocks

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the cached blocks allocated anew since the last call."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _evict(self, block: Block) -> BlockHash | None:
        """Drop the block's hash; returns it when the block was the cached copy of that hash."""
        block_hash = block.block_hash
        if block_hash is None:
            return None
        block.block_hash = None
        block.token_ids = None
        block.stored_below = False
        if self._cached.get(block_hash) == block.block_id:
            del self._cached[block_hash]
            self.stats.num_evicted_blocks += 1
            return block_hash
        return None
