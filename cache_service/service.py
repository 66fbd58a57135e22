"""The shared cache-service tier: CacheService Ray actors, sharded by block hash, each holding a
host-RAM tier and a disk tier. Every engine replica of a model talks to the same shards (they are
named after the model identity), so a block spilled by one replica is a hit for another, and the
pages outlive any one replica.

    engine ──KVOffload──> SharedTier (this process): block hashes grouped by shard, one call per shard
                              └──> CacheService shard k (a Ray actor): HostTier + DiskTier

Pages travel whole and checked end to end: the engine's KVOffload verifies every page it reads.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable

import ray
import ray.actor
import ray.exceptions

from cache_service import page_codec
from cache_service.tiers import TierStats, build_tiers, promote

NAMESPACE = "pagoda"
logger = logging.getLogger("pagoda.cache_service")


class CacheService:
    """One shard. Plain class; `shared_tier` runs it as a detached Ray actor."""

    def __init__(self, identity: dict, host_bytes: int, disk_bytes: int, directory: str | None):
        self.tiers = build_tiers(identity, host_bytes, disk_bytes, directory)

    def contains(self, block_hashes: list[bytes]) -> list[bool]:
        found = [False] * len(block_hashes)
        for tier in self.tiers:
            found = [f or c for f, c in zip(found, tier.contains(block_hashes))]
        return found

    def get(self, block_hashes: list[bytes]) -> list[bytes | None]:
        """The page of each block hash from the fastest tier that has it (a disk hit is promoted to host)."""
        pages = []
        for block_hash in block_hashes:
            page = None
            for i, tier in enumerate(self.tiers):
                page = tier.get(block_hash)
                if page is not None:
                    promote(self.tiers, i, block_hash, page)
                    break
            pages.append(page)
        return pages

    def put(self, pages: list[tuple[bytes, bytes]]) -> int:
        return max(tier.put_many(pages) for tier in self.tiers)  # a batch per tier (one directory fsync)

    def reject(self, block_hash: bytes, reason: str) -> None:
        for tier in self.tiers:
            if tier.contains([block_hash])[0]:
                tier.reject(block_hash, reason)

    def describe(self) -> dict:
        return {t.name: t.describe() for t in self.tiers}


class SharedTier:
    """The tier interface (tiers.py) over the CacheService shards, batching per shard.

    A shard that fails to answer (its actor died, or it took longer than `timeout_s`) is a miss
    for that call, never an error for the request: it is logged, counted, and the shard is looked
    up again by name (started afresh if it is gone: its disk pages are found again from their
    headers)."""

    name = "service"
    outlives_process = True  # detached actors
    used_bytes = None  # held in the shards (describe() asks them)

    def __init__(self, connect: Callable[[int], ray.actor.ActorHandle], num_shards: int, timeout_s: float = 30.0):
        self._connect = connect
        self.shards = [connect(k) for k in range(num_shards)]
        self.timeout_s = timeout_s
        self.stats = TierStats()
        self.shard_failures = 0

    def _by_shard(self, block_hashes: list[bytes]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, block_hash in enumerate(block_hashes):
            groups.setdefault(block_hash[0] % len(self.shards), []).append(i)
        return groups

    def _call(self, calls: dict[int, ray.ObjectRef], failed) -> dict[int, object]:
        """Each shard's answer, or `failed` for a shard that did not give one."""
        answers = {}
        for s, ref in calls.items():
            try:
                answers[s] = ray.get(ref, timeout=self.timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as e:
                self.shard_failures += 1
                logger.warning("KV cache service shard %d did not answer (%s); a miss, reconnecting", s, type(e).__name__)
                self.shards[s] = self._connect(s)
                answers[s] = failed
        return answers

    def _gather(self, method: str, block_hashes: list[bytes], missing) -> list:
        groups = self._by_shard(block_hashes)
        answers = self._call({s: getattr(self.shards[s], method).remote([block_hashes[i] for i in idx])
                              for s, idx in groups.items()}, None)
        results: list = [missing] * len(block_hashes)
        for s, values in answers.items():
            for i, value in zip(groups[s], values or [missing] * len(groups[s])):
                results[i] = value
        return results

    def contains(self, block_hashes: list[bytes]) -> list[bool]:
        return self._gather("contains", block_hashes, False) if block_hashes else []

    def get_many(self, block_hashes: list[bytes]) -> list[bytes | None]:
        pages = self._gather("get", block_hashes, None) if block_hashes else []
        hits = sum(p is not None for p in pages)
        self.stats.hits += hits
        self.stats.misses += len(pages) - hits
        return pages

    def get(self, block_hash: bytes) -> bytes | None:
        return self.get_many([block_hash])[0]

    def put_many(self, pages: list[tuple[bytes, bytes]]) -> int:
        groups = self._by_shard([block_hash for block_hash, _ in pages])
        answers = self._call({s: self.shards[s].put.remote([pages[i] for i in idx]) for s, idx in groups.items()}, 0)
        stored = sum(answers.values())
        self.stats.puts += stored
        return stored

    def put(self, block_hash: bytes, page: bytes) -> bool:
        return self.put_many([(block_hash, page)]) == 1

    def reject(self, block_hash: bytes, reason: str) -> None:
        self.stats.bad_pages[reason] = self.stats.bad_pages.get(reason, 0) + 1
        self.shards[block_hash[0] % len(self.shards)].reject.remote(block_hash, reason)

    def describe_shards(self) -> list[dict]:
        answers = self._call({s: shard.describe.remote() for s, shard in enumerate(self.shards)}, {"error": "unavailable"})
        return [answers[s] for s in range(len(self.shards))]

    def describe(self) -> dict:
        """This engine's view (hits, misses, puts, shard failures) and each shard's tiers."""
        return {**self.stats.as_dict(), "shard_failures": self.shard_failures, "shards": self.describe_shards()}


def shared_tier(identity: dict, num_shards: int, host_bytes: int, disk_bytes: int, directory: str | None,
                resources: dict[str, float] | None = None) -> SharedTier:
    """The model's CacheService shards, started on first use and found by name afterwards (by any
    replica, in any process of the cluster). Byte caps are split evenly across the shards; each
    shard asks Ray for `resources` (a custom resource of NVMe nodes pins the disk tier to them)."""
    tag = hashlib.sha256(page_codec.identity_bytes(identity)).hexdigest()[:12]
    actor = ray.remote(CacheService)

    def connect(k: int) -> ray.actor.ActorHandle:
        shard_dir = None if directory is None else f"{directory}/shard-{k}"
        return actor.options(name=f"kv-cache-{tag}-{k}", namespace=NAMESPACE, lifetime="detached",
                             get_if_exists=True, num_cpus=0, resources=resources or {}).remote(
            identity, host_bytes // num_shards, disk_bytes // num_shards, shard_dir)

    return SharedTier(connect, num_shards)
