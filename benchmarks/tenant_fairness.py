"""A light tenant's TTFT while another tenant floods the engine: weighted fair scheduling against
first come, first served, on one LLMEngine of the real default model, in one session.

    python -m benchmarks.tenant_fairness [--duration 60] [--out benchmarks/results/tenant_fairness.json]

Tenant B sends requests at --rate-b per second, tenant A at ten times that (both Poisson, fixed
seeds), each a prompt of --prompt-len random tokens and exactly --output-len output tokens
(greedy, ignore_eos). A's rate is over what the engine serves, so its queue grows for the whole
run. Three runs of the same arrival times:

  B alone       B's requests only: its TTFT on an engine it has to itself
  A+B, fcfs     tenant_scheduling: fcfs  (the order of arrival)
  A+B, fair     tenant_scheduling: fair  (shares by weight; both weight 1)

The engine is driven in this thread like LLMServer's engine thread: requests that arrived are
added between steps. B's requests still waiting when the run ends count with the time they waited
(a starved request is not left out). Reported: B's TTFT p50 / p95 / max and their ratio to B alone,
and the requests of each tenant that got a first token.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque

from cluster.bench.metrics import percentile
from cluster.bench.report import markdown_rows, save_rows
from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.executor.factory import build_engine
from cluster.engine.sampling_params import SamplingParams
from cluster.model_fetch import fetch_default_model


def arrivals(rate: float, duration: float, seed: int) -> list[float]:
    rng, times, t = random.Random(seed), [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return times
        times.append(t)


def run(engine: LLMEngine, schedule: list[tuple[float, str, list[int]]], output_len: int, duration: float) -> dict:
    """Feed `schedule` ((arrival s, tenant, prompt)) in real time; TTFT per request id."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    pending = deque(sorted(schedule))
    arrived: dict[str, float] = {}
    ttft: dict[str, float] = {}
    start = time.perf_counter()
    while True:
        now = time.perf_counter() - start
        if now > duration:
            break
        while pending and pending[0][0] <= now:
            at, tenant, prompt = pending.popleft()
            request_id = f"{tenant}-{len(arrived)}"
            arrived[request_id] = at
            engine.add_request(request_id, prompt, params, tenant=tenant)
        if not engine.has_unfinished_requests():
            if not pending:
                break
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for delta in engine.step():
            if delta.new_token_ids and delta.request_id not in ttft:
                ttft[delta.request_id] = time.perf_counter() - start - arrived[delta.request_id]
    end = time.perf_counter() - start
    for request_id in arrived:
        if request_id not in ttft:
            engine.abort_request(request_id)
    engine.step() if engine.has_unfinished_requests() else None
    return {"ttft": ttft, "arrived": arrived, "end": end}


def b_ttfts(result: dict, warmup: float) -> list[float]:
    """B's TTFTs of requests that arrived after the warm-up; a starved one counts with its wait."""
    return [result["ttft"].get(rid, result["end"] - at) for rid, at in result["arrived"].items()
            if rid.startswith("b-") and at >= warmup]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=5.0, help="B's requests before this are not counted")
    parser.add_argument("--rate-b", type=float, default=0.5)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/tenant_fairness.json")
    args = parser.parse_args()

    model = str(fetch_default_model())
    rng = random.Random(7)
    schedule = {tenant: [(at, tenant, [rng.randrange(100, 30000) for _ in range(args.prompt_len)])
                         for at in arrivals(rate, args.duration, seed)]
                for tenant, rate, seed in (("b", args.rate_b, 1), ("a", 10 * args.rate_b, 2))}

    def engine(policy: str) -> LLMEngine:
        return build_engine(EngineConfig(
            model=model, max_num_seqs=args.max_num_seqs, tenant_scheduling=policy,
            max_num_batched_tokens=args.max_num_batched_tokens))

    warm = engine("fair")
    warm_prompt = [rng.randrange(100, 30000) for _ in range(args.prompt_len)]  # shares no prefix with the runs'
    run(warm, [(0.0, "w", warm_prompt)], args.output_len, 30)  # first-step costs out of the figures
    rows = []
    for label, policy, load in (("B alone", "fair", schedule["b"]), ("A+B, fcfs", "fcfs", schedule["a"] + schedule["b"]),
                                ("A+B, fair", "fair", schedule["a"] + schedule["b"])):
        eng = warm if label == "B alone" else engine(policy)
        result = run(eng, load, args.output_len, args.duration)
        ttfts = b_ttfts(result, args.warmup)
        served = {t: sum(1 for rid in result["ttft"] if rid.startswith(f"{t}-")) for t in ("a", "b")}
        sent = {t: sum(1 for rid in result["arrived"] if rid.startswith(f"{t}-")) for t in ("a", "b")}
        rows.append({"run": label, "b_p50_s": percentile(ttfts, 50), "b_p95_s": percentile(ttfts, 95),
                     "b_max_s": max(ttfts), "b_counted": len(ttfts), "served": served, "sent": sent})
        print(rows[-1], flush=True)
    alone = rows[0]["b_p95_s"]
    save_rows(args.out, rows, options=vars(args))
    print(markdown_rows(
        ["run", "B TTFT p50 (s)", "B TTFT p95 (s)", "B max (s)", "p95 / B alone", "first tokens A / B (sent)"],
        [[r["run"], f"{r['b_p50_s']:.3f}", f"{r['b_p95_s']:.3f}", f"{r['b_max_s']:.3f}", f"{r['b_p95_s'] / alone:.2f}x",
          f"{r['served']['a']}/{r['sent']['a']}, {r['served']['b']}/{r['sent']['b']}"] for r in rows]))


if __name__ == "__main__":
    main()
