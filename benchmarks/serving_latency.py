"""Serving latency: TTFT and TPOT at 1, 8 and 32 concurrent streams over HTTP (OpenAI SSE) and gRPC,
against Pagoda's LLMServer in this process without Ray or Serve (`pagoda bench --target engine`),
on the same workload in the same run: what the serving path costs.

    python -m benchmarks.serving_latency [--levels 1,8,32] [--output-len 64] [--workload random --input-len 128]

Starts its own local Ray cluster + Serve on ports 18300/19300. Each level sends max(4, level)
requests, `level` at a time, each generating exactly --output-len tokens (greedy, ignore_eos):
one-turn chats, or `--workload random` prompts of --input-len tokens (what serving_sweep sends).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.bench import report
from cluster.bench.bench import already_running, run_levels
from cluster.bench.workloads import WorkloadSpec
from cluster.model_fetch import fetch_default_model
from cluster.serve import launcher

HTTP, GRPC = 18300, 19300


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--workload", choices=["chat", "random"], default="chat")
    parser.add_argument("--input-len", type=int, default=128, help="random prompts' length in tokens")
    parser.add_argument("--out-dir", default="benchmarks/results/serving_latency")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    model_dir = str(fetch_default_model())
    spec = WorkloadSpec(args.workload, input_len=args.input_len, output_len=args.output_len, turns=1)

    def measure(target: str, label: str) -> dict:
        return run_levels(label, levels, spec, already_running(target), lambda level: max(4, level), max_batch=max(levels))

    launcher.start({"model": model_dir, "engine": {"max_num_seqs": max(levels)}}, HTTP, GRPC)
    try:
        served = [measure(f"http://127.0.0.1:{HTTP}", "http"), measure(f"grpc://127.0.0.1:{GRPC}", "grpc")]
    finally:
        launcher.stop()
    engine = measure(f"engine:{model_dir}", "engine (no Ray)")

    for result in [*served, engine]:
        report.save(result, Path(args.out_dir) / f"{result['label'].split()[0]}.json")
        print(report.table(result) + "\n")
    print(report.ratio_table(engine, served))


if __name__ == "__main__":
    main()
