"""Paged attention against plain causal attention on contiguous K/V."""

import pytest
import torch
import torch.nn.functional as F

from model.attention import PagedAttention, build_attention_context
from model.cpu_ops import cpu_ops

BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 8


def dense_attention(q, k, v):
    """q: [n, H, D] for the last n positions of k, v: [L, KV, D]."""
    n, L = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1).reshape(n, -1)


def test_mixed_step_matches_dense_attention():
    torch.manual_seed(0)
    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    num_blocks = 32
    attn.k_cache = torch.zeros(num_blocks, KV_HEADS, BLOCK, DIM)
    attn.v_cache = torch.zeros(num_blocks, KV_HEADS, BLOCK, DIM)
    # (context before this step, new tokens): two decodes, a fresh prefill, a chunk after a cached part
    shapes = [(6, 1), (12, 1), (0, 7), (9, 5)]
    free = iter(torch.randperm(num_blocks).tolist())  # scattered, unordered blocks
    tables, full_kv = [], []
    for cached, new in shapes:
        total = cached + new
        table = [next(free) for _ in range(-(-total // BLOCK))]
        tables.append(table)
        k, v = torch.randn(total, KV_HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
        full_kv.append((k, v))
        for pos in range(cached):  # what earlier steps wrote
            attn.k_cache[table[pos // BLOCK], :, pos % BLOCK] = k[pos]
            attn.v_cache[table[pos // BLOCK], :, pos % BLOCK] = v[pos]
    ctx = build_attention_context(
        BLOCK, 2, [n for _, n in shapes], [c + n for c, n in shapes], tables
    )
    qs = [torch.randn(n, HEADS, DIM) for _, n in shapes]
    new_k = torch.cat([k[c:] for (k, _), (c, _) in zip(full_kv, shapes)])
    new_v = torch.cat([v[c:] for (_, v), (c, _) in zip(full_kv, shapes)])
    out = attn(torch.cat(qs), new_k, new_v, ctx)
    expected = torch.cat([dense_attention(q, k, v) for q, (k, v) in zip(qs, full_kv)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_ops() is None, reason="Pagoda's CPU kernels could not be built here")
@pytest.mark.parametrize("kernel_max_queries", [1, 5, 16])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)])
# The default model's 9 / 3 heads of 64; then query heads per KV head that the kernel takes in
# runs (4 -> 2 + 2, 5 -> 3 + 2, 1) and head dims with and without their own build (128, 72)
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128), (5, 1, 72), (4, 4, 64)])
def test_kernel_reads_blocks_in_place_like_the_torch_path(kernel_max_queries, dtype, cache_dtype, heads, kv_heads, dim):
    """The same step through the kernel (decodes, and chunks up to kernel_max_queries) and through
    the gathering path: equal outputs; bf16 caches too, under a bf16 model and under an fp32 one
    (kv_cache_dtype: both paths then compute in fp32 on the same rounded K/V)."""
    torch.manual_seed(1)
    block = 16
    shapes = [(40, 1), (3, 1), (100, 1), (300, 1), (0, 20), (37, 5), (16, 3)]
    free = iter(torch.randperm(64).tolist())
    tables = [[next(free) for _ in range(-(-(c + n) // block))] for c, n in shapes]
    caches = [torch.randn(64, kv_heads, block, dim).to(cache_dtype) for _ in range(2)]
    args = (block, 4, [n for _, n in shapes], [c + n for c, n in shapes], tables)
    total = sum(n for _, n in shapes)
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    outs = []
    for ctx in (build_attention_context(*args), build_attention_context(*args, kernel_max_queries=kernel_max_queries)):
        attn = PagedAttention(heads, kv_heads, dim)
        attn.k_cache, attn.v_cache = caches[0].clone(), caches[1].clone()
        outs.append(attn(q.to(dtype), k.to(dtype), v.to(dtype), ctx))
    assert outs[1].shape == (total, heads * dim) and outs[1].dtype == dtype
    # Each path wrote the step's new K/V into its cache, rounded to the cache's dtype.
    torch.testing.assert_close(attn.k_cache[tables[0][-1], :, 40 % block], k[0].to(cache_dtype), rtol=0, atol=0)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # the torch path computes in bf16, the kernel in fp32
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=tolerance, atol=tolerance)
