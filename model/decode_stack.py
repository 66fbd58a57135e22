"""The decoder layers in one C++ call (DecodeStack in model/csrc/cpu_ops.cpp) for steps that the
paged kernel serves whole: decodes and short chunks, on the CPU, fp32, one rank.

At a few tokens per step a layer is ~20 small ops, and on a 2-core host their Python dispatch
costs as much as their arithmetic; the stack runs the same ops (the same kernels, in the same
order as model/llama.py) without returning to Python between them. Other steps (long prefill
chunks, KV export layer by layer, tensor parallelism, int8 weights) take the Python path.
"""

from __future__ import annotations

import os

import torch

from model.attention import AttentionContext
from model.cpu_ops import cpu_ops
from model.layers import LinearBase
from model.quantization import GroupedWeight

SWITCH = "PAGODA_DECODE_STACK"  # "0": every step through the Python layers (for comparisons)


def linear_parts(linear: LinearBase):
    """(weight, q, d, m, bias, int8_activations) as DecodeStack.add_layer takes them, or None for a
    format it lacks."""
    packed = linear.packed
    if packed is None:
        return linear.weight.data, None, None, None, None if linear.bias is None else linear.bias.data, False
    if isinstance(packed, GroupedWeight):
        return None, packed.qweight, packed.d, packed.m, packed.bias, packed.int8_activations
    return None


def build_decode_stack(model):
    """A DecodeStack holding `model`'s weights (a LlamaForCausalLM after `quantize`), or None
    where it cannot serve this model (no kernels, not fp32, TP, a weight format it lacks)."""
    ops, norm = cpu_ops(), model.norm.weight
    if ops is None or os.environ.get(SWITCH, "1") == "0" or model.tp_size > 1:
        return None
    if norm.dtype != torch.float32 or norm.device.type != "cpu":
        return None
    first = model.layers[0].self_attn
    stack = ops.DecodeStack(first.num_heads, first.num_kv_heads, first.head_dim, model.config.rms_norm_eps, norm.data)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = [linear_parts(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in parts):
            return None
        stack.add_layer(layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data, *parts)
    return stack


def serves(ctx: AttentionContext) -> bool:
    """Whether every row of the step goes to the paged kernel: a kernel context (which gathers
    nothing) without a long chunk."""
    return ctx.kernel is not None and not ctx.prefills
