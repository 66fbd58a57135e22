"""Predictive prefetch under load: documents whose KV sits on the disk tier arrive while decode
streams keep the engine busy; with prefetch their pages are read and checked while they wait in
the queue. One process, one session; prefetch on vs off.

    python -m benchmarks.kv_prefetch [--docs 8] [--doc-tokens 1024] [--streams 16]

Load: `--streams` requests (128 random prompt tokens, 64 output) all at once with max_num_seqs 8,
so requests queue; one document request (first token only) arrives every 8 engine steps. Reported:
the on-time rate (pages loaded before the request was scheduled), the documents' TTFT (arrival to
first token, wall clock), and the engine's total time.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from cluster.bench.report import markdown_rows, save_rows
from cluster.engine.config import EngineConfig
from cluster.executor.factory import build_engine
from cluster.engine.sampling_params import SamplingParams
from cluster.model_fetch import fetch_default_model
from tests.parity_prompts import long_document


def run(model_dir: str, prefetch: bool, docs: list[list[int]], streams: int) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="pagoda-prefetch-"))
    engine = build_engine(EngineConfig(model=model_dir, num_blocks=1200, max_num_seqs=8, max_num_batched_tokens=256,
                                    disk_kv_bytes=4 << 30, kv_cache_dir=str(directory), kv_prefetch=prefetch))
    first = SamplingParams(max_tokens=1, temperature=0)
    for i, doc in enumerate(docs):  # put every document's KV on disk
        engine.add_request(f"warm{i}", doc, first)
        while engine.has_unfinished_requests():
            engine.step()
    engine.spill_prefix_cache()
    rng = random.Random(0)
    steady = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"s{i}", [rng.randrange(1000, 40000) for _ in range(128)], steady)
    arrivals, ttft, step, start = {}, {}, 0, time.perf_counter()
    pending = list(enumerate(docs))
    while pending or engine.has_unfinished_requests():
        if pending and step % 8 == 0:
            i, doc = pending.pop(0)
            engine.add_request(f"d{i}", doc, first)
            arrivals[f"d{i}"] = time.perf_counter()
        for delta in engine.step():
            if delta.request_id.startswith("d") and delta.request_id not in ttft:
                ttft[delta.request_id] = time.perf_counter() - arrivals[delta.request_id]
        step += 1
    stats = engine.kv_connector.offload.describe()
    shutil.rmtree(directory, ignore_errors=True)
    return {"prefetch": prefetch, "total_s": time.perf_counter() - start, "doc_ttft_mean_s": statistics.mean(ttft.values()),
            "doc_ttft_p90_s": sorted(ttft.values())[int(0.9 * (len(ttft) - 1))], "restored_blocks": stats["restored_blocks"],
            "prefetch_on_time": stats["prefetch_on_time"], "prefetch_late": stats["prefetch_late"],
            "prefetch_stale": stats["prefetch_stale"], "on_time_rate": stats["prefetch_on_time_rate"],
            "restore_wait_s": stats["restore_wait_s"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_prefetch.json"))
    args = parser.parse_args()
    model_dir = str(fetch_default_model())
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(long_document(300_000)).input_ids
    docs = [ids[i * args.doc_tokens:(i + 1) * args.doc_tokens] for i in range(args.docs)]
    rows = [run(model_dir, prefetch, docs, args.streams) for prefetch in (True, False)]
    save_rows(args.out, rows, options=vars(args) | {"out": str(args.out)})
    print(markdown_rows(["prefetch", "on time / late / stale", "scheduler waiting for pages (s)", "doc TTFT mean (s)",
                         "doc TTFT p90 (s)", "total (s)"],
                        [["on" if r["prefetch"] else "off", f"{r['prefetch_on_time']} / {r['prefetch_late']} / {r['prefetch_stale']}",
                          f"{r['restore_wait_s']:.3f}", f"{r['doc_ttft_mean_s']:.3f}", f"{r['doc_ttft_p90_s']:.3f}",
                          f"{r['total_s']:.1f}"] for r in rows]))


if __name__ == "__main__":
    main()
