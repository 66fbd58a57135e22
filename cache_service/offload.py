"""KVOffload: the engine's link to the tiers below device memory.

    device block evicted ──spill──> [writer thread: encode page (shuffle+LZ4, checksum)] ──> every tier
    request admitted ──load_prefix(hashes)──> pages from the fastest tier that has them, checked,
                                              decoded ──> payloads written into new device blocks

Spills are written through to every tier (host for speed, disk to survive a restart), each tier
keeping its own cap by LRU. A page that fails its checks ends the restored prefix there: the rest
is recomputed, so a damaged page costs time, never a wrong token.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from cache_service import page_codec


@dataclass
class OffloadStats:
    spilled_blocks: int = 0
    restored_blocks: int = 0
    restored_from: dict[str, int] | None = None  # tier name -> blocks
    failed_spills: int = 0

    def as_dict(self) -> dict:
        return {"spilled_blocks": self.spilled_blocks, "restored_blocks": self.restored_blocks,
                "restored_from": dict(self.restored_from or {}), "failed_spills": self.failed_spills}


class KVOffload:
    def __init__(self, tiers: list, identity: dict, codec: int = page_codec.SHUFFLE_LZ4):
        if not tiers:
            raise ValueError("KVOffload needs at least one tier")
        self.tiers = tiers
        self.identity = identity
        self.codec = codec
        self.stats = OffloadStats(restored_from={t.name: 0 for t in tiers})
        self._lock = threading.Lock()  # the tiers are plain objects: one caller at a time
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-spill")
        self._pending: list[Future] = []

    def spill(self, blocks: list[tuple[bytes, np.ndarray]]) -> None:
        """Queue evicted blocks (hash, payload copy) for the writer thread; returns at once."""
        if blocks:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._writer.submit(self._write, blocks))

    def load_prefix(self, keys: list[bytes]) -> list[bytes]:
        """Payloads of the leading `keys` found in a tier, up to the first one missing or bad."""
        payloads = []
        with self._lock:
            for key in keys:
                payload = self._load_one(key)
                if payload is None:
                    break
                payloads.append(payload)
        self.stats.restored_blocks += len(payloads)
        return payloads

    def flush(self) -> None:
        """Wait for queued spills (tests, shutdown)."""
        for future in list(self._pending):
            future.result()
        self._pending = []

    def describe(self) -> dict:
        with self._lock:
            tiers = {t.name: {"used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes, "pages": len(t),
                              **t.stats.as_dict()} for t in self.tiers}
        return {"tiers": tiers, **self.stats.as_dict()}

    def _write(self, blocks: list[tuple[bytes, np.ndarray]]) -> None:
        for key, payload in blocks:
            page = page_codec.encode(key, self.identity, payload, self.codec)
            with self._lock:
                stored = [tier.put(key, page) for tier in self.tiers]
            self.stats.spilled_blocks += 1
            self.stats.failed_spills += not any(stored)

    def _load_one(self, key: bytes) -> bytes | None:
        for i, tier in enumerate(self.tiers):
            page = tier.get(key)
            if page is None:
                continue
            try:
                payload = page_codec.decode(page, self.identity, key)
            except page_codec.PageError as e:
                tier.reject(key, e.reason)
                continue
            for faster in self.tiers[:i]:  # promote: the next hit is faster
                faster.put(key, page)
            self.stats.restored_from[tier.name] += 1
            return payload
        return None
