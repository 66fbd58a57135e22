"""What a request costs the serving path: one-token completions of a short prompt, one at a time,
against a local `pagoda serve` (this checkout's code), and the same through the engine in this
process without Ray or Serve. The difference is the path's fixed cost per request (HTTP, the
ingress, admission, the hops to the engine and back), which every TTFT pays.

    python -m benchmarks.request_cost [--requests 300] [--engine-in-ingress]
"""

from __future__ import annotations

import argparse
import statistics
import time

import requests

from cluster import LLM, SamplingParams
from cluster.model_fetch import fetch_default_model
from cluster.ports import free_port
from cluster.serve import launcher

PROMPT = "Hello there"


def percentiles(ms: list[float]) -> str:
    ms = sorted(ms)
    return f"p50 {statistics.median(ms):.2f} ms, p10 {ms[len(ms) // 10]:.2f}, p90 {ms[9 * len(ms) // 10]:.2f}"


def served(model_dir: str, count: int, engine_in_ingress: bool) -> list[float]:
    http_port = free_port()
    launcher.start({"model": model_dir, "engine_in_ingress": engine_in_ingress}, http_port, free_port())
    try:
        session = requests.Session()
        url, body = f"http://127.0.0.1:{http_port}/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        times = []
        for i in range(count + 20):  # the first 20 warm up
            start = time.perf_counter()
            session.post(url, json=body, timeout=60).raise_for_status()
            if i >= 20:
                times.append((time.perf_counter() - start) * 1e3)
        return times
    finally:
        launcher.stop()


def in_process(model_dir: str, count: int) -> list[float]:
    llm = LLM(model_dir)
    params = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for i in range(count + 20):
        start = time.perf_counter()
        llm.generate([PROMPT], params)
        if i >= 20:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--engine-in-ingress", action="store_true", help="the server's shape")
    args = parser.parse_args()
    model_dir = str(fetch_default_model())
    shape = "engine in ingress" if args.engine_in_ingress else "two deployments"
    served_ms = served(model_dir, args.requests, args.engine_in_ingress)
    engine_ms = in_process(model_dir, args.requests)
    print(f"served over HTTP ({shape}): {percentiles(served_ms)}")
    print(f"engine in process:  {percentiles(engine_ms)}")
    print(f"the path's cost per request, p50: {statistics.median(served_ms) - statistics.median(engine_ms):.2f} ms")


if __name__ == "__main__":
    main()
