"""Paged attention on CUDA through FlashInfer (`flashinfer-python`), the kernel library that vLLM
and SGLang serve with: its kernels read each sequence's pages where they lie, so nothing is gathered.

Pagoda's per-layer cache, [blocks, kv_heads, block_size, head_dim] for K and one for V, is
FlashInfer's "HND" layout, so the caches go in as they are. A step's page tables are handed over
once, in FlashInfer's CSR form, and every layer runs on them:

    sequences:   d0   d1   p0 (chunk of 5)   p1 (chunk of 3)
    qo_indptr:              [0,               5,              8]   query rows per prefill chunk
    kv_indptr:   [0,  2,  5]  [0,             3,              4]   pages per sequence
    kv_indices:  d0's pages, d1's pages | p0's pages, p1's pages     block ids
    last_page_len: tokens in each sequence's last page (1..block_size)

Decode rows go through the decode wrapper, prefill chunks through the paged prefill wrapper with a
causal mask that FlashInfer aligns to the end of the context, as Pagoda's chunks are (query i of
n sees keys up to context_len - n + i). FlashInfer's kernels take fp16 and bf16: an fp32 cache,
a CPU, or a host without the package keeps the torch path (model/attention.py).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Protocol

import torch

SWITCH = "PAGODA_FLASHINFER"  # "0": the torch path even where FlashInfer could run
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-k workspace
DTYPES = (torch.float16, torch.bfloat16)


@dataclass(slots=True)
class PageTable:
    """Sequences' pages in FlashInfer's CSR form (int32, on the host: plan() copies them over)."""

    qo_indptr: torch.Tensor  # [n + 1] query rows of sequence i: qo_indptr[i] .. qo_indptr[i + 1]
    kv_indptr: torch.Tensor  # [n + 1] its pages: kv_indices[kv_indptr[i] : kv_indptr[i + 1]]
    kv_indices: torch.Tensor  # block ids
    kv_last_page_len: torch.Tensor  # [n] tokens in each last page, 1 .. block_size


def page_table(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int) -> PageTable:
    qo_indptr, kv_indptr, kv_indices, last_page_len = [0], [0], [], []
    for query_len, context_len, table in zip(query_lens, context_lens, block_tables, strict=True):
        num_pages = -(-context_len // block_size)
        kv_indices += table[:num_pages]
        qo_indptr.append(qo_indptr[-1] + query_len)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        last_page_len.append(context_len - (num_pages - 1) * block_size)
    as_int32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return PageTable(as_int32(qo_indptr), as_int32(kv_indptr), as_int32(kv_indices), as_int32(last_page_len))


class DecodeWrapper(Protocol):
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper, as Pagoda calls it."""

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs): ...

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor: ...


class PrefillWrapper(Protocol):
    """flashinfer.BatchPrefillWithPagedKVCacheWrapper, as Pagoda calls it."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, **kwargs): ...

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor: ...


class FlashInferAttention:
    """One runner's FlashInfer wrappers: `plan` once per step, then `run` for every layer."""

    def __init__(self, decode: DecodeWrapper, prefill: PrefillWrapper, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, dtype: torch.dtype):
        self.decode, self.prefill = decode, prefill
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.dtype = block_size, dtype
        self.num_decodes = self.num_tokens = 0

    def plan(self, num_decodes: int, query_lens: list[int], context_lens: list[int],
             block_tables: list[list[int]]) -> FlashInferAttention:
        """Sequences in step order, decodes first (as build_attention_context takes them)."""
        self.num_decodes, self.num_tokens = num_decodes, sum(query_lens)
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        types = {"q_data_type": self.dtype, "kv_data_type": self.dtype, "sm_scale": self.head_dim**-0.5}
        if num_decodes:
            t = page_table(query_lens[:num_decodes], context_lens[:num_decodes], block_tables[:num_decodes], self.block_size)
            self.decode.plan(t.kv_indptr, t.kv_indices, t.kv_last_page_len, *shape, pos_encoding_mode="NONE", **types)
        if len(query_lens) > num_decodes:
            t = page_table(query_lens[num_decodes:], context_lens[num_decodes:], block_tables[num_decodes:], self.block_size)
            self.prefill.plan(t.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len, *shape, causal=True, **types)
        return self

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, head_dim] of the planned step -> [T, heads, head_dim]."""
        assert q.shape[0] == self.num_tokens, "run() with a step that was not planned"
        cache, d = (k_cache, v_cache), self.num_decodes
        q = q.contiguous()  # the kernels index rows by a dense stride; a slice of the fused QKV is not
        if d == self.num_tokens:
            return self.decode.run(q, cache)
        if d == 0:
            return self.prefill.run(q, cache)
        return torch.cat([self.decode.run(q[:d], cache), self.prefill.run(q[d:], cache)])


def build_flashinfer_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                               head_dim: int, block_size: int) -> FlashInferAttention | None:
    """FlashInfer's wrappers where they can serve this cache (a CUDA device, fp16/bf16, the package
    installed, not switched off); else None: the torch path."""
    if device.type != "cuda" or dtype not in DTYPES or os.environ.get(SWITCH) == "0":
        return None
    try:
        import flashinfer
    except ImportError:
        return None
    with contextlib.suppress(ImportError):
        # FlashInfer's JIT reads `tvm_ffi.libinfo` without importing it; on the H200 image seen
        # (flashinfer-python 0.7.2.post1, apache-tvm-ffi 0.1.15.post2) nothing else had, and every
        # plan() failed with AttributeError.
        import tvm_ffi.libinfo  # noqa: F401
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    # Tensor cores pay off for decode from 4 query heads per KV head (vLLM's rule).
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND",
                                                            use_tensor_cores=num_heads // num_kv_heads >= 4)
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
    return FlashInferAttention(decode, prefill, num_heads, num_kv_heads, head_dim, block_size, dtype)
