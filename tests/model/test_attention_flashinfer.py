"""The FlashInfer path's page tables and the way it splits a step between FlashInfer's decode and
prefill wrappers. On the CPU the wrappers are stand-ins that compute what FlashInfer documents for
its CSR page tables (pages kv_indices[kv_indptr[i]:kv_indptr[i+1]], last_page_len tokens in the
last one, the causal mask aligned to the end of the context); the step must equal the torch path.
With a CUDA device and flashinfer installed, the real wrappers are checked against the torch path.
"""

import pytest
import torch
import torch.nn.functional as F

from model.attention import PagedAttention, build_attention_context
from model.attention_flashinfer import FlashInferAttention, build_flashinfer_attention, page_table

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


class DocumentedWrapper:
    """What FlashInfer's paged wrappers compute, in plain torch (HND caches)."""

    def __init__(self, prefill: bool):
        self.prefill, self.planned = prefill, None

    def plan(self, *args, **kwargs):
        if not self.prefill:  # the decode wrapper: one query per sequence
            kv_indptr = args[0]
            args = (torch.arange(len(kv_indptr), dtype=torch.int32), *args)
        assert kwargs["causal"] is True if self.prefill else "causal" not in kwargs
        self.planned = args, kwargs

    def run(self, q, paged_kv_cache):
        (qo_indptr, kv_indptr, kv_indices, last_page_len, heads, kv_heads, dim, page_size), kwargs = self.planned
        k_cache, v_cache = paged_kv_cache
        assert q.shape == (int(qo_indptr[-1]), heads, dim) and k_cache.shape[1:] == (kv_heads, page_size, dim)
        outs = []
        for i in range(len(qo_indptr) - 1):
            pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
            length = (len(pages) - 1) * page_size + int(last_page_len[i])
            k = k_cache[pages].transpose(0, 1).flatten(1, 2)[:, :length].repeat_interleave(heads // kv_heads, 0)
            v = v_cache[pages].transpose(0, 1).flatten(1, 2)[:, :length].repeat_interleave(heads // kv_heads, 0)
            rows = q[qo_indptr[i]:qo_indptr[i + 1]]
            n = rows.shape[0]
            mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
            out = F.scaled_dot_product_attention(rows.transpose(0, 1).float(), k.float(), v.float(), attn_mask=mask,
                                                 scale=kwargs["sm_scale"])
            outs.append(out.transpose(0, 1).to(q.dtype))
        return torch.cat(outs)


def documented_flashinfer(dtype=torch.float32) -> FlashInferAttention:
    return FlashInferAttention(DocumentedWrapper(False), DocumentedWrapper(True), HEADS, KV_HEADS, DIM, BLOCK, dtype)


def test_page_table_in_flashinfers_csr_form():
    t = page_table([1, 5, 3], [17, 5, 35], [[7, 2, 9], [4], [1, 3, 8, 6]], 16)
    assert t.qo_indptr.tolist() == [0, 1, 6, 9]
    assert t.kv_indptr.tolist() == [0, 2, 3, 6]  # pages that hold the context, not the whole table
    assert t.kv_indices.tolist() == [7, 2, 4, 1, 3, 8]
    assert t.kv_last_page_len.tolist() == [1, 5, 3]
    assert page_table([1], [32], [[5, 6]], 16).kv_last_page_len.tolist() == [16]  # a full last page
    assert {x.dtype for x in (t.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len)} == {torch.int32}


def random_step(shapes, seed=0, device="cpu", dtype=torch.float32):
    """shapes: (tokens cached before, new tokens) per sequence, decodes first."""
    torch.manual_seed(seed)
    free = iter(torch.randperm(64).tolist())  # scattered, unordered blocks
    tables = [[next(free) for _ in range(-(-(c + n) // BLOCK))] for c, n in shapes]
    caches = [torch.randn(64, KV_HEADS, BLOCK, DIM).to(device, dtype) for _ in range(2)]
    total = sum(n for _, n in shapes)
    qkv = [torch.randn(total, h, DIM).to(device, dtype) for h in (HEADS, KV_HEADS, KV_HEADS)]
    num_decodes = sum(1 for _, n in shapes if n == 1)
    args = (BLOCK, num_decodes, [n for _, n in shapes], [c + n for c, n in shapes], tables, device)
    return args, caches, qkv


def attend(args, caches, qkv, flashinfer=None):
    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    attn.k_cache, attn.v_cache = caches[0].clone(), caches[1].clone()
    ctx = build_attention_context(*args, flashinfer=flashinfer)
    return attn(*qkv, ctx), attn.k_cache, attn.v_cache


STEPS = {
    "decodes": [(40, 1), (3, 1), (15, 1), (300, 1)],
    "prefills": [(0, 20), (37, 5), (16, 16)],
    "mixed": [(40, 1), (0, 1), (100, 1), (0, 20), (37, 5), (16, 3)],
}


@pytest.mark.parametrize("name", STEPS)
def test_a_step_through_the_flashinfer_path_equals_the_torch_path(name):
    args, caches, qkv = random_step(STEPS[name])
    expected, k_expected, v_expected = attend(args, caches, qkv)
    got, k_got, v_got = attend(args, caches, qkv, documented_flashinfer())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_got, k_expected) and torch.equal(v_got, v_expected)  # the step's K/V written alike


def test_flashinfer_is_not_used_where_it_cannot_serve(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert build_flashinfer_attention(cpu, torch.bfloat16, HEADS, KV_HEADS, DIM, BLOCK) is None  # no CUDA
    assert build_flashinfer_attention(cuda, torch.float32, HEADS, KV_HEADS, DIM, BLOCK) is None  # fp32 cache
    monkeypatch.setenv("PAGODA_FLASHINFER", "0")
    assert build_flashinfer_attention(cuda, torch.bfloat16, HEADS, KV_HEADS, DIM, BLOCK) is None  # switched off


@pytest.mark.gpu
@pytest.mark.parametrize("name", STEPS)
def test_flashinfer_on_the_gpu_equals_the_torch_path(name):
    pytest.importorskip("flashinfer")
    flashinfer = build_flashinfer_attention(torch.device("cuda"), torch.bfloat16, HEADS, KV_HEADS, DIM, BLOCK)
    args, caches, qkv = random_step(STEPS[name], device="cuda", dtype=torch.bfloat16)
    expected, _, _ = attend(args, caches, qkv)
    got, _, _ = attend(args, caches, qkv, flashinfer)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
