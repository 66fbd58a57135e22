"""Throughput vs concurrency for Pagoda (HTTP and gRPC) and its peers, one after another in one
session on this machine, with the same `pagoda bench` workload for all:

    Pagoda         local Ray + Serve (launcher), OpenAI HTTP and gRPC ("pagoda"; HTTP only: "pagoda-http"),
                   its default weights (on the default model: the GGUF's own Q4_1 groups, lossless);
                   optionally dense fp32 ("pagoda-fp32"), dynamic int8 ("pagoda-int8") and the GGUF's
                   groups times int8 activations ("pagoda-int8x", llama.cpp's arithmetic), HTTP; each
                   of the default and int8x also with the engine in the ingress's process
                   ("pagoda-in-ingress", "pagoda-int8x-in-ingress")
    llama.cpp      llama-server from the llama-cpp-python sdist, same GGUF, --parallel = concurrency
    HF static      transformers in-process, batches of up to `concurrency`, padded (c=1: one at a time)

    python -m benchmarks.serving_sweep [--levels 1,4,16,32,64] [--targets pagoda,llama.cpp,hf]

Each level sends max(8, 2 x level) random-token prompts of --input-len tokens, each generating
exactly --output-len tokens (ignore_eos, greedy). Then the cross-talk probe at the top level.
Writes one result JSON per target, the ratio table, and plots under --plots-dir.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import llama_cpp_server
from cluster.bench import report
from cluster.bench.bench import already_running, run_bench, run_levels
from cluster.bench.workloads import WorkloadSpec
from cluster.model_fetch import fetch_default_model
from cluster.serve import launcher

HTTP, GRPC, LLAMA = 18300, 19300, 18500


def probe(label: str, level: int, target_at) -> dict:
    with target_at(level) as target:
        result = run_bench(target, WorkloadSpec("probe", num_prompts=level, seed=11), label=f"{label} probe", concurrencies=[level])
    return result["runs"][0]["summary"]["probe"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,4,16,32,64")
    parser.add_argument("--targets", default="pagoda,llama.cpp,hf")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out-dir", default="benchmarks/results/sweep")
    parser.add_argument("--plots-dir", default="benchmarks/results/sweep",
                        help="docs/bench to replace the figures docs/benchmarks-log.md shows")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    targets = args.targets.split(",")
    spec = WorkloadSpec("random", input_len=args.input_len, output_len=args.output_len)
    prompts_at = lambda level: max(8, 2 * level)  # noqa: E731
    out = Path(args.out_dir)
    results, probes = [], {}

    in_ingress = {"engine_in_ingress": True}
    for variant, engine, app, labels in (
        ("pagoda", {}, {}, ("pagoda-http", "pagoda-grpc")),
        ("pagoda-http", {}, {}, ("pagoda-http",)),
        ("pagoda-fp32", {"quantization": "none"}, {}, ("pagoda-fp32-http",)),
        ("pagoda-int8", {"quantization": "int8"}, {}, ("pagoda-int8-http",)),
        ("pagoda-int8x", {"quantization": "int8-activations"}, {}, ("pagoda-int8x-http",)),
        ("pagoda-in-ingress", {}, in_ingress, ("pagoda-in-ingress-http",)),
        ("pagoda-int8x-in-ingress", {"quantization": "int8-activations"}, in_ingress, ("pagoda-int8x-in-ingress-http",)),
    ):
        if variant not in targets:
            continue
        launcher.start({"model": str(fetch_default_model()), "engine": {"max_num_seqs": max(levels), **engine},
                        "max_waiting_requests": 4 * max(levels), **app}, HTTP, GRPC)
        try:
            for label in labels:
                target = f"grpc://127.0.0.1:{GRPC}" if label.endswith("grpc") else f"http://127.0.0.1:{HTTP}"
                results.append(run_levels(label, levels, spec, already_running(target), prompts_at))
                probes[label] = probe(label, max(levels), already_running(target))
        finally:
            launcher.stop()
    if "llama.cpp" in targets:
        def llama_at(level):
            return llama_cpp_server.serving(LLAMA, parallel=level, ctx_per_slot=2 * (args.input_len + args.output_len) + 64)

        results.append(run_levels("llama.cpp", levels, spec, llama_at, prompts_at))
        probes["llama.cpp"] = probe("llama.cpp", max(levels), llama_at)
    if "hf" in targets:
        results.append(run_levels("hf-static", levels, spec, already_running("hf"), prompts_at))
        probes["hf-static"] = probe("hf-static", max(levels), already_running("hf"))

    for result in results:
        report.save(result, out / f"{result['label']}.json")
        print(report.table(result) + "\n")
    print(report.ratio_table(results[0], results[1:]))
    print("cross-talk probes:", probes)
    (out / "probes.json").write_text(json.dumps(probes, indent=1))
    for path in report.plot(results, args.plots_dir, prefix="sweep"):
        print("plot:", path)


if __name__ == "__main__":
    main()
