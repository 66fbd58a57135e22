"""The ingress under hostile load: does one large body stall other clients, and how fast does a
refusal come back when a wave of requests meets a full queue?

    python -m benchmarks.ingress_load [--wave 1000] [--out benchmarks/results/ingress_load.json]

Starts `pagoda serve` (max_waiting_requests 32) on ports 18500/19500, without and then with
`--front-door` (HAProxy in front of the HTTP port), and each time, over loopback:
1. /health every 20 ms while another client posts large prompts, one after another: a 1 MB body
   (refused by its length before tokenizing) and a 600 KB one (under that bound: tokenized, on the
   ingress's tokenizer thread, then refused as longer than the context). Reported: /health latency
   (median, p99, max) beside each, and alone.
2. Long requests fill the engine and its queue; then a wave of `--wave` requests is sent: all at
   once (one connection each, opened before the wave; plain sockets: every request is written,
   then every answer read, so the client's own per-request cost is not in the figure), and again
   through 32 aiohttp connections at a time. Reported: how many got 429, and their latency from
   send to the answer (median, p99, max).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import selectors
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import requests

from benchmarks import pagoda_server
from cluster.bench.report import save_rows

HTTP, GRPC = 18500, 19500
BASE = f"http://127.0.0.1:{HTTP}"


def start_server(front_door: bool) -> subprocess.Popen:
    config = Path(tempfile.mkdtemp()) / "serve.yaml"
    config.write_text("applications:\n  - name: pagoda\n    args:\n      max_waiting_requests: 32\n"
                      "      engine: {max_num_seqs: 16}\n")
    return pagoda_server.start("--config", str(config), "--http-port", str(HTTP), "--grpc-port", str(GRPC),
                               *(["--front-door"] if front_door else []))


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
        # 16 running, then 32 waiting: sent at once, the last 16 would find the first ones still
        # counted as waiting and be refused, leaving the queue half empty.
        fillers = [asyncio.create_task(post(session, long_body)) for _ in range(16)]
        await asyncio.sleep(2)
        fillers += [asyncio.create_task(post(session, long_body)) for _ in range(32)]
        await asyncio.sleep(3)
        refused_fillers = sum(1 for task in fillers if task.done() and task.result()[0] == 429)
        if concurrency:
            results = await asyncio.gather(*[call(session, {"prompt": f"Request {i}", "max_tokens": 4})
                                             for i in range(num_requests)])
        else:
            results = await asyncio.to_thread(all_at_once, num_requests)
        for task in fillers:
            task.cancel()
    refused = [seconds for status, seconds in results if status == 429]
    return {"wave": num_requests, "concurrency": concurrency or num_requests, "refused_fillers": refused_fillers, "statuses": {str(s): sum(1 for x, _ in results if x == s) for s in {x for x, _ in results}},
            "refused_429": percentiles(refused) if refused else None}


def all_at_once(num_requests: int) -> list[tuple[int, float]]:
    """(status, seconds) of `num_requests` requests on connections opened beforehand: write them
    all, then read every answer as it comes."""
    sockets = [socket.create_connection(("127.0.0.1", HTTP)) for _ in range(num_requests)]
    selector, sent, answers, results = selectors.DefaultSelector(), {}, {}, {}
    for i, s in enumerate(sockets):
        body = json.dumps({"prompt": f"Request {i}", "max_tokens": 4}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        sent[s], answers[s] = time.perf_counter(), b""
        s.setblocking(False)
        selector.register(s, selectors.EVENT_READ)
    while len(results) < num_requests:
        for key, _ in selector.select(timeout=120):
            s = key.fileobj
            chunk = s.recv(65536)
            answers[s] += chunk
            if not chunk:  # Connection: close, so the answer is whole
                results[s] = (int(answers[s][9:12]), time.perf_counter() - sent[s])
                selector.unregister(s)
                s.close()
    return list(results.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wave", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ingress_load.json"))
    args = parser.parse_args()
    rows = []
    for front_door in (False, True):
        server = start_server(front_door)
        try:
            for label, body in [("alone", None),
                                ("1 MB body (refused by length)", json.dumps({"prompt": "word " * 209_716}).encode()),
                                ("600 KB body (tokenized, then refused)", json.dumps({"prompt": "word " * 120_000}).encode())]:
                latency, statuses = health_latency_beside(body)
                rows.append({"front_door": front_door, "health_beside": label, **latency, "body_statuses": statuses})
                print(rows[-1], flush=True)
            for concurrency in (0, 32):
                rows.append({"front_door": front_door, **asyncio.run(wave(args.wave, concurrency))})
                print(rows[-1], flush=True)
                time.sleep(20)  # the fillers' streams end
        finally:
            server.send_signal(2)
            server.wait(timeout=120)
    save_rows(args.out, rows)


if __name__ == "__main__":
    main()
