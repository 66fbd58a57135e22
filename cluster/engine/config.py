"""EngineConfig: the knobs of one engine, with defaults that suit the CPU and the default model."""

from __future__ import annotations

from dataclasses import dataclass

from cache_service.page_codec import CODECS
from model.config import DTYPES


TP_PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
ENCODER_PLACEMENTS = ("colocated", "deployment")


@dataclass(slots=True)
class EngineConfig:
    model: str  # an HF model directory
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # device memory for KV pages; sets the number of blocks
    num_blocks: int | None = None  # or set the number of blocks directly (tests do)
    max_num_batched_tokens: int = 512  # token budget of one step: the prefill chunk size
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's context
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    # The KV cache's element type: "auto" is the model's dtype. "bfloat16" under an fp32 model halves
    # the cache's bytes (twice the tokens in kv_cache_bytes, half the bytes decode attention reads)
    # and rounds K and V once as they are written: not bit-equal to HF (perplexity in
    # docs/benchmarks-log.md). The CPU's paged kernel reads float32 and bfloat16 caches.
    kv_cache_dtype: str = "auto"
    # "int8": int8 weights with fbgemm's dynamic-int8 GEMM (CPU). Faster decode, not bit-equal to HF.
    quantization: str | None = None
    device: str = "cpu"
    # When blocks run out: "recompute" a preempted request later (mostly from the prefix cache),
    # or "swap" its KV to host memory and back.
    preemption_mode: str = "recompute"
    # Host memory that swapped-out KV may take (as vLLM's swap_space) where this process has no host
    # tier; with one, swap copies come out of host_kv_bytes instead (one budget for host RAM's KV,
    # pushing cached pages out). A preemption that finds no room recomputes instead.
    swap_space_bytes: int = 4 << 30
    tensor_parallel_size: int = 1  # > 1: a group of Ray actors, one per rank (cluster/executor)
    tp_collective: str = "auto"  # "auto" (NCCL / deepspeed shared memory / gloo) or "gloo"
    # Where a TP group's ranks go (a Ray placement strategy): "PACK" on as few nodes as fit,
    # "STRICT_PACK" one node or none, "SPREAD"/"STRICT_SPREAD" across nodes.
    tp_placement_strategy: str = "PACK"
    seed: int = 0  # for requests that bring no seed of their own
    # Lower KV tiers (cache_service/tiers.py): evicted blocks are spilled there and brought back
    # for later prefix hits instead of being recomputed. 0 bytes: no such tier.
    host_kv_bytes: int = 0
    disk_kv_bytes: int = 0
    kv_cache_dir: str | None = None  # the disk tier's directory (local NVMe)
    # > 0: those tiers live in N shared CacheService actors (cache_service/service.py) that every
    # replica of the model uses, instead of in this process.
    kv_cache_service_shards: int = 0
    # Ray resources each shard asks for: {"nvme": 0.01} puts the shards on nodes that declare an
    # `nvme` resource (k8s/: the cache-service worker group with local NVMe at kv_cache_dir).
    kv_cache_service_resources: dict[str, float] | None = None
    # How pages are stored: "shuffle-lz4" (byte-shuffled, then LZ4: smallest, 1.07x for fp32 and
    # 1.15x for bf16 KV here), "lz4" (about 6x faster to read back, barely smaller than raw) or "raw".
    kv_page_codec: str = "shuffle-lz4"
    kv_prefetch: bool = True  # load a queued request's prefix from the lower tiers while it waits
    # Write every block down as soon as it is full and computed, not only when device memory gives
    # it up: a crash (SIGKILL) then loses none of it, for a copy per block and background writes.
    kv_write_through: bool = False
    # Disaggregation: "prefill" or "decode" engines move KV through Ray's object store.
    kv_role: str | None = None
    # Multimodal models: where media is encoded. "colocated": by this engine, on its thread, before
    # a request is queued (the running requests' next step waits that long); "deployment": by an
    # EncoderServer (cluster/serve/encoder_server.py), so requests arrive with embeddings and this
    # engine never loads the encoder.
    encoder: str = "colocated"
    embedding_cache_bytes: int = 256 << 20  # encoded media kept by content hash (colocated)
    # Between tenants: "fair" (shares by weight, cluster/engine/fair_share.py) or "fcfs" (arrival).
    tenant_scheduling: str = "fair"

    def __post_init__(self):
        for name in ("block_size", "kv_cache_bytes", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("host_kv_bytes", "disk_kv_bytes", "swap_space_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.disk_kv_bytes and not self.kv_cache_dir:
            raise ValueError("disk_kv_bytes needs kv_cache_dir (the disk tier's directory)")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", *DTYPES):
            raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_page_codec not in CODECS:
            raise ValueError(f"kv_page_codec must be one of {', '.join(CODECS)}, got {self.kv_page_codec!r}")
        if self.tp_placement_strategy not in TP_PLACEMENT_STRATEGIES:
            raise ValueError(f"tp_placement_strategy must be one of {', '.join(TP_PLACEMENT_STRATEGIES)}, "
                             f"got {self.tp_placement_strategy!r}")
        if self.tp_collective not in ("auto", "gloo"):
            raise ValueError(f"tp_collective must be 'auto' or 'gloo', got {self.tp_collective!r}")
        if self.encoder not in ENCODER_PLACEMENTS:
            raise ValueError(f"encoder must be one of {', '.join(ENCODER_PLACEMENTS)}, got {self.encoder!r}")
        if self.tenant_scheduling not in ("fair", "fcfs"):
            raise ValueError(f"tenant_scheduling must be 'fair' or 'fcfs', got {self.tenant_scheduling!r}")
        if self.kv_role not in (None, "prefill", "decode"):
            raise ValueError(f"kv_role must be None, 'prefill' or 'decode', got {self.kv_role!r}")

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype, "auto" resolved."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
