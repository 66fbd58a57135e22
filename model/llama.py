"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Tokens of every sequence in a step are flattened into one dimension, so linear layers see one
[T, hidden] matrix whatever the mix of prefill chunks and decodes; only attention looks at the
per-sequence layout, through the AttentionContext.
"""

from __future__ import annotations

import torch
from torch import nn

from model.attention import AttentionContext, PagedAttention
from model.config import ModelConfig
from model.layers import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
    apply_rotary,
    silu_and_mul,
)
from model.decode_stack import serves as stack_serves
from model.quantization import PackedWeight, pack_weight


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank=0, tp_size=1, reduce=None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads,
            config.num_key_value_heads, config.qkv_bias, tp_rank, tp_size,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        q_heads = self.qkv_proj.shard.q_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size, config.o_bias,
            tp_rank, tp_size, reduce, input_slice=range(q_heads.start * self.head_dim, q_heads.stop * self.head_dim),
        )
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, ctx: AttentionContext):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, rope)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), ctx)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank=0, tp_size=1, reduce=None):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], config.mlp_bias, tp_rank, tp_size
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, tp_rank, tp_size, reduce)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank=0, tp_size=1, reduce=None):
        super().__init__()
        self.self_attn = LlamaAttention(config, tp_rank, tp_size, reduce)
        self.mlp = LlamaMLP(config, tp_rank, tp_size, reduce)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, residual, ctx):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id) for weights we fuse
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int, tp_rank=0, tp_size=1, reduce=None):
        super().__init__()
        self.config = config
        self.tp_size = tp_size
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp_rank, tp_size, reduce) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else VocabEmbedding(config.vocab_size, config.hidden_size)
        self.packed_head: PackedWeight | None = None
        # The C++ layer stack (model/decode_stack.py), set by whoever runs the model once its weights
        # and caches are final; steps it serves skip the Python layers.
        self.decode_stack = None

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                after_layer=None, embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; `compute_logits` runs the head on chosen rows.
        after_layer(i), if given, runs once layer i has written its KV (to ship it while i+1 runs).
        embeds (rows, values): input embeddings of those rows instead of their tokens' (media)."""
        hidden, residual = self.embed_tokens(input_ids), None
        if embeds is not None:
            hidden[embeds[0]] = embeds[1]
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        if self.decode_stack is not None and after_layer is None and stack_serves(ctx):
            caches, kernel = self.attention_layers, ctx.kernel
            return self.decode_stack.forward(hidden, *rope, [a.k_cache for a in caches], [a.v_cache for a in caches],
                                             ctx.slot_blocks, ctx.slot_offsets, kernel.tables, kernel.row_seq,
                                             kernel.row_len)
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(rope, hidden, residual, ctx)
            if after_layer is not None:
                after_layer(i)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self.packed_head.linear(hidden).float()
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return torch.nn.functional.linear(hidden, head.weight).float()

    def quantize(self, mode: str) -> dict[str, int]:
        """Pack the linear layers' and the LM head's weights as `mode` says (model/quantization.py);
        the embedding lookup stays float. Returns how many matrices took each format."""
        self.decode_stack = None  # it holds the weights it was built from
        formats: dict[str, int] = {}
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.pack(mode)
                name = _format_name(module.packed)
                formats[name] = formats.get(name, 0) + 1
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        self.packed_head = pack_weight(head.weight.data, None, mode)
        if self.packed_head is not None and self.lm_head is not None:
            self.lm_head = None
        name = _format_name(self.packed_head)
        formats[name] = formats.get(name, 0) + 1
        return formats


def _format_name(packed: PackedWeight | None) -> str:
    return "dense" if packed is None else getattr(packed, "kind", type(packed).__name__)
