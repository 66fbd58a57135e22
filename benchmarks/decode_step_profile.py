"""Where a decode step's time goes: the engine step of a decode batch at a 512-token context, and
the share of it spent in attention (cache write + paged attention, timed around every layer's
call), for the weight formats and attention paths Pagoda has, in one session on this machine.

    python -m benchmarks.decode_step_profile [--batches 1,32] [--context 512] [--kv-cache-dtypes auto,bfloat16]

Configurations: dense fp32 weights with gathered-block attention (the path before the CPU
kernels), dense fp32 with the paged kernel, and the default (on the default model: its GGUF's own
Q4_1 / Q8_0 groups) with the paged kernel, through the Python layers and through the C++ layer
stack (the default); `--configs 4,5`: the default's groups times activations rounded to int8
(`int8-activations`), the same two ways. Also one 512-token prefill chunk per configuration. Each
configuration runs once per KV cache dtype asked for (`kv_cache_dtype`; auto: the model's, fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.decode_batch import blocks_per_request, decoding_batch
from cluster import LLM, SamplingParams
from cluster.bench.report import markdown_rows, save_rows
from cluster.model_fetch import fetch_default_model
from model import decode_stack
from model.attention import PagedAttention
from model.loader import dtype_name

# (label, quantization, paged kernel, C++ layer stack); the attention share is timed around the
# Python layers' attention calls, so the stack's rows have none.
CONFIGS = [("fp32 dense, gathered blocks", "none", False, False), ("fp32 dense, paged kernel", "none", True, False),
           ("default (auto), paged kernel", "auto", True, False),
           ("default (auto), paged kernel, layer stack", "auto", True, True),
           ("int8 activations, paged kernel", "int8-activations", True, False),
           ("int8 activations, paged kernel, layer stack", "int8-activations", True, True)]


PREFILL_CHUNK = 512  # the engine's max_num_batched_tokens here: one prefill chunk a step
STEPS, MIXED_STEPS = 12, 5  # decode steps timed, then steps that each add a new prompt
BLOCK_SIZE = 16  # the engine's default


class AttentionClock:
    """Adds up the wall time of every PagedAttention call (all layers) while installed."""

    def __init__(self):
        self.seconds = 0.0
        self._original = PagedAttention.__call__

    def __enter__(self):
        original, clock = self._original, self

        def timed(attn, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(attn, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start

        PagedAttention.__call__ = timed
        return self

    def __exit__(self, *exc):
        PagedAttention.__call__ = self._original


def decode_profile(llm: LLM, batch: int, context: int, steps: int = STEPS) -> tuple[float, float, float]:
    """(median step ms, attention share of the step, median ms of a mixed step) for a decode
    batch at ~context tokens; a mixed step is the same batch plus a new 128-token prompt's prefill
    (what a server runs whenever a request arrives while others decode)."""
    engine = llm.engine
    prompts = [[1000 + (i * 7 + j) % 30000 for j in range(context)] for i in range(batch)]
    times, shares, mixed = [], [], []
    with decoding_batch(engine, prompts, steps + MIXED_STEPS, tag=f"d{batch}"):
        for _ in range(steps):
            with AttentionClock() as clock:
                start = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - start
            times.append(elapsed)
            shares.append(clock.seconds / elapsed)
        for r in range(MIXED_STEPS):
            engine.add_request(f"m{batch}-{r}", [20000 + r * 200 + j for j in range(128)], SamplingParams(max_tokens=1))
            start = time.perf_counter()
            engine.step()
            mixed.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3, statistics.median(shares[2:]), statistics.median(mixed[1:]) * 1e3


def prefill_ms(llm: LLM, tokens: int = PREFILL_CHUNK, repeats: int = 4) -> float:
    engine = llm.engine
    times = []
    for r in range(repeats):
        engine.add_request(f"p{r}", [3000 + r * 600 + j for j in range(tokens)], SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--configs", default="0,1,2,3", help="which CONFIGS rows to run (indices)")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="kv_cache_dtype of each run, a comma list")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_step_profile.json"))
    args = parser.parse_args()
    model_dir = str(fetch_default_model())
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    runs = [(config, kv) for config in (CONFIGS[int(i)] for i in args.configs.split(","))
            for kv in args.kv_cache_dtypes.split(",")]
    for (label, quantization, kernel, stack), kv_cache_dtype in runs:
        os.environ[decode_stack.SWITCH] = "1" if stack else "0"  # read when the model builds its stack
        most_blocks = blocks_per_request(max(batches), args.context, STEPS + MIXED_STEPS, PREFILL_CHUNK, BLOCK_SIZE)
        llm = LLM(model_dir, num_blocks=(max(batches) + 1) * most_blocks, quantization=quantization,
                  max_num_batched_tokens=PREFILL_CHUNK, kv_cache_dtype=kv_cache_dtype,
                  enable_prefix_caching=False)  # every prompt computed, however often it recurs
        runner = llm.engine.executor
        if not kernel:
            runner.kernel_max_queries = 0
        row = {"config": label, "kv_cache": dtype_name(runner.kv_dtype), "weights": runner.weight_formats,
               "prefill_512_ms": round(prefill_ms(llm), 1)}
        for batch in batches:
            step, share, mixed = decode_profile(llm, batch, args.context)
            row[f"step_ms_b{batch}"] = round(step, 1)
            row[f"attention_share_b{batch}"] = round(share, 3) if not stack else None
            row[f"mixed_step_ms_b{batch}"] = round(mixed, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        llm.shutdown()
    save_rows(args.out, rows)
    headers = list(rows[0])
    print(markdown_rows(headers, [[str(row[h]) for h in headers] for row in rows]))


if __name__ == "__main__":
    main()
