"""`pagoda serve` (what `make serve` runs) and `serve run serve_config.yaml`, as users run them:
each starts its own local Ray cluster, answers, and stops leaving no process behind. `pagoda
serve` twice on the same ports and KV directory, the first SIGKILLed: a chat document it had
pushed to disk comes back from there; the second, behind its front door, drains on SIGTERM."""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import requests

from protos import inference_pb2 as pb
from protos import inference_pb2_grpc as pb_grpc
from tests.cluster.factories import block_bytes
from tests.cluster.served_processes import (BIN, DRAIN_S, ROOT, assert_all_gone, assert_drains, ctrl_c, descendants,
                                            pagoda_serve, sigterm)
from tests.parity_prompts import DOC, DOC_B
from tests.served_apps import wait_healthy

pytestmark = pytest.mark.ray  # a Ray cluster or a served model: make test only

HTTP, GRPC = 18200, 19200
BASE = f"http://127.0.0.1:{HTTP}"
# Room for the drain's six streams and its two requests at a time while it runs, and a queue that
# takes the two when they come at once (a request waits in it until the engine's next step).
RUNNING, WAITING = 8, 2


def serve_with_tiers(model_dir, kv_dir: Path, device_blocks: int, *options: str) -> subprocess.Popen:
    """`pagoda serve` with this many blocks of device KV and a disk tier in kv_dir."""
    return pagoda_serve(model_dir, HTTP, GRPC, "--device-kv-gb", str(device_blocks * block_bytes(model_dir) / (1 << 30)),
                        "--host-kv-gb", "0", "--disk-kv-gb", "1", "--kv-cache-dir", str(kv_dir), *options)


def ask(text: str) -> tuple[str, int]:
    r = requests.post(f"{BASE}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def test_pagoda_serve_brings_a_document_back_from_disk_after_sigkill_and_drains_on_sigterm(model_dir, tmp_path):
    """1. A chat document (the model's default system prompt in front) pushed out of device memory
    to disk by two other chats, then `pagoda serve` SIGKILLed: Ray and all, HAProxy too, go.
    2. Started again on the same ports and directory, behind its front door, its running and
    waiting requests full: the same question gets the same answer, every full block of the
    document restored from disk; it answers another; the front door refuses while full; SIGTERM
    drains it (served_processes.assert_drains), nothing left, exit 0, the ready line all it printed."""
    kv_dir = tmp_path / "kv"
    document = DOC[:2000] + "\n\nSummarize the text above."
    server = serve_with_tiers(model_dir, kv_dir, 48)
    children = descendants(server.pid)  # HAProxy among them
    try:
        first, num_prompt_tokens = ask(document)
        ask(DOC_B[:2200])  # two other chats need every device block: the document's go to disk
        ask(DOC_B[3000:5200])
        num_blocks = (num_prompt_tokens - 1) // 16
        deadline = time.monotonic() + 60
        while len(list(kv_dir.glob("*.page"))) < num_blocks:  # the writer thread is behind
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert_all_gone(children)  # HAProxy too, though not in the process group: nothing keeps the ports

    config = tmp_path / "serve.yaml"
    config.write_text(  # RUNNING running and WAITING waiting requests fill it
        f"applications:\n  - name: pagoda\n    args:\n      engine: {{max_num_seqs: {RUNNING}}}\n"
        f"      max_waiting_requests: {WAITING}\n      llm_server: {{ray_actor_options: {{num_cpus: 0}}}}\n"
    )
    # room on the device for the front door's and the drain's streams
    server = serve_with_tiers(model_dir, kv_dir, 1024, "--config", str(config), "--front-door",
                              "--drain-timeout", str(DRAIN_S))
    try:
        again, _ = ask(document)
        (group,) = requests.get(f"{BASE}/v1/pagoda/status", timeout=30).json()["groups"]
        assert again == first
        assert group["kv_tiers"]["restored_from"]["disk"] == num_blocks
        r = requests.post(f"{BASE}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 20, "temperature": 0})
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        front_door_refuses_while_full_then_admits(BASE)
        assert_drains(server, HTTP, GRPC, stop=sigterm)  # HAProxy included in what must go
        assert server.stdout.read() == ""  # the ready line was all: Ray's forwarded lines go to stderr
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def front_door_refuses_while_full_then_admits(base: str) -> None:
    """RUNNING long streams run, WAITING more wait: the queue is full, so HAProxy answers the 429
    (its header says so); once the streams are gone, requests are admitted again."""
    long = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    running, waiting = [], []
    try:
        for _ in range(RUNNING):
            running.append(requests.post(f"{base}/v1/completions", json=long, stream=True, timeout=300))
            assert running[-1].status_code == 200  # its first token came: it runs
        # The waiting ones answer nothing until they run, so they go over plain sockets we can close.
        body = json.dumps(long).encode()
        host, port = base.removeprefix("http://").split(":")
        for _ in range(WAITING):
            waiting.append(socket.create_connection((host, int(port))))
            waiting[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        # Probe only once they wait in the engine: a probe that got there first would itself take
        # a waiting place, and wait behind the 2000-token streams (seen beside a CPU-bound
        # process, where the raw requests took longer to arrive).
        deadline = time.monotonic() + 120
        while requests.get(f"{base}/v1/pagoda/stats", timeout=60).json()["num_waiting"] < WAITING:
            assert time.monotonic() < deadline, "the waiting streams never reached the engine's queue"
            time.sleep(0.2)
        deadline = time.monotonic() + 60
        while True:  # the flag follows the ingress's queue: 429s from it until then
            r = requests.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            assert r.status_code == 429, r.text
            if r.headers.get("x-pagoda-refused-by") == "front-door":
                break
            assert time.monotonic() < deadline
        assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for connection in running + waiting:
            connection.close()  # a closed connection cancels the request
    deadline = time.monotonic() + 120
    while requests.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the front door kept refusing after the queue emptied"
        time.sleep(0.5)
    while (stats := requests.get(f"{base}/v1/pagoda/stats", timeout=60).json())["num_running"] + stats["num_waiting"]:
        assert time.monotonic() < deadline, f"the closed streams still run: {stats}"  # what comes next needs every place
        time.sleep(0.2)


def test_serve_run_with_the_checked_in_config(model_dir):
    env = {**os.environ, "RAY_ADDRESS": "local"}
    proc = subprocess.Popen(
        [str(BIN / "serve"), "run", "serve_config.yaml"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=ROOT, env=env,
    )
    try:
        wait_healthy("http://127.0.0.1:8000", 240, server=proc)
        with grpc.insecure_channel("127.0.0.1:9000") as channel:
            responses = list(pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(
                prompt="The capital of France is", sampling=pb.SamplingParams(max_tokens=5, temperature=0))))
        assert responses[-1].finish_reason == "length"
        children = descendants(proc.pid)
        assert children, "the server started no Ray processes?"
        ctrl_c(proc)
        proc.wait(timeout=180)
        assert_all_gone(children)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
