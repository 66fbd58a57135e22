"""Attention over a paged KV cache.

Each layer's cache is a tensor [num_blocks, num_kv_heads, block_size, head_dim] for K and one for V.
A step's tokens are laid out decodes first, then prefill chunks:

    tokens:  [ d0 d1 d2 ... | p0 chunk ........ | p1 chunk .... ]
              one query per   many queries per sequence, attending to the
              decode sequence cached blocks before the chunk and causally within it

Decodes run as one batched computation over the blocks they read, with no padding to the longest
sequence: scores are computed block by block (a bmm over every block of every decode sequence),
then a softmax per sequence is assembled with scatter/index_add over the block -> sequence map.
Only the unused tail of each sequence's last block is masked. Prefill chunks are few per step and
compute-bound, so each runs through torch's SDPA on its gathered blocks.

Where Pagoda's CPU kernels are built (model/cpu_ops.py) the decodes, and prefill chunks of up to
`kernel_max_queries` queries (the rest of a prompt after a prefix hit), skip all of that: the
kernel reads each sequence's blocks in place with an online softmax, one query row at a time.
On CUDA with an fp16/bf16 cache, FlashInfer's kernels take the whole step the same way
(model/attention_flashinfer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.attention_flashinfer import FlashInferAttention
from model.cpu_ops import cpu_ops


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # index of the chunk's first token in the step's token dimension
    num_queries: int
    context_len: int  # tokens visible to the chunk's last query (cached + chunk)
    block_ids: torch.Tensor  # the blocks covering context_len tokens


@dataclass(slots=True)
class KernelRows:
    """Query rows that the paged_attention kernel serves: row i attends to the first row_len[i]
    keys of the sequence whose block table is tables[row_seq[i]]."""

    rows: torch.Tensor | None  # their indices among the step's tokens; None: the first len(row_len)
    tables: torch.Tensor  # [sequences, max blocks], padded with 0
    row_seq: torch.Tensor  # [rows]
    row_len: torch.Tensor  # [rows]


@dataclass(slots=True)
class AttentionContext:
    """Everything attention needs about one step; built once by the runner, shared by all layers."""

    slot_blocks: torch.Tensor  # [T] block that receives each new token's K/V
    slot_offsets: torch.Tensor  # [T] position inside that block
    num_decodes: int
    decode_block_ids: torch.Tensor  # [NB] every block read by the decode sequences, in sequence order
    decode_block_seq: torch.Tensor  # [NB] which decode sequence each of those blocks belongs to
    decode_valid: torch.Tensor  # [NB, 1, block_size, 1] False on slots past the sequence's end
    prefills: list[PrefillChunk]
    kernel: KernelRows | None = None  # rows the kernel serves (then not in the decode_* fields or prefills)
    flashinfer: FlashInferAttention | None = None  # planned for this step: it serves every row


def build_attention_context(
    block_size: int,
    num_decodes: int,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    device: torch.device | str = "cpu",
    kernel_max_queries: int = 0,
    flashinfer: FlashInferAttention | None = None,
) -> AttentionContext:
    """Sequences come in step order (decodes first); context_len counts the tokens already cached
    plus this step's, so the new tokens sit at positions [context_len - query_len, context_len).
    kernel_max_queries > 0: decodes and chunks of at most that many queries go to the kernel;
    flashinfer: every row goes to FlashInfer, planned here."""
    slot_blocks, slot_offsets = [], []
    for query_len, context_len, table in zip(query_lens, context_lens, block_tables):
        for pos in range(context_len - query_len, context_len):
            slot_blocks.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    if flashinfer is not None:
        empty = as_long([])
        return AttentionContext(as_long(slot_blocks), as_long(slot_offsets), 0, empty, empty,
                                torch.zeros(0, 1, block_size, 1, dtype=torch.bool, device=device), [],
                                flashinfer=flashinfer.plan(num_decodes, query_lens, context_lens, block_tables))
    if kernel_max_queries > 0:
        return _kernel_context(block_size, num_decodes, query_lens, context_lens, block_tables, device,
                               kernel_max_queries, as_long(slot_blocks), as_long(slot_offsets))

    decode_blocks, decode_seq, decode_valid = [], [], []
    for i in range(num_decodes):
        num_blocks = -(-context_lens[i] // block_size)
        decode_blocks += block_tables[i][:num_blocks]
        decode_seq += [i] * num_blocks
        tail = context_lens[i] - (num_blocks - 1) * block_size
        decode_valid += [block_size] * (num_blocks - 1) + [tail]
    valid = torch.arange(block_size)[None, :] < torch.tensor(decode_valid, dtype=torch.long)[:, None]

    prefills, start = [], sum(query_lens[:num_decodes])
    for i in range(num_decodes, len(query_lens)):
        num_blocks = -(-context_lens[i] // block_size)
        table = torch.tensor(block_tables[i][:num_blocks], dtype=torch.long, device=device)
        prefills.append(PrefillChunk(start, query_lens[i], context_lens[i], table))
        start += query_lens[i]

    return AttentionContext(
        slot_blocks=as_long(slot_blocks),
        slot_offsets=as_long(slot_offsets),
        num_decodes=num_decodes,
        decode_block_ids=as_long(decode_blocks),
        decode_block_seq=as_long(decode_seq),
        decode_valid=valid[:, None, :, None].to(device),
        prefills=prefills,
    )


def _kernel_context(block_size, num_decodes, query_lens, context_lens, block_tables, device, kernel_max_queries,
                    slot_blocks, slot_offsets) -> AttentionContext:
    rows, row_seq, row_len, tables, prefills = [], [], [], [], []
    start = 0
    for i, (query_len, context_len, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        num_blocks = -(-context_len // block_size)
        if query_len <= kernel_max_queries:
            rows += range(start, start + query_len)
            row_seq += [len(tables)] * query_len
            row_len += range(context_len - query_len + 1, context_len + 1)
            tables.append(table[:num_blocks])
        else:
            ids = torch.tensor(table[:num_blocks], dtype=torch.long, device=device)
            prefills.append(PrefillChunk(start, query_len, context_len, ids))
        start += query_len
    width = max((len(t) for t in tables), default=1)
    padded = torch.zeros(max(len(tables), 1), width, dtype=torch.long)
    for i, table in enumerate(tables):
        padded[i, : len(table)] = torch.tensor(table, dtype=torch.long)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    contiguous = rows == list(range(len(rows)))
    kernel = KernelRows(None if contiguous else as_long(rows), padded.to(device), as_long(row_seq), as_long(row_len))
    empty = as_long([])
    return AttentionContext(slot_blocks, slot_offsets, 0, empty, empty, torch.zeros(0, 1, block_size, 1, dtype=torch.bool),
                            prefills, kernel if rows else None)


class PagedAttention:
    """Writes a step's K/V into the cache, then attends. Holds no weights; the cache tensors are
    set by the runner once it knows how many blocks fit."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext):
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        if ctx.kernel is not None:  # the kernels are built and serve this cache
            cpu_ops().write_cache(self.k_cache, k, ctx.slot_blocks, ctx.slot_offsets)
            cpu_ops().write_cache(self.v_cache, v, ctx.slot_blocks, ctx.slot_offsets)
        else:
            self.k_cache[ctx.slot_blocks, :, ctx.slot_offsets] = k.to(self.k_cache.dtype)
            self.v_cache[ctx.slot_blocks, :, ctx.slot_offsets] = v.to(self.v_cache.dtype)
        if ctx.flashinfer is not None:
            return ctx.flashinfer.run(q, self.k_cache, self.v_cache).view(q.shape[0], -1)
        out = torch.empty_like(q)
        if ctx.kernel is not None:
            self._kernel(q, out, ctx.kernel)
        if ctx.num_decodes:
            out[: ctx.num_decodes] = self._decode(q[: ctx.num_decodes], ctx)
        for chunk in ctx.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.num_queries)
            out[rows] = self._prefill(q[rows], chunk)
        return out.view(q.shape[0], -1)

    def _kernel(self, q: torch.Tensor, out: torch.Tensor, rows: KernelRows) -> None:
        count = rows.row_len.shape[0]
        selected = q[:count] if rows.rows is None else q.index_select(0, rows.rows)
        result = cpu_ops().paged_attention(selected.float(), self.k_cache, self.v_cache, rows.tables, rows.row_seq,
                                           rows.row_len, self.scale).to(q.dtype)
        if rows.rows is None:
            out[:count] = result
        else:
            out.index_copy_(0, rows.rows, result)

    def _decode(self, q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        num_seqs, seq_of_block = q.shape[0], ctx.decode_block_seq
        # [NB, kv_heads, block_size, head_dim] for the blocks read; [NB, kv_heads, head_dim, group] queries
        # (in the queries' dtype where the cache's differs)
        k = torch.index_select(self.k_cache, 0, ctx.decode_block_ids).to(q.dtype)  # faster than k_cache[ids] on CPU
        v = torch.index_select(self.v_cache, 0, ctx.decode_block_ids).to(q.dtype)
        q = q.view(num_seqs, self.num_kv_heads, self.group, self.head_dim) * self.scale
        scores = torch.matmul(k, q[seq_of_block].transpose(-1, -2))  # [NB, kv_heads, block_size, group]
        scores = scores.masked_fill(~ctx.decode_valid, float("-inf"))
        # Softmax over all blocks of a sequence: a max per sequence, then sums per sequence.
        block_max = scores.amax(dim=2)  # [NB, kv_heads, group]
        seq_max = torch.full((num_seqs, *block_max.shape[1:]), float("-inf"), dtype=q.dtype, device=q.device)
        seq_max = seq_max.scatter_reduce(0, seq_of_block[:, None, None].expand_as(block_max), block_max, "amax")
        probs = torch.exp(scores - seq_max[seq_of_block].unsqueeze(2))
        denom = torch.zeros_like(seq_max).index_add_(0, seq_of_block, probs.sum(dim=2))
        partial = torch.matmul(probs.transpose(-1, -2), v)  # [NB, kv_heads, group, head_dim]
        out = torch.zeros(num_seqs, *partial.shape[1:], dtype=q.dtype, device=q.device)
        out.index_add_(0, seq_of_block, partial)
        return (out / denom.unsqueeze(-1)).view(num_seqs, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        n, ctx_len = chunk.num_queries, chunk.context_len
        # [kv_heads, context_len, head_dim] from the sequence's blocks, in order
        k = torch.index_select(self.k_cache, 0, chunk.block_ids).transpose(0, 1).flatten(1, 2)[:, :ctx_len].to(q.dtype)
        v = torch.index_select(self.v_cache, 0, chunk.block_ids).transpose(0, 1).flatten(1, 2)[:, :ctx_len].to(q.dtype)
        # A batch axis of one: torch's CPU flash attention takes only 4-D inputs (3-D ones, or a
        # 3-D GQA fold, run its unfused math path: ~4x slower at 512 tokens, docs/benchmarks-log.md).
        q, k, v = q.transpose(0, 1)[None], k[None], v[None]  # [1, heads, n, head_dim]
        if ctx_len == n:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            # Queries sit at the end of the context: query i sees keys 0 .. ctx_len - n + i.
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= (
                torch.arange(n, device=q.device)[:, None] + (ctx_len - n)
            )
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)
