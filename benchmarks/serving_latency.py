"""Serving latency: TTFT and TPOT at 1, 8 and 32 concurrent streams over HTTP (OpenAI SSE) and gRPC,
against Pagoda's LLMServer in this process without Ray or Serve (`pagoda bench --target engine`),
on the same workload in the same run: what the serving path costs.

    python -m benchmarks.serving_latency [--levels 1,8,32] [--output-len 256] [--rounds 3]
                                         [--workload random --input-len 128]
                                         [--quantization int8-activations] [--engine-in-ingress]

Starts its own local Ray cluster + Serve on ports 18300/19300. Each level sends max(4, level)
requests, `level` at a time, each generating exactly --output-len tokens (greedy, ignore_eos):
one-turn chats, or `--workload random` prompts of --input-len tokens (what serving_sweep sends).

A round is the served runs, then the in-process runs right after. The small VMs this runs on
drift in speed from one quarter hour to the next (one stream in process: 10.7 and 17 ms a token
twenty minutes apart, docs/benchmarks-log.md), so a ratio is only fair between runs minutes apart:
with --rounds N the rounds alternate and the summary is each ratio's median over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
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
    # 256: with 64, one stream's run (4 requests) lasts ~1.5 s here and its ratio spread 1.15-1.72x
    # between rounds minutes apart (docs/benchmarks-log.md)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1, help="served then in process, this many times in turn")
    parser.add_argument("--workload", choices=["chat", "random"], default="chat")
    parser.add_argument("--input-len", type=int, default=128, help="random prompts' length in tokens")
    parser.add_argument("--quantization", default=None, help="the engine's weight format, served and in process")
    parser.add_argument("--engine-in-ingress", action="store_true", help="serve with the engine in the ingress's process")
    parser.add_argument("--out-dir", default="benchmarks/results/serving_latency")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    model_dir = str(fetch_default_model())
    spec = WorkloadSpec(args.workload, input_len=args.input_len, output_len=args.output_len, turns=1)

    engine_options = {"quantization": args.quantization} if args.quantization else {}

    def measure(target: str, label: str) -> dict:
        return run_levels(label, levels, spec, already_running(target), lambda level: max(4, level), max_batch=max(levels),
                          engine_options=engine_options)

    ratios_by_round = []
    for round_ in range(1, args.rounds + 1):
        launcher.start({"model": model_dir, "engine": {"max_num_seqs": max(levels), **engine_options},
                        "engine_in_ingress": args.engine_in_ingress}, HTTP, GRPC)
        try:
            served = [measure(f"http://127.0.0.1:{HTTP}", "http"), measure(f"grpc://127.0.0.1:{GRPC}", "grpc")]
        finally:
            launcher.stop()
        engine = measure(f"engine:{model_dir}", "engine (no Ray)")

        suffix = f"-round{round_}" if args.rounds > 1 else ""
        for result in [*served, engine]:
            report.save(result, Path(args.out_dir) / f"{result['label'].split()[0]}{suffix}.json")
            print(report.table(result) + "\n")
        print(report.ratio_table(engine, served))
        ratios_by_round.append({(other["label"], row["load"]): row for other in served for row in report.ratios(engine, other)})
    if args.rounds > 1:
        print(median_ratios(ratios_by_round))


def median_ratios(ratios_by_round: list[dict]) -> str:
    """Each served label's ratios to the in-process runs of its own round, median over the rounds
    (TTFT/TPOT x = served / in process)."""
    lines = [f"median over {len(ratios_by_round)} rounds, served / in process",
             f"{'target':>8} {'load':>10} {'out tok/s x':>12} {'TTFT p50 x':>11} {'TPOT p50 x':>11}   TPOT x per round"]
    for key in ratios_by_round[0]:
        rows = [round_[key] for round_ in ratios_by_round if key in round_]
        median = {name: statistics.median(row[name] for row in rows) for name in ("output_throughput", "ttft_median", "tpot_median")}
        each = " ".join(f"{row['tpot_median']:.2f}" for row in rows)
        lines.append(f"{key[0]:>8} {key[1]:>10} {median['output_throughput']:>12.2f} {median['ttft_median']:>11.2f} "
                     f"{median['tpot_median']:>11.2f}   {each}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
