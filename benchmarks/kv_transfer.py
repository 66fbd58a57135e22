"""KV transfer between a prefill and a decode engine: bytes and time per request, by prompt length.

    python -m benchmarks.kv_transfer [--lengths 128,512,2048] [--out benchmarks/results/kv_transfer.json]

The prefill engine runs in this process and puts each layer's KV into Ray's object store as the
layer finishes (model/kv_transfer.py); the decode engine is a Ray actor (another process) that
reads them. Per prompt length:
  export cost  = prefill time with export - prefill time without (what the overlap leaves)
  install cost = the decode engine's first step (read + write the KV, then decode one token)
                 - its next step (decode only)
  bytes        = the request's KV (every layer, K and V, every KV head, fp32)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import ray

from cluster.bench.report import markdown_rows, save_rows
from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.executor.factory import build_engine
from cluster.engine.sampling_params import SamplingParams
from cluster.model_fetch import fetch_default_model


@ray.remote
class DecodeSide:
    def __init__(self, model_dir: str, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.engine = build_engine(EngineConfig(model=model_dir, num_blocks=1024, kv_role="decode",
                                             enable_prefix_caching=False))

    def first_steps(self, request_id: str, prompt: list[int], prefilled) -> tuple[float, float]:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        self.engine.add_request(request_id, prompt, params, prefilled=prefilled)
        t0 = time.perf_counter()
        self.engine.step()  # installs the KV, then decodes the first token
        t1 = time.perf_counter()
        self.engine.step()  # decodes only
        t2 = time.perf_counter()
        self.engine.abort_request(request_id)
        return t1 - t0, t2 - t1


def prefill(engine: LLMEngine, request_id: str, prompt: list[int], export: bool):
    params = SamplingParams(max_tokens=1, temperature=0)
    engine.add_request(request_id, prompt, params, export_kv=export)
    t = time.perf_counter()
    last = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            last = delta
    return time.perf_counter() - t, last


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_transfer.json"))
    args = parser.parse_args()
    model_dir = str(fetch_default_model())
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    import torch

    torch.set_num_threads(1)  # one core each side, as a disaggregated pair on this 2-core machine
    engine = build_engine(EngineConfig(model=model_dir, num_blocks=1024, kv_role="prefill", enable_prefix_caching=False,
                                    max_num_batched_tokens=512))
    decode = DecodeSide.remote(model_dir, 1)
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        plain, exported, installs, decodes, nbytes = [], [], [], [], 0
        for r in range(args.repeats):
            prompt = [(1000 + 7 * i + 13 * r) % 40000 for i in range(length)]
            plain.append(prefill(engine, f"plain-{length}-{r}", prompt, export=False)[0])
            seconds, last = prefill(engine, f"exp-{length}-{r}", prompt, export=True)
            exported.append(seconds)
            result = last.prefilled
            nbytes = result.kv_bytes
            install, decode_only = ray.get(decode.first_steps.remote(f"d-{length}-{r}", prompt, dataclasses.replace(result)))
            installs.append(install)
            decodes.append(decode_only)
        row = {"prompt_tokens": length, "kv_bytes": nbytes, "parts": len(result.kv_parts),
               "prefill_ms": statistics.median(plain) * 1e3, "prefill_export_ms": statistics.median(exported) * 1e3,
               "first_decode_step_ms": statistics.median(installs) * 1e3, "decode_step_ms": statistics.median(decodes) * 1e3}
        row["export_cost_ms"] = row["prefill_export_ms"] - row["prefill_ms"]
        row["install_cost_ms"] = row["first_decode_step_ms"] - row["decode_step_ms"]
        rows.append(row)
        print(json.dumps(row))
    ray.shutdown()
    save_rows(args.out, rows)
    print(markdown_rows(
        ["prompt tokens", "KV bytes", "prefill (ms)", "with export (ms)", "export cost (ms)", "install cost (ms)"],
        [[str(r["prompt_tokens"]), f"{r['kv_bytes'] / 2**20:.1f} MiB", f"{r['prefill_ms']:.0f}",
          f"{r['prefill_export_ms']:.0f}", f"{r['export_cost_ms']:.1f}", f"{r['install_cost_ms']:.1f}"] for r in rows]))


if __name__ == "__main__":
    main()
