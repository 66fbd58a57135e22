"""Pagoda's group kernel against dense fp32 (MKL's `F.linear`) on the default model's shapes.

    python -m benchmarks.cpu_kernels [--rows 1,8,32,256]

Microseconds per product, 2 threads, the weight hot in cache (each product is repeated), for
random Q4_1 weights (the layers) and Q8_0 (the LM head), and the same values dense.
"""

from __future__ import annotations

import argparse
import time

import torch

from model.quantization import quantize_grouped

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
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| shape | x rows | fp32 µs | group µs |\n|---|---:|---:|---:|")
    for name, (k, n, bits) in SHAPES.items():
        grouped = quantize_grouped(torch.randn(n, k) * 0.05, bits)
        dense = grouped.dequantize()
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            fp32 = microseconds(lambda: torch.nn.functional.linear(x, dense))
            group = microseconds(lambda: grouped.linear(x))
            print(f"| {name} | {rows} | {fp32:,.0f} | {group:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
