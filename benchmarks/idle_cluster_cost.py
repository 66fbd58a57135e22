"""What an idle Pagoda server costs an engine on the same cores: one stream decoded in this
process (no Ray in it) beside a local `pagoda serve` that nobody calls, with the server's
processes frozen (SIGSTOP) and running in turn, request by request; and how often the idle
server's threads wake up.

    python -m benchmarks.idle_cluster_cost [--pairs 10] [--engine-in-ingress]

The served engine shares its node with Ray and Serve (GCS, raylet, Serve's controller, proxies,
agents, Pagoda's drain and tenant actors); on two cores each of their wakeups takes a core from
one of the step's two OpenMP threads and holds the other at the region's end. Taking the turns
request by request keeps the VM's drift (minutes) out of the ratio. The server runs in a child
process, so none of Ray's threads live in this one; on the way out its processes are continued
and it is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import psutil

from benchmarks import pagoda_server
from cluster import LLM, SamplingParams
from cluster.model_fetch import fetch_default_model

HTTP, GRPC = 18300, 19300
PROMPT = "Tell me a long story about a cat."


def process_name(argv: list[str]) -> str:
    """ray::ServeController, raylet, gcs_server, dashboard/agent.py, cluster.cli serve..."""
    words = [Path(word).name if "/" in word else word for word in argv if word]
    if not words:
        return "?"
    if words[0].startswith("python"):  # a script or module run by Python: name it instead
        words = [w for w in words[1:] if not w.startswith("-")][:2] or words
        return " ".join(words)
    return words[0]


def wakeups(pids: list[int]) -> dict[str, int]:
    """Voluntary context switches (a thread going to sleep, so one wakeup each) per process name."""
    counts: dict[str, int] = {}
    for pid in pids:
        try:
            name = process_name(Path(f"/proc/{pid}/cmdline").read_text().split("\0"))
            for tid in os.listdir(f"/proc/{pid}/task"):
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                counts[name] = counts.get(name, 0) + int(status.split("voluntary_ctxt_switches:\t")[1].split()[0])
        except (OSError, IndexError):
            continue
    return counts


def wakeups_per_second(pids: list[int], seconds: float) -> dict[str, float]:
    before = wakeups(pids)
    time.sleep(seconds)
    after = wakeups(pids)
    return {name: (count - before.get(name, 0)) / seconds for name, count in after.items()}


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def ms_per_token(llm: LLM, params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate([PROMPT], params)
    return (time.perf_counter() - start) / params.max_tokens * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--engine-in-ingress", action="store_true", help="the server's shape")
    parser.add_argument("--settle-s", type=float, default=15.0, help="idle time after the server is ready")
    parser.add_argument("--out", default="benchmarks/results/idle_cluster_cost.json")
    args = parser.parse_args()

    llm = LLM(str(fetch_default_model()))
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    ms_per_token(llm, params)  # warm-up
    server = pagoda_server.start("--http-port", str(HTTP), "--grpc-port", str(GRPC),
                                 *(["--engine-in-ingress"] if args.engine_in_ingress else []))
    pids: list[int] = []
    try:
        time.sleep(args.settle_s)
        pids = [server.pid, *(child.pid for child in psutil.Process(server.pid).children(recursive=True))]
        per_process = wakeups_per_second(pids, 10.0)
        times: dict[str, list[float]] = {"frozen": [], "running": []}
        for i in range(args.pairs):  # which goes first alternates: neither gets the VM's trend
            for state in ("frozen", "running") if i % 2 == 0 else ("running", "frozen"):
                signal_all(pids, signal.SIGSTOP if state == "frozen" else signal.SIGCONT)
                time.sleep(0.3)
                times[state].append(ms_per_token(llm, params))
    finally:
        signal_all(pids, signal.SIGCONT)
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
    ratios = [running / frozen for frozen, running in zip(times["frozen"], times["running"])]
    total = sum(per_process.values())
    print(f"idle server: {len(pids)} processes, {total:,.0f} wakeups/s; the most:")
    for name, rate in sorted(per_process.items(), key=lambda item: -item[1])[:10]:
        print(f"  {rate:7.1f}/s  {name}")
    for state, values in times.items():
        print(f"{state:>8}: " + " ".join(f"{v:.2f}" for v in values) + f"  ms/token, median {statistics.median(values):.2f}")
    print("running / frozen: " + " ".join(f"{r:.2f}" for r in ratios) + f"  median {statistics.median(ratios):.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"processes": len(pids), "wakeups_per_s": per_process, "ms_per_token": times,
                               "ratios": ratios, "median_ratio": statistics.median(ratios),
                               "engine_in_ingress": args.engine_in_ingress,
                               "env": {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE")}}, indent=1))


if __name__ == "__main__":
    main()
