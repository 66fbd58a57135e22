"""Mixed load, colocated vs disaggregated, one session: steady decode streams while long prompts
arrive. What disaggregation is for: a long prefill no longer stalls the decode streams' tokens.

    python -m benchmarks.disaggregation [--streams 8] [--long-rate 0.1] [--out benchmarks/results/disaggregation.json]

Each mode is a fresh `pagoda serve` path (launcher.start) on this machine's cores:
  colocated      one engine (all cores): decodes and 512-token prefill chunks share its steps;
  disaggregated  PrefillServer (1 torch thread) + decode LLMServer (1 torch thread), TP=1 each.
Load, over gRPC: `--streams` concurrent random-token requests (128 in, 128 out) for the steady
decode, and `--long-count` docqa prompts (~1536 tokens, 8 out) arriving as a Poisson process.
Reported: ITL and TPOT of the steady streams (P50/P99), TTFT of the long prompts, throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from cluster.bench import runner, workloads
from cluster.bench.backends import GrpcBackend, default_model
from cluster.bench.metrics import summarize
from cluster.bench.report import machine
from cluster.serve import launcher

HTTP_PORT, GRPC_PORT = 8200, 9200
MODES = {
    "colocated": {"torch_threads": 2},
    "disaggregated": {"disaggregated": True, "torch_threads": 1, "prefill_torch_threads": 1},
}


async def mixed_load(steady, long, streams: int, long_rate: float) -> dict:
    backend = GrpcBackend(f"127.0.0.1:{GRPC_PORT}", ignore_eos=True)
    await backend.start()
    try:
        await runner.run(backend, steady[:2], concurrency=1, progress=False)  # warm-up
        steady_run = runner.run(backend, steady, concurrency=streams, progress=False)
        long_run = runner.run(backend, long, request_rate=long_rate, seed=1, progress=False)
        (steady_records, steady_s), (long_records, long_s) = await asyncio.gather(steady_run, long_run)
    finally:
        await backend.close()
    return {"steady": summarize(steady_records, steady_s), "long": summarize(long_records, long_s)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--steady-count", type=int, default=32)
    parser.add_argument("--long-count", type=int, default=8)
    parser.add_argument("--long-rate", type=float, default=0.1, help="long prompts per second (Poisson)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/disaggregation.json"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model(None))
    steady = workloads.build(workloads.WorkloadSpec("random", args.steady_count + 2, 128, 128, seed=3), tokenizer)
    long = workloads.build(workloads.WorkloadSpec("docqa", args.long_count, 1536, 8, seed=4), tokenizer)
    results = {}
    for mode, app_args in MODES.items():
        started = time.perf_counter()
        launcher.start({**app_args, "engine": {"max_num_batched_tokens": 512, "max_num_seqs": 64}},
                       HTTP_PORT, GRPC_PORT, num_cpus=4)
        try:
            results[mode] = asyncio.run(mixed_load(steady[2:], long, args.streams, args.long_rate))
            results[mode]["warm_start_s"] = time.perf_counter() - started
        finally:
            launcher.stop()
        s, lg = results[mode]["steady"], results[mode]["long"]
        print(f"{mode}: ITL p50 {s['itl_ms']['median']:.0f} p99 {s['itl_ms']['p99']:.0f} ms, TPOT p50 "
              f"{s['tpot_ms']['median']:.0f} ms, steady {s['output_throughput']:.1f} tok/s, long TTFT p50 "
              f"{lg['ttft_ms']['median']:.0f} ms, failures {s['failures'] or lg['failures'] or 'none'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
                                    "options": vars(args) | {"out": str(args.out)}, "results": results}, indent=2))
    print("| mode | steady ITL p50 / p99 (ms) | steady TPOT p50 / p99 (ms) | steady out tok/s | long TTFT p50 / p99 (ms) |")
    print("|---|---|---|---|---|")
    for mode, r in results.items():
        s, lg = r["steady"], r["long"]
        print(f"| {mode} | {s['itl_ms']['median']:.0f} / {s['itl_ms']['p99']:.0f} | {s['tpot_ms']['median']:.0f} / "
              f"{s['tpot_ms']['p99']:.0f} | {s['output_throughput']:.1f} | {lg['ttft_ms']['median']:.0f} / {lg['ttft_ms']['p99']:.0f} |")


if __name__ == "__main__":
    main()
