"""KVOffload: the engine's link to the tiers below device memory.

    device block evicted ──spill──> [writer thread: encode page (shuffle+LZ4, checksum)] ──> every tier
    request arrives ──prefetch(hashes)──> [prefetch thread: load_blocks] ──> payloads in host memory
    request admitted ──take_prefetched (or load_now)──> payloads written into new device blocks

Spills are written through to every tier (host for speed, disk to survive a restart), each tier
keeping its own cap by LRU. Every block of a prompt is looked up, not only a leading run: a block
missing from every tier, or a page that fails its checks, is a hole that the engine recomputes,
and the blocks after it are still restored. A damaged page costs one block's time, never a wrong
token.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from cache_service import page_codec
from cache_service.hashing import BlockHash
from cache_service.tiers import HostTier, Tier, build_tiers, promote


@dataclass
class OffloadStats:
    spilled_blocks: int = 0
    restored_blocks: int = 0
    restored_from: dict[str, int] | None = None  # tier name -> blocks
    failed_spills: int = 0
    prefetch_on_time: int = 0  # loaded before the request was scheduled
    prefetch_late: int = 0  # the scheduler had to wait for it
    prefetch_stale: int = 0  # the device cache changed meanwhile: loaded again at schedule time
    restore_wait_s: float = 0.0  # time the scheduler spent waiting for pages (loads or late prefetches)

    def as_dict(self) -> dict:
        prefetches = self.prefetch_on_time + self.prefetch_late
        return {"spilled_blocks": self.spilled_blocks, "restored_blocks": self.restored_blocks,
                "restored_from": dict(self.restored_from or {}), "failed_spills": self.failed_spills,
                "prefetch_on_time": self.prefetch_on_time, "prefetch_late": self.prefetch_late,
                "prefetch_stale": self.prefetch_stale, "restore_wait_s": self.restore_wait_s,
                "prefetch_on_time_rate": self.prefetch_on_time / prefetches if prefetches else 0.0}


class KVOffload:
    def __init__(self, tiers: list[Tier], identity: dict, codec: int = page_codec.SHUFFLE_LZ4, decode_threads: int | None = None):
        if not tiers:
            raise ValueError("KVOffload needs at least one tier")
        self.tiers = tiers
        self.identity = identity
        self.codec = codec
        self.stats = OffloadStats(restored_from={t.name: 0 for t in tiers})
        self._lock = threading.Lock()  # the tiers are plain objects: one caller at a time
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-spill")
        self._pending: list[Future] = []
        # Predictive prefetch: pages of a queued request's prefix are read and checked here while
        # it waits, so that scheduling it only copies them into device memory.
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch")
        self._decoders = ThreadPoolExecutor(decode_threads or os.cpu_count() or 1, thread_name_prefix="kv-decode")

    def host_swap_space(self, page_bytes: int) -> HostTierSwapSpace | None:
        """Swap copies drawn from this process's host tier (None: it has none)."""
        host = next((tier for tier in self.tiers if isinstance(tier, HostTier)), None)
        return HostTierSwapSpace(host, self._lock, page_bytes) if host is not None else None

    @property
    def outlives_process(self) -> bool:
        """Whether some tier keeps pages after this process ends (disk, the cache service)."""
        return any(tier.outlives_process for tier in self.tiers)

    def spill(self, payloads: list[tuple[BlockHash, np.ndarray]]) -> None:
        """Queue (block hash, payload copy) pairs for the writer thread; returns at once."""
        if payloads:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._writer.submit(self._write, payloads))

    def load_blocks(self, block_hashes: list[BlockHash]) -> list[bytes | None]:
        """The payload of each block hash's page, None where no tier holds it or its page is bad.
        One `contains` and one `get_many` per tier, whatever the number of blocks."""
        with self._lock:
            holders = self._holders(block_hashes)
            pages: dict[int, bytes | None] = {}
            for t, tier in enumerate(self.tiers):
                mine = [i for i, h in enumerate(holders) if h == t]
                if mine:
                    pages.update(zip(mine, tier.get_many([block_hashes[i] for i in mine])))
            # Checking and decoding is most of a restore's time: spread it over the cores (LZ4,
            # xxhash and numpy release the GIL); judging the results stays in order.
            found = list(pages)
            decoded = dict(zip(found, self._decoders.map(lambda i: self._decode(block_hashes[i], pages[i]), found)))
            payloads = [self._accept(block_hashes[i], pages[i], decoded[i], t) if t is not None else None
                        for i, t in enumerate(holders)]
        self.stats.restored_blocks += sum(p is not None for p in payloads)
        return payloads

    def prefetch(self, block_hashes: list[BlockHash]) -> Future:
        """Start loading `block_hashes` (load_blocks in the background); see take_prefetched."""
        return self._prefetcher.submit(self.load_blocks, block_hashes)

    def take_prefetched(self, future: Future) -> list[bytes | None]:
        """A prefetch's payloads. One that found pages counts as on time when it had finished,
        late when the scheduler has to wait for it here."""
        on_time = future.done()
        start = time.perf_counter()
        payloads = future.result()
        self.stats.restore_wait_s += time.perf_counter() - start
        if any(p is not None for p in payloads):
            if on_time:
                self.stats.prefetch_on_time += 1
            else:
                self.stats.prefetch_late += 1
        return payloads

    def load_now(self, block_hashes: list[BlockHash]) -> list[bytes | None]:
        """load_blocks on the caller's thread (no prefetch was usable), timed as waiting."""
        start = time.perf_counter()
        payloads = self.load_blocks(block_hashes)
        self.stats.restore_wait_s += time.perf_counter() - start
        return payloads

    def flush(self) -> None:
        """Wait for queued spills (tests, shutdown)."""
        for future in list(self._pending):
            future.result()
        self._pending = []

    def describe(self) -> dict:
        with self._lock:
            tiers = {t.name: t.describe() for t in self.tiers}
        return {"tiers": tiers, **self.stats.as_dict()}

    def _write(self, payloads: list[tuple[BlockHash, np.ndarray]]) -> None:
        with self._lock:  # pages every tier has already (a restored block cached again): skip
            held = [tier.contains([block_hash for block_hash, _ in payloads]) for tier in self.tiers]
        payloads = [p for i, p in enumerate(payloads) if not all(h[i] for h in held)]
        pages = [(block_hash, page_codec.encode(block_hash, self.identity, payload, self.codec))
                 for block_hash, payload in payloads]
        with self._lock:
            stored = [tier.put_many(pages) for tier in self.tiers]
        self.stats.spilled_blocks += len(pages)
        self.stats.failed_spills += len(pages) - max(stored)

    def _holders(self, block_hashes: list[BlockHash]) -> list[int | None]:
        """For each block hash, the index of the fastest tier that holds it (None: no tier does)."""
        held = [tier.contains(block_hashes) for tier in self.tiers] if block_hashes else []
        return [next((t for t in range(len(self.tiers)) if held[t][i]), None) for i in range(len(block_hashes))]

    def _decode(self, block_hash: bytes, page: bytes | None) -> bytes | bytearray | page_codec.PageError | None:
        if page is None:
            return None
        try:
            return page_codec.decode(page, self.identity, block_hash)
        except page_codec.PageError as e:
            return e

    def _accept(self, block_hash: bytes, page: bytes | None, decoded, t: int) -> bytes | None:
        """The page's payload, or None when it is gone or failed its checks (rejected there)."""
        tier = self.tiers[t]
        if decoded is None:
            return None
        if isinstance(decoded, page_codec.PageError):
            tier.reject(block_hash, decoded.reason)
            return None
        promote(self.tiers, t, block_hash, page)
        self.stats.restored_from[tier.name] += 1
        return decoded


class HostTierSwapSpace:
    """Swap copies (cluster/engine/kv_connector.py's SwapSpace) drawn from the host tier's cap: one
    budget for all the KV in host RAM. A swap copy is a preempted request's live state, so it pushes
    cached pages out (spills went to every tier: a disk tier still has them), never the reverse."""

    def __init__(self, tier: HostTier, lock: threading.Lock, page_bytes: int):
        self.tier, self._lock, self.page_bytes = tier, lock, page_bytes

    def take(self, num_blocks: int) -> bool:
        with self._lock:  # the spill writer puts pages from its thread
            return self.tier.reserve(num_blocks * self.page_bytes)

    def give_back(self, num_blocks: int) -> None:
        with self._lock:
            self.tier.release(num_blocks * self.page_bytes)


def build_offload(identity: dict, host_bytes: int = 0, disk_bytes: int = 0, directory: str | None = None,
                  service_shards: int = 0, codec: str = "shuffle-lz4",
                  service_resources: dict[str, float] | None = None) -> KVOffload | None:
    """The tiers below device memory (None when no bytes are given to any): host RAM and disk in
    this process, or with `service_shards` > 0 the same caps in the shared CacheService actors
    (each asking Ray for `service_resources`, e.g. a custom resource that only NVMe nodes have)."""
    if not (host_bytes or disk_bytes):
        return None
    if service_shards:
        from cache_service.service import shared_tier  # Ray, only when asked for

        tiers = [shared_tier(identity, service_shards, host_bytes, disk_bytes, directory, service_resources)]
    else:
        tiers = build_tiers(identity, host_bytes, disk_bytes, directory)
    return KVOffload(tiers, identity, codec=page_codec.CODECS[codec])
