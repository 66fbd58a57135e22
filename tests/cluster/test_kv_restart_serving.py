"""A chat document (the model's default system prompt in front) pushed out of device memory to
disk, then `pagoda serve` SIGKILLed (Ray and all; no process of it outlives it, HAProxy included)
and started again on the same directory and ports: the same question gets the same answer, with
every full block of the document restored from disk."""

import pytest
import os
import signal
import subprocess
import time

import requests

from tests.cluster.test_serve_cli import BIN, ROOT, assert_all_gone, descendants
from tests.parity_prompts import DOC, DOC_B

pytestmark = pytest.mark.ray  # a Ray cluster or a served model: make test only

HTTP, GRPC = 18600, 19600
BLOCK_BYTES = 30 * 2 * 3 * 16 * 64 * 4  # the default model's KV per block (fp32)


def start(model_dir, kv_dir) -> subprocess.Popen:
    proc = subprocess.Popen(
        [str(BIN / "pagoda"), "serve", "--model", model_dir, "--http-port", str(HTTP), "--grpc-port", str(GRPC),
         "--num-cpus", "1", "--device-kv-gb", str(48 * BLOCK_BYTES / (1 << 30)), "--host-kv-gb", "0",
         "--disk-kv-gb", "1", "--kv-cache-dir", str(kv_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True, cwd=ROOT,
    )
    assert proc.stdout.readline().startswith("pagoda ready")
    return proc


def ask(text: str) -> tuple[str, int]:
    r = requests.post(f"http://127.0.0.1:{HTTP}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def test_a_chat_document_on_disk_survives_sigkill_and_restart(model_dir, tmp_path):
    document = DOC[:2000] + "\n\nSummarize the text above."
    server = start(model_dir, tmp_path)
    children = descendants(server.pid)  # HAProxy among them
    try:
        first, num_prompt_tokens = ask(document)
        ask(DOC_B[:2200])  # two other chats need every device block: the document's go to disk
        ask(DOC_B[3000:5200])
        num_blocks = (num_prompt_tokens - 1) // 16
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.page"))) < num_blocks:  # the writer thread is behind
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert_all_gone(children)  # HAProxy too, though not in the process group: nothing keeps the ports
    server = start(model_dir, tmp_path)
    try:
        again, _ = ask(document)
        (group,) = requests.get(f"http://127.0.0.1:{HTTP}/v1/pagoda/status", timeout=30).json()["groups"]
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0
    assert server.stdout.read() == ""  # the ready line was all: Ray's forwarded lines go to stderr
    assert again == first
    assert group["kv_tiers"]["restored_from"]["disk"] == num_blocks
