"""Serving latency: TTFT and TPOT at 1, 8 and 32 concurrent streams over HTTP (OpenAI SSE) and gRPC,
against the offline engine on the same workload in the same run (the serving path's overhead).

    python benchmarks/serving_latency.py [--levels 1,8,32] [--max-tokens 64]

Starts its own local Ray cluster + Serve on ports 18300/19300. Each level sends one wave of
`level` requests at once (level 1: 4 requests one after another); every request generates exactly
--max-tokens tokens (ignore_eos, greedy). TTFT: send -> first token; TPOT: (last - first) / (n - 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import requests

from benchmarks.offline_throughput import QUESTIONS, machine
from cluster import LLM, SamplingParams
from cluster.model_fetch import fetch_default_model
from cluster.serve import launcher
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc as pb_grpc

HTTP, GRPC = 18300, 19300


def question(i: int) -> str:
    return f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"


def http_stream(i: int, max_tokens: int) -> tuple[float, float, int]:
    start = time.perf_counter()
    first = last = None
    n = 0
    with requests.post(f"http://127.0.0.1:{HTTP}/v1/chat/completions", stream=True, timeout=600, json={
            "messages": [{"role": "user", "content": question(i)}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            first = first or now
            last = now
            n += 1
    return first - start, last - start, n


def grpc_stream(stub, i: int, max_tokens: int) -> tuple[float, float, int]:
    start = time.perf_counter()
    first = last = None
    n = 0
    request = pb.GenerateRequest(
        messages=[pb.Message(role="user", parts=[pb.Part(text=question(i))])],
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    for response in stub.Generate(request):
        now = time.perf_counter()
        first = first or now
        last = now
        n += len(response.token_ids)
    return first - start, last - start, n


def offline_wave(llm: LLM, ids: list[int], max_tokens: int) -> list[tuple[float, float, int]]:
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    first, last, counts = {}, {}, {}
    for i in ids:
        engine.add_request(str(i), engine.encode_prompt(messages=[{"role": "user", "content": question(i)}]), params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            now = time.perf_counter()
            first.setdefault(delta.request_id, now)
            last[delta.request_id] = now
            counts[delta.request_id] = counts.get(delta.request_id, 0) + 1
    return [(first[str(i)] - start, last[str(i)] - start, counts[str(i)]) for i in ids]


def run_level(level: int, send) -> list[tuple[float, float, int]]:
    if level == 1:
        return [send(i) for i in range(4)]
    with ThreadPoolExecutor(level) as pool:
        return list(pool.map(send, range(level)))


def summarize(samples: list[tuple[float, float, int]]) -> dict:
    ttft = [s[0] * 1e3 for s in samples]
    tpot = [(s[1] - s[0]) / (s[2] - 1) * 1e3 for s in samples if s[2] > 1]
    p95 = lambda xs: statistics.quantiles(xs, n=20)[-1] if len(xs) > 1 else xs[0]  # noqa: E731
    return {"requests": len(samples), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_p95": p95(ttft),
            "tpot_ms_p50": statistics.median(tpot), "tpot_ms_p95": p95(tpot)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/serving_latency.json")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    model_dir = str(fetch_default_model())
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "max_tokens": args.max_tokens, "levels": {}}

    launcher.start({"model": model_dir, "engine": {"max_num_seqs": max(levels)}}, HTTP, GRPC)
    channel = grpc.insecure_channel(f"127.0.0.1:{GRPC}")
    stub = pb_grpc.InferenceStub(channel)
    run_level(1, lambda i: grpc_stream(stub, i, 4))  # warm-up
    served = {}
    for level in levels:
        served[level] = {
            "http": summarize(run_level(level, lambda i: http_stream(i, args.max_tokens))),
            "grpc": summarize(run_level(level, lambda i: grpc_stream(stub, i, args.max_tokens))),
        }
        print(level, served[level], flush=True)
    channel.close()
    launcher.stop()

    llm = LLM(model_dir, max_num_seqs=max(levels))
    offline_wave(llm, [0], 4)  # warm-up
    for level in levels:
        if level == 1:
            samples = [offline_wave(llm, [i], args.max_tokens)[0] for i in range(4)]
        else:
            samples = offline_wave(llm, list(range(level)), args.max_tokens)
        offline = summarize(samples)
        results["levels"][level] = {**served[level], "offline": offline}
        for proto in ("http", "grpc"):
            results["levels"][level][f"{proto}_vs_offline"] = {
                "ttft_p50": served[level][proto]["ttft_ms_p50"] / offline["ttft_ms_p50"],
                "tpot_p50": served[level][proto]["tpot_ms_p50"] / offline["tpot_ms_p50"],
            }
        print(level, "offline", offline, flush=True)
    print(json.dumps(results, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
