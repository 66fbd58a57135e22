"""How fast pages are made and read back, on real KV of the default model: encode and decode
speed and size ratio per codec (RAW, LZ4, byte-shuffled LZ4), the two ways of undoing the shuffle,
and a whole restore (KVOffload.load_blocks from a disk tier: read, checksum, decode), one thread
against the decode pool.

    python -m benchmarks.kv_page_codec [--blocks 64] [--out benchmarks/results/kv_page_codec.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from cache_service import page_codec
from cache_service.offload import KVOffload
from cache_service.tiers import DiskTier
from cluster.bench.report import markdown_rows, save_rows
from cluster.engine.config import EngineConfig
from cluster.executor.factory import build_engine
from cluster.engine.sampling_params import SamplingParams
from cluster.model_fetch import fetch_default_model
from tests.parity_prompts import long_document

IDENTITY = {"model": "benchmark"}


def best_of(repeats: int, fn) -> float:
    """The fastest of `repeats` runs, in seconds (the least disturbed by the rest of the machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def transposed_unshuffle(shuffled: np.ndarray, elem: int) -> bytes:
    """The first way (a transposed copy), for comparison with page_codec's byte planes."""
    return shuffled.reshape(elem, -1).T.copy().tobytes()


def real_kv_blocks(num_blocks: int) -> list[np.ndarray]:
    engine = build_engine(EngineConfig(model=str(fetch_default_model()), num_blocks=num_blocks + 8))
    prompt = engine.tokenizer(long_document(20_000)).input_ids[: num_blocks * engine.config.block_size]
    engine.add_request("fill", prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.executor.read_blocks(engine.kv_cache.block_ids("fill")[:num_blocks] or list(range(num_blocks)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_page_codec.json"))
    args = parser.parse_args()
    blocks = real_kv_blocks(args.blocks)
    keys = [i.to_bytes(16, "little") for i in range(len(blocks))]
    raw_bytes = sum(b.nbytes for b in blocks)
    rows = []
    for name, codec in (("raw", page_codec.RAW), ("lz4", page_codec.LZ4), ("shuffle+lz4", page_codec.SHUFFLE_LZ4)):
        pages = [page_codec.encode(k, IDENTITY, b, codec) for k, b in zip(keys, blocks)]
        encode_s = best_of(args.repeats, lambda: [page_codec.encode(k, IDENTITY, b, codec) for k, b in zip(keys, blocks)])
        decode_s = best_of(args.repeats, lambda: [page_codec.decode(p, IDENTITY, k) for k, p in zip(keys, pages)])
        rows.append({"what": f"codec {name}", "ratio": raw_bytes / sum(map(len, pages)),
                     "encode_MBps": raw_bytes / encode_s / 1e6, "decode_MBps": raw_bytes / decode_s / 1e6})
    shuffled = [page_codec._shuffle(np.ascontiguousarray(b).view(np.uint8).reshape(-1), 4) for b in blocks]
    for name, unshuffle in (("unshuffle: transposed copy", transposed_unshuffle),
                            ("unshuffle: byte planes", page_codec._unshuffle)):
        seconds = best_of(args.repeats, lambda: [unshuffle(s, 4) for s in shuffled])
        rows.append({"what": name, "decode_MBps": raw_bytes / seconds / 1e6})
    with tempfile.TemporaryDirectory(prefix="pagoda-codec-") as directory:
        DiskTier(directory, 1 << 34, IDENTITY).put_many(
            [(k, page_codec.encode(k, IDENTITY, b)) for k, b in zip(keys, blocks)])
        for threads in (1, os.cpu_count()):
            offload = KVOffload([DiskTier(directory, 1 << 34, IDENTITY)], IDENTITY, decode_threads=threads)
            seconds = best_of(args.repeats, lambda: offload.load_blocks(keys))
            rows.append({"what": f"restore from disk, {threads} decode thread(s)", "decode_MBps": raw_bytes / seconds / 1e6})
    for row in rows:
        print(json.dumps(row))
    save_rows(args.out, rows, blocks=len(blocks), raw_bytes=raw_bytes)
    print(markdown_rows(["", "size ratio", "encode MB/s", "decode / restore MB/s"],
                        [[r["what"], f"{r['ratio']:.3f}" if "ratio" in r else "", f"{r['encode_MBps']:.0f}" if "encode_MBps" in r else "",
                          f"{r['decode_MBps']:.0f}"] for r in rows]))


if __name__ == "__main__":
    main()
