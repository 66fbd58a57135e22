"""Engine step time at TP=1 vs TP=2 (gloo, and deepspeed's shared-memory all-reduce), one session.

    python -m benchmarks.tp_step_time [--out benchmarks/results/tp_step_time.json]

For each configuration: the median engine step (schedule + workers + sampling) of a decode batch
of 1 and of 32 sequences (128-token prompts), and of one 512-token prefill chunk. TP=1 runs in
this process with every core; each TP=2 rank is a Ray actor with half of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray

from cluster import LLM, SamplingParams
from cluster.bench.report import markdown_rows, save_rows
from cluster.model_fetch import fetch_default_model

CONFIGS = [("TP=1", 1, "auto"), ("TP=2 gloo", 2, "gloo"), ("TP=2 deepspeed-shm", 2, "auto")]


def decode_step_ms(llm: LLM, batch: int, steps: int = 20) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, list(range(1000 + i, 1128 + i)), params)
    while (stats := engine.stats()).num_waiting or stats.num_prefilling:
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for request_id in ids:
        engine.abort_request(request_id)
    return statistics.median(times[3:]) * 1e3


def prefill_step_ms(llm: LLM, repeats: int = 5) -> float:
    engine = llm.engine
    times = []
    for r in range(repeats):
        engine.add_request(f"p{r}", list(range(2000 + r * 600, 2512 + r * 600)), SamplingParams(max_tokens=1))
        t = time.perf_counter()
        engine.step()  # the whole 512-token prompt in one chunk; samples its token, finishes
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tp_step_time.json"))
    args = parser.parse_args()
    model_dir = str(fetch_default_model())
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    rows = []
    for label, tp, collective in CONFIGS:
        llm = LLM(model_dir, tensor_parallel_size=tp, tp_collective=collective, num_blocks=512,
                  max_num_batched_tokens=512, max_num_seqs=64, enable_prefix_caching=False)
        decode_step_ms(llm, 4, steps=6)  # warm-up
        row = {"config": label, "decode_b1_ms": decode_step_ms(llm, 1), "decode_b32_ms": decode_step_ms(llm, 32),
               "prefill_512_ms": prefill_step_ms(llm)}
        if tp > 1:
            row["collective"] = llm.engine.executor.describe()[0]["collective"]
            llm.shutdown()
        rows.append(row)
        print(json.dumps(row))
    ray.shutdown()
    save_rows(args.out, rows)
    print(markdown_rows(["config", "decode batch 1 (ms)", "decode batch 32 (ms)", "prefill 512 tokens (ms)"],
                        [[r["config"], f"{r['decode_b1_ms']:.1f}", f"{r['decode_b32_ms']:.1f}", f"{r['prefill_512_ms']:.1f}"]
                         for r in rows]))


if __name__ == "__main__":
    main()
