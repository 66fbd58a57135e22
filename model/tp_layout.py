"""How attention heads split across tensor-parallel ranks.

Query heads always stay with their KV head (grouped-query attention), so every rank has a whole
number of query heads per local KV head and attention runs unchanged on each rank:

- tp_size <= KV heads: each rank takes a contiguous run of whole KV groups, as even as possible.
  SmolLM2 (9 query heads, 3 KV heads) on 2 ranks: rank 0 KV heads 0-1 with query heads 0-5,
  rank 1 KV head 2 with query heads 6-8. Uneven (6 vs 3 heads), but no KV head is stored twice.
- tp_size > KV heads: each KV head is replicated on tp_size / KV heads ranks, which split its query
  heads evenly (SmolLM2 on 3 ranks: one KV head and three query heads each; on 9: one and one).
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import UnsupportedModelError


@dataclass(frozen=True)
class HeadShard:
    q_heads: range  # global indices of this rank's query heads
    kv_heads: range  # global indices of the KV heads those query heads read


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in [0, {tp_size})")
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        base, extra = divmod(num_kv_heads, tp_size)
        start = rank * base + min(rank, extra)
        kv = range(start, start + base + (rank < extra))
        return HeadShard(range(kv.start * group, kv.stop * group), kv)
    replicas, rest = divmod(tp_size, num_kv_heads)
    if rest or group % replicas:
        raise UnsupportedModelError(
            f"tensor parallel size {tp_size} does not fit {num_heads} query heads over {num_kv_heads} KV heads: "
            f"use a size that divides {num_kv_heads}, or a multiple of it that divides {num_heads}"
        )
    kv_head, part = divmod(rank, replicas)
    per_rank = group // replicas
    start = kv_head * group + part * per_rank
    return HeadShard(range(start, start + per_rank), range(kv_head, kv_head + 1))
