"""EncoderServer: media -> embeddings as a deployment of its own (`engine.encoder: deployment`).

    Ingress --processor output per item--> EncoderServer.encode --embeddings--> Ingress --> LLMServer

The language model's replicas then never hold an encoder nor see pixels or waveforms, and the
encoders get their own replicas, resources (CPU or GPU) and autoscaling. Each replica keeps an
embedding cache by content hash; Serve's prefix-affinity router is not needed for it to hit,
since a chat resends its images every turn to whichever replica, and each replica's cache fills
with what it is sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

from cluster.engine.embedding_cache import CachingEncoder
from cluster.engine.media import MediaItem
from cluster.serve.metrics import MediaMetrics


class EncoderServer:
    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu",
                 embedding_cache_bytes: int = 256 << 20, torch_threads: int | None = None):
        # One thread runs torch, for the life of the replica (see LLMServer: a second thread
        # running torch halves the speed of both).
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagoda-encoder")
        self.encoder = self._thread.submit(self._build, model, dtype, device, embedding_cache_bytes, torch_threads).result()
        self.metrics = MediaMetrics(os.path.basename(os.path.normpath(model)))

    @staticmethod
    def _build(model, dtype, device, cache_bytes, torch_threads) -> CachingEncoder:
        import torch

        from model.loader import parse_dtype
        from model.multimodal import MediaEncoder

        torch.set_num_threads(torch_threads or os.cpu_count() or 1)
        return CachingEncoder(MediaEncoder(model, parse_dtype(dtype), device), cache_bytes)

    async def encode(self, items: list[MediaItem]) -> list[MediaItem]:
        """The items with their embeddings (their processor output dropped)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._encode, items)

    def _encode(self, items: list[MediaItem]) -> list[MediaItem]:
        self.encoder.encode_items(items)
        self.metrics.record_encoder(self.encoder.stats, "deployment")  # on the thread that adds to them
        return items

    def stats(self) -> dict:
        return self.encoder.describe()
