"""Building blocks of a Llama-family layer: RMSNorm, rotary embedding, SiLU-gated MLP activation,
and linear layers that load their own (tensor-parallel) shard of a checkpoint weight.

Every parameter carries a `weight_loader(param, loaded, shard_id=None)`, so the loader only maps
checkpoint names to parameters and dispatches; a layer knows how to cut its own slice. With
`tp_size == 1` the slices are the whole weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.cpu_ops import cpu_ops
from model.quantization import PackedWeight, pack_weight
from model.tp_layout import head_shard


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual): one pass instead of two."""
        ops = fused_ops_for(x)
        if ops is not None and x.dim() == 2:
            out, total = ops.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, total)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies as HF computes them, including linear and Llama 3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor
    # llama3: leave high frequencies alone, divide low ones by `factor`, blend in between.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position up to max_positions, looked up per token."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Looked up once per step and shared by every layer: [T, 1, head_dim] each."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]."""
    cos, sin = cos_sin
    ops = fused_ops_for(q)
    if ops is not None:
        return tuple(ops.rotary(q, k, cos, sin))
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def fused_ops_for(x: torch.Tensor):
    """Pagoda's CPU kernels where they serve this tensor (fp32 on the CPU), else None."""
    return cpu_ops() if x.dtype == torch.float32 and x.device.type == "cpu" else None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _shard(loaded: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    size = loaded.shape[dim] // tp_size
    return loaded.narrow(dim, tp_rank * size, size)


class LinearBase(nn.Module):
    packed: PackedWeight | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def pack(self, mode: str) -> None:
        """Swap the float weight for the format `mode` gives it (model/quantization.py), if any;
        the float copy is dropped."""
        packed = pack_weight(self.weight.data, self.bias.data.float() if self.bias is not None else None, mode)
        if packed is not None:
            self.packed, self.weight, self.bias = packed, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x) if self.packed is not None else F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias, 0, 1)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is a slice, no communication."""

    def __init__(self, in_features, out_features, bias=False, tp_rank=0, tp_size=1):
        super().__init__(in_features, out_features // tp_size, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(_shard(loaded, 0, self.tp_rank, self.tp_size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel weights stacked in one GEMM (gate and up projections)."""

    def __init__(self, in_features, out_sizes: list[int], bias=False, tp_rank=0, tp_size=1):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id: int = 0):
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        size = self.out_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(_shard(loaded, 0, self.tp_rank, self.tp_size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM. Each rank keeps the query heads and KV heads that
    `head_shard` gives it (KV heads replicated when there are fewer than ranks)."""

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, tp_rank=0, tp_size=1):
        self.head_dim = head_dim
        self.shard = head_shard(num_heads, num_kv_heads, tp_size, tp_rank)
        self.num_heads, self.num_kv_heads = len(self.shard.q_heads), len(self.shard.kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id: str = "q"):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, first_head = 0, q_size, self.shard.q_heads.start
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, first_head = kv_size, self.shard.kv_heads.start
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, first_head * self.head_dim, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed by an all-reduce (`reduce`).
    `input_slice` names this rank's input features when the split is not even (attention heads)."""

    def __init__(self, in_features, out_features, bias=False, tp_rank=0, tp_size=1, reduce=None,
                 input_slice: range | None = None):
        size = in_features // tp_size
        self.input_slice = input_slice or range(tp_rank * size, (tp_rank + 1) * size)
        super().__init__(len(self.input_slice), out_features, bias, tp_rank, tp_size)
        self.reduce = reduce

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # the bias is added once, after the reduction
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
        else:
            param.data.copy_(loaded.narrow(1, self.input_slice.start, len(self.input_slice)))

    def forward(self, x):
        out = super().forward(x)
        return self.reduce(out) if self.reduce is not None and self.tp_size > 1 else out


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
