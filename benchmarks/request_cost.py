"""What a request costs the serving path: one-token completions of a short prompt, one at a time,
against a local `pagoda serve` (this checkout's code), and the same through the engine in this
process without Ray or Serve. The difference is the path's fixed cost per request (HTTP, the
ingress, admission, the hops to the engine and back), which every TTFT pays.

    python -m benchmarks.request_cost [--requests 300] [--engine-in-ingress]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import requests

from cluster import LLM, SamplingParams
from cluster.bench.metrics import percentile
from cluster.model_fetch import fetch_default_model
from cluster.ports import free_port
from cluster.serve import launcher

PROMPT = "Hello there"
WARMUP = 20  # calls before the timed ones


def timed_calls(call: Callable[[], object], count: int) -> list[float]:
    """ms of each of `count` calls, after WARMUP untimed ones."""
    for _ in range(WARMUP):
        call()
    times = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def percentiles(ms: list[float]) -> str:
    return f"p50 {percentile(ms, 50):.2f} ms, p10 {percentile(ms, 10):.2f}, p90 {percentile(ms, 90):.2f}"


def served(model_dir: str, count: int, engine_in_ingress: bool) -> list[float]:
    http_port = free_port()
    launcher.start({"model": model_dir, "engine_in_ingress": engine_in_ingress}, http_port, free_port())
    try:
        session = requests.Session()
        url, body = f"http://127.0.0.1:{http_port}/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        return timed_calls(lambda: session.post(url, json=body, timeout=60).raise_for_status(), count)
    finally:
        launcher.stop()


def in_process(model_dir: str, count: int) -> list[float]:
    llm = LLM(model_dir)
    params = SamplingParams(max_tokens=1, temperature=0)
    return timed_calls(lambda: llm.generate([PROMPT], params), count)


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
    print(f"the path's cost per request, p50: {percentile(served_ms, 50) - percentile(engine_ms, 50):.2f} ms")


if __name__ == "__main__":
    main()
