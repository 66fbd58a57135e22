"""The KV cache below the model, in two halves.

Device-block bookkeeping: block_pool (ids, ref counts, LRU free queue, prefix cache), hashing
(chained block hashes), kv_cache_manager (per-request block tables). Below device memory:
page_codec (the page format), tiers (host RAM, disk; the `Tier` interface), offload (spill,
prefetch, restore), service (the tiers shared by every replica, as Ray actors).

Nothing here imports torch, and only service.py imports Ray, so it runs and tests anywhere; the
device tensors that hold the pages live in `model/`, and the engine in `cluster/` drives this.
"""

from cache_service.block_pool import Block, BlockPool
from cache_service.hashing import BlockHash, hash_block_tokens, root_hash
from cache_service.kv_cache_manager import KVCacheManager

__all__ = ["Block", "BlockHash", "BlockPool", "KVCacheManager", "hash_block_tokens", "root_hash"]
