"""Media embeddings by content hash: a repeated image (a chat that resends it every turn, many
users asking about one picture) is encoded once.

    MediaItem(encoder_inputs) --CachingEncoder.encode_items--> MediaItem(embeddings)
                                    │ hit: EmbeddingCache (LRU, bounded in bytes)
                                    └ miss: MediaEncoder (model/multimodal.py), then cached

Used where the encoder runs: in the engine (colocated) or in an EncoderServer replica.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from cluster.engine.media import MediaItem


class EmbeddingCache:
    """Least recently used out first once the rows held pass `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, key: bytes) -> torch.Tensor | None:
        rows = self._entries.get(key)
        if rows is not None:
            self._entries.move_to_end(key)
        return rows

    def put(self, key: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = rows
        self.used_bytes += size
        while self.used_bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(slots=True)
class EncoderStats:
    """Running totals (metrics take what is new: cluster/serve/metrics.py)."""

    cache_hits: int = 0
    cache_misses: int = 0
    # (modality, seconds) of each encoding since the last `take_latencies`
    latencies: list[tuple[str, float]] = field(default_factory=list)

    def take_latencies(self) -> list[tuple[str, float]]:
        taken, self.latencies = self.latencies, []
        return taken


class CachingEncoder:
    def __init__(self, encoder, cache_bytes: int):
        self.encoder = encoder  # a MediaEncoder (anything with encode(inputs) -> rows)
        self.cache = EmbeddingCache(cache_bytes)
        self.stats = EncoderStats()

    def describe(self) -> dict:
        """Plain numbers for `pagoda status` and /v1/pagoda/stats."""
        return {"cache_hits": self.stats.cache_hits, "cache_misses": self.stats.cache_misses,
                "cache_items": len(self.cache), "cache_bytes": self.cache.used_bytes}

    def encode_items(self, items: list[MediaItem]) -> list[MediaItem]:
        """Fills each item's embeddings (from the cache, or encoded and cached) and drops its
        encoder inputs, which are not needed past this point."""
        for item in items:
            if item.embeddings is not None:
                continue
            rows = self.cache.get(item.content_hash)
            if rows is None:
                self.stats.cache_misses += 1
                start = time.perf_counter()
                rows = self.encoder.encode(item.encoder_inputs)
                self.stats.latencies.append((item.modality, time.perf_counter() - start))
                self.cache.put(item.content_hash, rows)
            else:
                self.stats.cache_hits += 1
            item.embeddings, item.encoder_inputs = rows, None
        return items
