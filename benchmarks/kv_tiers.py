"""TTFT of a long document: recompute vs a hit in host RAM vs on disk vs on disk after a restart;
bytes per token on disk vs raw; the byte shuffle's effect on real KV. One session, one process.

    python -m benchmarks.kv_tiers [--lengths 1024,4096,8000] [--codec shuffle-lz4|lz4|raw]
                                  [--out benchmarks/results/kv_tiers.json]

For each length: a docqa-style prompt. "recompute" is an engine without lower tiers (prefix
caching off); for the hits the document's blocks are first moved out of device memory
(`LLMEngine.spill_prefix_cache`, what memory pressure does block by block); "after restart" is a
new engine on the same directory with an empty host tier. TTFT = time from add_request to the
first token, in process (no serving path), median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from cache_service import page_codec
from cluster.bench.report import markdown_rows, save_rows
from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.executor.factory import build_engine
from cluster.engine.sampling_params import SamplingParams
from cluster.model_fetch import fetch_default_model
from tests.parity_prompts import long_document

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def ttft(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, FIRST_TOKEN)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def engine(model_dir: str, directory: Path, host: bool, disk: bool, codec: str) -> LLMEngine:
    return build_engine(EngineConfig(model=model_dir, num_blocks=600, max_num_batched_tokens=512,
                                  host_kv_bytes=(2 << 30) if host else 0, disk_kv_bytes=(8 << 30) if disk else 0,
                                  kv_cache_dir=str(directory), kv_page_codec=codec))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,4096,8000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--codec", default="shuffle-lz4", help="kv_page_codec of the tiers")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_tiers.json"))
    args = parser.parse_args()
    model_dir = str(fetch_default_model())
    cold = build_engine(EngineConfig(model=model_dir, num_blocks=600, max_num_batched_tokens=512, enable_prefix_caching=False))
    tokenizer = cold.tokenizer
    text = long_document(60_000)
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        prompt = tokenizer(text).input_ids[:length]
        row = {"tokens": length, "recompute_s": statistics.median(ttft(cold, f"c{length}-{i}", prompt) for i in range(args.repeats))}
        for label, host, disk in (("host_hit_s", True, False), ("disk_hit_s", False, True)):
            directory = Path(tempfile.mkdtemp(prefix="pagoda-kv-"))
            e = engine(model_dir, directory, host, disk, args.codec)
            ttft(e, "fill", prompt)
            times = []
            for i in range(args.repeats):
                e.spill_prefix_cache()
                times.append(ttft(e, f"{label}-{i}", prompt))
            row[label] = statistics.median(times)
            if disk:
                pages = list(directory.glob("*.page"))
                row["disk_bytes_per_token"] = sum(p.stat().st_size for p in pages) / (len(pages) * e.config.block_size)
                row["raw_bytes_per_token"] = e.executor.bytes_per_block / e.config.block_size
                payload = e.executor.read_blocks([0])[0]  # a block of real KV: shuffle vs plain LZ4
                row["lz4_ratio"] = payload.nbytes / len(page_codec.encode(bytes(16), {}, payload, page_codec.LZ4))
                row["shuffle_lz4_ratio"] = payload.nbytes / len(page_codec.encode(bytes(16), {}, payload, page_codec.SHUFFLE_LZ4))
                del e
                restarted = engine(model_dir, directory, host=False, disk=True, codec=args.codec)
                row["disk_after_restart_s"] = ttft(restarted, "restart", prompt)
                row["restored_after_restart"] = restarted.kv_connector.offload.describe()["restored_from"]["disk"]
                del restarted
            shutil.rmtree(directory, ignore_errors=True)
        rows.append(row)
        print(json.dumps(row))
    save_rows(args.out, rows, codec=args.codec)
    print(markdown_rows(
        ["tokens", "recompute (s)", "host hit (s)", "disk hit (s)", "disk hit after restart (s)", "speed-up after restart",
         "disk bytes/token (raw)", "LZ4 ratio (shuffled)"],
        [[str(r["tokens"]), f"{r['recompute_s']:.2f}", f"{r['host_hit_s']:.3f}", f"{r['disk_hit_s']:.3f}",
          f"{r['disk_after_restart_s']:.3f}", f"{r['recompute_s'] / r['disk_after_restart_s']:.1f}×",
          f"{r['disk_bytes_per_token']:.0f} ({r['raw_bytes_per_token']:.0f})",
          f"{r['lz4_ratio']:.3f} ({r['shuffle_lz4_ratio']:.3f})"] for r in rows]))


if __name__ == "__main__":
    main()
