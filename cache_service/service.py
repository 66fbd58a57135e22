"""The shared cache-service tier: CacheService Ray actors, sharded by block hash, each holding a
host-RAM tier and a disk tier. Every engine replica of a model talks to the same shards (they are
named after the model identity), so a block spilled by one replica is a hit for another, and the
pages outlive any one replica.

    engine ──KVOffload──> SharedTier (this process): keys grouped by shard, one call per shard
                              └──> CacheService shard k (a Ray actor): HostTier + DiskTier

Pages travel whole and checked end to end: the engine's KVOffload verifies every page it reads.
"""

from __future__ import annotations

import hashlib

import ray

from cache_service import page_codec
from cache_service.tiers import TierStats, build_tiers

NAMESPACE = "pagoda"


class CacheService:
    """One shard. Plain class; `shared_tier` runs it as a detached Ray actor."""

    def __init__(self, identity: dict, host_bytes: int, disk_bytes: int, directory: str | None):
        self.tiers = build_tiers(identity, host_bytes, disk_bytes, directory)

    def contains(self, keys: list[bytes]) -> list[bool]:
        found = [False] * len(keys)
        for tier in self.tiers:
            found = [f or c for f, c in zip(found, tier.contains(keys))]
        return found

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        """Each key's page from the fastest tier that has it (a disk hit is promoted to host)."""
        pages = []
        for key in keys:
            page = None
            for i, tier in enumerate(self.tiers):
                page = tier.get(key)
                if page is not None:
                    for faster in self.tiers[:i]:
                        faster.put(key, page)
                    break
            pages.append(page)
        return pages

    def put(self, pages: list[tuple[bytes, bytes]]) -> int:
        return max(tier.put_many(pages) for tier in self.tiers)  # a batch per tier (one directory fsync)

    def reject(self, key: bytes, reason: str) -> None:
        for tier in self.tiers:
            if tier.contains([key])[0]:
                tier.reject(key, reason)

    def describe(self) -> dict:
        return {t.name: t.describe() for t in self.tiers}


class SharedTier:
    """The tier interface (tiers.py) over the CacheService shards, batching per shard."""

    name = "service"
    outlives_process = True  # detached actors

    def __init__(self, shards: list):
        self.shards = shards
        self.stats = TierStats()

    def _by_shard(self, keys: list[bytes]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key[0] % len(self.shards), []).append(i)
        return groups

    def _gather(self, method: str, keys: list[bytes]) -> list:
        groups = self._by_shard(keys)
        refs = {s: getattr(self.shards[s], method).remote([keys[i] for i in idx]) for s, idx in groups.items()}
        results: list = [None] * len(keys)
        for s, values in zip(refs, ray.get(list(refs.values()))):
            for i, value in zip(groups[s], values):
                results[i] = value
        return results

    def contains(self, keys: list[bytes]) -> list[bool]:
        return self._gather("contains", keys) if keys else []

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        pages = self._gather("get", keys) if keys else []
        hits = sum(p is not None for p in pages)
        self.stats.hits += hits
        self.stats.misses += len(pages) - hits
        return pages

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def put_many(self, pages: list[tuple[bytes, bytes]]) -> int:
        groups = self._by_shard([key for key, _ in pages])
        stored = sum(ray.get([self.shards[s].put.remote([pages[i] for i in idx]) for s, idx in groups.items()]))
        self.stats.puts += stored
        return stored

    def put(self, key: bytes, page: bytes) -> bool:
        return self.put_many([(key, page)]) == 1

    def reject(self, key: bytes, reason: str) -> None:
        self.stats.bad_pages[reason] = self.stats.bad_pages.get(reason, 0) + 1
        self.shards[key[0] % len(self.shards)].reject.remote(key, reason)

    def describe_shards(self) -> list[dict]:
        return ray.get([shard.describe.remote() for shard in self.shards])

    def describe(self) -> dict:
        """This engine's view (hits, misses, puts) and each shard's tiers."""
        return {**self.stats.as_dict(), "shards": self.describe_shards()}


def shared_tier(identity: dict, num_shards: int, host_bytes: int, disk_bytes: int, directory: str | None) -> SharedTier:
    """The model's CacheService shards, started on first use and found by name afterwards (by any
    replica, in any process of the cluster). Byte caps are split evenly across the shards."""
    tag = hashlib.sha256(page_codec.identity_bytes(identity)).hexdigest()[:12]
    actor = ray.remote(CacheService)
    shards = []
    for k in range(num_shards):
        shard_dir = None if directory is None else f"{directory}/shard-{k}"
        shards.append(actor.options(name=f"kv-cache-{tag}-{k}", namespace=NAMESPACE, lifetime="detached",
                                    get_if_exists=True, num_cpus=0).remote(
            identity, host_bytes // num_shards, disk_bytes // num_shards, shard_dir))
    return SharedTier(shards)
