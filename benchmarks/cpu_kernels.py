"""Pagoda's CPU kernels on the default model's shapes: the group kernel against dense fp32
(MKL's `F.linear`), and paged decode attention over a whole model's caches.

    python -m benchmarks.cpu_kernels [--rows 1,8,32,256] [--attention-rows 32] [--context 512]

Group kernel: microseconds per product, 2 threads, the weight hot in cache (each product is
repeated), for random Q4_1 weights (the layers) and Q8_0 (the LM head), and the same values dense;
the group kernel at every row count (an engine takes torch's GEMM from the row count that its
load-time measurement, printed last, chose); then the same weights with activations rounded to
int8 (`quantization: "int8-activations"`).
Attention: milliseconds for 30 layers' paged_attention calls, `--attention-rows` decode rows at
`--context` tokens each, 9 query / 3 KV heads of 64, blocks of 16 scattered over a cache larger
than the L3 (as a server's are), fp32 and bf16 caches, and the bytes of K/V read per second.
"""

from __future__ import annotations

import argparse
import time

import torch

from model.cpu_ops import cpu_ops
from model.quantization import NEVER_DENSE, GroupedWeight, choose_dense_from, quantize_grouped

SHAPES = {"qkv 576->960": (576, 960, 4), "gate_up 576->3072": (576, 3072, 4), "down 1536->576": (1536, 576, 4),
          "lm_head 576->49152": (576, 49152, 8)}


def microseconds(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32,256")
    parser.add_argument("--attention-rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    torch.manual_seed(0)
    cpu_ops().set_dense_from(NEVER_DENSE)
    print("| shape | x rows | fp32 µs | group µs | int8 activations µs |\n|---|---:|---:|---:|---:|")
    for name, (k, n, bits) in SHAPES.items():
        grouped = quantize_grouped(torch.randn(n, k) * 0.05, bits)
        dense = grouped.dequantize()
        int8x = GroupedWeight(grouped.qweight, grouped.d, grouped.m, None, int8_activations=True)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            fp32 = microseconds(lambda: torch.nn.functional.linear(x, dense))
            group = microseconds(lambda: grouped.linear(x))
            integers = microseconds(lambda: int8x.linear(x))
            print(f"| {name} | {rows} | {fp32:,.0f} | {group:,.0f} | {integers:,.0f} |", flush=True)
    gate_up = quantize_grouped(torch.randn(3072, 576) * 0.05, 4)
    print(f"\nload-time choice (gate_up): torch's GEMM from {choose_dense_from(gate_up) or 'no row count'}")
    print(f"\n| paged attention, {args.attention_rows} rows x {args.context} tokens, 30 layers | ms | K/V GB/s |\n|---|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        ms, rate = attention_ms(args.attention_rows, args.context, dtype)
        print(f"| {str(dtype).removeprefix('torch.')} cache | {ms:.1f} | {rate:.1f} |", flush=True)


def attention_ms(rows: int, context: int, dtype: torch.dtype, layers: int = 30, block: int = 16) -> tuple[float, float]:
    """(mean ms for `layers` calls, GB/s of K/V read) for decode rows over scattered blocks."""
    heads, kv_heads, dim = 9, 3, 64
    per_row = context // block
    num_blocks = rows * per_row + 64
    caches = [(torch.randn(num_blocks, kv_heads, block, dim).to(dtype), torch.randn(num_blocks, kv_heads, block, dim).to(dtype))
              for _ in range(layers)]
    tables = torch.randperm(num_blocks)[: rows * per_row].view(rows, per_row)
    row_seq, row_len = torch.arange(rows), torch.full((rows,), context)
    q = torch.randn(rows, heads, dim)
    ops = cpu_ops()

    def all_layers():
        for k, v in caches:
            ops.paged_attention(q, k, v, tables, row_seq, row_len, dim**-0.5)

    seconds = microseconds(all_layers, repeats=5) / 1e6
    read = layers * rows * context * kv_heads * dim * 2 * caches[0][0].element_size()
    return seconds * 1e3, read / seconds / 1e9


if __name__ == "__main__":
    main()
