"""A 4K-token document's TTFT after `pagoda serve` is killed with SIGKILL and started again, against
recomputing a document of the same length in the same run.

    python -m benchmarks.kv_restart [--tokens 4096] [--chat] [--out benchmarks/results/kv_restart.json]

--chat sends each document as a user message to /v1/chat/completions, as a chat user would: the
model's template puts the same system prompt in front of every one, so the documents share their
first block (which stays in device memory and must reach the disk all the same).

1. `pagoda serve` with a small device KV budget (room for one document) and a disk tier;
2. document A (TTFT = recompute), then documents B and C, which evict all of A's blocks to disk
   (blocks leave device memory tail first, so one document of the same size leaves A's head);
3. SIGKILL to the server's whole process group (Ray included), start it again on the same directory;
4. document A again (restored from disk) and a new document D (recompute), over OpenAI HTTP.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import requests

from benchmarks import pagoda_server
from cluster.bench.report import markdown_rows, save_rows
from tests.parity_prompts import long_document

HTTP, GRPC = 8310, 9310


def start_server(kv_dir: str, device_gb: float) -> subprocess.Popen:
    return pagoda_server.start("--http-port", str(HTTP), "--grpc-port", str(GRPC), "--device-kv-gb", str(device_gb),
                               "--host-kv-gb", "1", "--disk-kv-gb", "4", "--kv-cache-dir", kv_dir)


def ttft(document: str, chat: bool) -> tuple[float, str]:
    """(time to the first token, the greedy answer's first 8 tokens of text)."""
    start, first, text = time.perf_counter(), None, ""
    if chat:
        path, body = "chat/completions", {"messages": [{"role": "user", "content": document + "\n\nSummarize the text above."}]}
    else:
        path, body = "completions", {"prompt": document}
    with requests.post(f"http://127.0.0.1:{HTTP}/v1/{path}", stream=True, timeout=600,
                       json={**body, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                first = first or time.perf_counter() - start
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or "" if chat else choice["text"]
    if first is None:
        raise RuntimeError("no token came back")
    return first, text


def tiers() -> dict:
    groups = requests.get(f"http://127.0.0.1:{HTTP}/v1/pagoda/status", timeout=30).json()["groups"]
    return groups[0]["kv_tiers"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chat", action="store_true", help="send the documents as chat messages")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_restart.json"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from cluster.bench.backends import default_model

    tokenizer = AutoTokenizer.from_pretrained(default_model(None))
    text = long_document(200_000)
    ids = tokenizer(text).input_ids
    docs = [tokenizer.decode(ids[i * args.tokens:(i + 1) * args.tokens - 16]) for i in range(4)]  # A, B, C, D
    block_bytes = 30 * 2 * 3 * 16 * 64 * 4
    device_gb = (args.tokens // 16 + 40) * block_bytes / (1 << 30)  # one document and a little more
    kv_dir = tempfile.mkdtemp(prefix="pagoda-kv-restart-")
    server = start_server(kv_dir, device_gb)
    try:
        row = {"tokens": args.tokens, "api": "chat" if args.chat else "completions"}
        row["recompute_first_s"], first_text = ttft(docs[0], args.chat)
        ttft(docs[1], args.chat)  # B and C evict A's blocks: spilled to host RAM and disk
        ttft(docs[2], args.chat)
        time.sleep(3)  # the writer thread finishes its pages
        row["pages_before_kill"] = len(list(Path(kv_dir).glob("*.page")))
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    time.sleep(2)
    server = start_server(kv_dir, device_gb)
    try:
        row["disk_hit_after_restart_s"], again_text = ttft(docs[0], args.chat)
        row["recompute_after_restart_s"], _ = ttft(docs[3], args.chat)
        row["same_text"] = again_text == first_text
        row["tiers_after"] = tiers()
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=120)
    row["speedup"] = row["recompute_after_restart_s"] / row["disk_hit_after_restart_s"]
    print(json.dumps(row, indent=1))
    save_rows(args.out, [row])
    print(markdown_rows(["API", "tokens", "recompute (first run, s)", "recompute (after restart, s)",
                         "disk hit after SIGKILL + restart (s)", "speed-up", "same text"],
                        [[row["api"], str(row["tokens"]), f"{row['recompute_first_s']:.2f}",
                          f"{row['recompute_after_restart_s']:.2f}", f"{row['disk_hit_after_restart_s']:.3f}",
                          f"{row['speedup']:.1f}×", str(row["same_text"])]]))


if __name__ == "__main__":
    main()
