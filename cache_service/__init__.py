"""KV-cache bookkeeping in plain Python: block pool, chained block hashes, per-request block tables.

Nothing here imports torch, and only service.py (the shared CacheService actors) imports Ray, so
it runs and tests anywhere; the device tensors that hold the pages live in `model/`, and the engine
in `cluster/` drives this bookkeeping. Below device memory: page_codec (the page format), tiers
(host RAM, disk), offload (spill and restore), service (the tiers shared by every replica).
"""

from cache_service.block_pool import Block, BlockPool
from cache_service.hashing import BlockHash, hash_block_tokens, root_hash
from cache_service.kv_cache_manager import KVCacheManager

__all__ = ["Block", "BlockHash", "BlockPool", "KVCacheManager", "hash_block_tokens", "root_hash"]
