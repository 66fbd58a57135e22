"""The ingress under hostile load: does one large body stall other clients, and how fast does a
refusal come back when a wave of requests meets a full queue?

    python -m benchmarks.ingress_load [--wave 1000] [--out benchmarks/results/ingress_load.json]

Starts `pagoda serve` (max_waiting_requests 32) on ports 18500/19500, then over loopback:
1. /health every 20 ms while another client posts large prompts, one after another: a 1 MB body
   (refused by its length before tokenizing) and a 600 KB one (under that bound: tokenized, on the
   ingress's tokenizer thread, then refused as longer than the context). Reported: /health latency
   (median, p99, max) beside each, and alone.
2. Long requests fill the engine and its queue; then a wave of `--wave` requests is sent: all at
   once (aiohttp, one connection each), and again through 32 connections at a time. Reported: how
   many got 429, and their latency from send to the answer (median, p99, max).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import requests

from cluster.bench.report import save_rows

HTTP, GRPC = 18500, 19500
BASE = f"http://127.0.0.1:{HTTP}"


def start_server() -> subprocess.Popen:
    config = Path(tempfile.mkdtemp()) / "serve.yaml"
    config.write_text("applications:\n  - name: pagoda\n    args:\n      max_waiting_requests: 32\n"
                      "      engine: {max_num_seqs: 16}\n")
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--config", str(config),
                             "--http-port", str(HTTP), "--grpc-port", str(GRPC)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("pagoda ready"):
            return proc
    raise RuntimeError("pagoda serve did not start")


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"n": len(ordered), "median_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max_ms": 1000 * ordered[-1]}


def health_latency_beside(body: bytes | None, seconds: float = 6.0) -> tuple[dict, list[int]]:
    """/health latencies while another thread posts `body` again and again (None: alone)."""
    stop, statuses = threading.Event(), []

    def post_bodies():
        while not stop.is_set():
            r = requests.post(f"{BASE}/v1/completions", data=body, timeout=120, headers={"content-type": "application/json"})
            statuses.append(r.status_code)

    poster = threading.Thread(target=post_bodies)
    if body is not None:
        poster.start()
        time.sleep(0.5)
    latencies, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        requests.get(f"{BASE}/health", timeout=30).raise_for_status()
        latencies.append(time.perf_counter() - start)
        time.sleep(0.02)
    stop.set()
    if body is not None:
        poster.join()
    return percentiles(latencies), sorted(set(statuses))


async def wave(num_requests: int, concurrency: int) -> dict:
    """Fill the engine and its queue with long requests, then send `num_requests`, `concurrency`
    at a time (0: all at once)."""
    long_body = {"prompt": "Write a long story.", "max_tokens": 150, "ignore_eos": True}

    slots = asyncio.Semaphore(concurrency or num_requests)

    async def post(session, body):
        start = time.perf_counter()
        async with session.post(f"{BASE}/v1/completions", json=body) as r:
            await r.read()
            return r.status, time.perf_counter() - start

    async def call(session, body):
        async with slots:  # timed from when it is sent, not while it waits for a slot here
            return await post(session, body)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        fillers = [asyncio.create_task(post(session, long_body)) for _ in range(48)]  # 16 running + 32 waiting
        await asyncio.sleep(3)
        results = await asyncio.gather(*[call(session, {"prompt": f"Request {i}", "max_tokens": 4})
                                         for i in range(num_requests)])
        for task in fillers:
            task.cancel()
    refused = [seconds for status, seconds in results if status == 429]
    return {"wave": num_requests, "concurrency": concurrency or num_requests, "statuses": {str(s): sum(1 for x, _ in results if x == s) for s in {x for x, _ in results}},
            "refused_429": percentiles(refused) if refused else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wave", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ingress_load.json"))
    args = parser.parse_args()
    server = start_server()
    try:
        rows = []
        for label, body in [("alone", None),
                            ("1 MB body (refused by length)", json.dumps({"prompt": "word " * 209_716}).encode()),
                            ("600 KB body (tokenized, then refused)", json.dumps({"prompt": "word " * 120_000}).encode())]:
            latency, statuses = health_latency_beside(body)
            rows.append({"health_beside": label, **latency, "body_statuses": statuses})
            print(rows[-1], flush=True)
        for concurrency in (0, 32):
            rows.append(asyncio.run(wave(args.wave, concurrency)))
            print(rows[-1], flush=True)
            time.sleep(20)  # the fillers' streams end
    finally:
        server.send_signal(2)
        server.wait(timeout=120)
    save_rows(args.out, rows)


if __name__ == "__main__":
    main()
