"""What write-through costs: the engine's throughput with every computed block written down to a
disk tier at once (kv_write_through) against no lower tier, same prompts, one session.

    python -m benchmarks.kv_write_through [--num-prompts 32] [--prompt-tokens 512] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

from cluster.bench.report import markdown_rows, save_rows
from cluster.engine.config import EngineConfig
from cluster.executor.factory import build_engine
from cluster.engine.sampling_params import SamplingParams
from cluster.model_fetch import fetch_default_model


def run(model_dir: str, prompts: list[list[int]], max_tokens: int, write_through: bool) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="pagoda-wt-"))
    tiers = dict(disk_kv_bytes=8 << 30, kv_cache_dir=str(directory), kv_write_through=True) if write_through else {}
    engine = build_engine(EngineConfig(model=model_dir, num_blocks=2048, max_num_seqs=len(prompts), **tiers))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    compute_s = time.perf_counter() - start
    written = 0
    if write_through:
        engine.kv_connector.offload.flush()  # the background writes, after the last step
        written = engine.kv_connector.offload.stats.spilled_blocks
    total_s = time.perf_counter() - start
    shutil.rmtree(directory, ignore_errors=True)
    tokens = len(prompts) * max_tokens
    return {"write_through": write_through, "output_tok_s": tokens / compute_s, "compute_s": compute_s,
            "until_written_s": total_s, "blocks_written": written}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_write_through.json"))
    args = parser.parse_args()
    model_dir = str(fetch_default_model())
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.num_prompts)]
    run(model_dir, prompts[:2], 4, write_through=False)  # warm-up
    rows = [run(model_dir, prompts, args.max_tokens, wt) for wt in (False, True)]
    save_rows(args.out, rows, options=vars(args) | {"out": str(args.out)})
    print(markdown_rows(["write-through", "output tok/s", "engine time (s)", "until every block is written (s)", "blocks written"],
                        [["on" if r["write_through"] else "off", f"{r['output_tok_s']:.1f}", f"{r['compute_s']:.1f}",
                          f"{r['until_written_s']:.1f}", str(r["blocks_written"])] for r in rows]))


if __name__ == "__main__":
    main()
