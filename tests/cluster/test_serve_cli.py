"""`pagoda serve` (what `make serve` runs) and `serve run serve_config.yaml`, as users run them:
each starts its own local Ray cluster, answers, and on Ctrl-C leaves no process behind. `pagoda
serve` twice on the same ports and KV directory, the first SIGKILLed: a chat document it had
pushed to disk comes back from there."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
import requests

from protos import inference_pb2 as pb
from protos import inference_pb2_grpc as pb_grpc
from tests.cluster.factories import block_bytes
from tests.parity_prompts import DOC, DOC_B
from tests.served_apps import wait_healthy

pytestmark = pytest.mark.ray  # a Ray cluster or a served model: make test only

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def stop_and_check_nothing_is_left(proc: subprocess.Popen, children: list[psutil.Process]) -> None:
    assert children, "the server started no Ray processes?"
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
    proc.wait(timeout=180)
    assert_all_gone(children)


def assert_all_gone(processes: list[psutil.Process], timeout_s: float = 30) -> None:
    """Every one of these processes exits within the timeout (Ray's stop their children
    asynchronously, so a moment after the server itself)."""
    deadline = time.monotonic() + timeout_s
    while alive := [p for p in processes if _alive(p)]:
        if time.monotonic() > deadline:
            raise AssertionError(f"still running: {[' '.join(p.cmdline()[:3]) for p in alive]}")
        time.sleep(0.5)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


HTTP, GRPC = 18200, 19200
BASE = f"http://127.0.0.1:{HTTP}"


def pagoda_serve(model_dir, kv_dir: Path, device_blocks: int, *options: str) -> subprocess.Popen:
    """`pagoda serve` with this many blocks of device KV and a disk tier in kv_dir, once it has
    printed its ready line."""
    proc = subprocess.Popen(
        [str(BIN / "pagoda"), "serve", "--model", model_dir, "--http-port", str(HTTP), "--grpc-port", str(GRPC),
         "--num-cpus", "1", "--device-kv-gb", str(device_blocks * block_bytes(model_dir) / (1 << 30)), "--host-kv-gb", "0",
         "--disk-kv-gb", "1", "--kv-cache-dir", str(kv_dir), *options],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True, cwd=ROOT,
    )
    line = proc.stdout.readline()
    assert line.strip() == f"pagoda ready grpc=127.0.0.1:{GRPC} http=127.0.0.1:{HTTP} model=SmolLM2-135M-Instruct", line
    return proc


def ask(text: str) -> tuple[str, int]:
    r = requests.post(f"{BASE}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def test_pagoda_serve_brings_a_document_back_from_disk_after_sigkill_and_ctrl_c_stops_ray(model_dir, tmp_path):
    """1. A chat document (the model's default system prompt in front) pushed out of device memory
    to disk by two other chats, then `pagoda serve` SIGKILLed: Ray and all, HAProxy too, go.
    2. Started again on the same ports and directory, behind its front door, one running and one
    waiting request filling it: the same question gets the same answer, every full block of the
    document restored from disk; it answers another; the front door refuses while full; Ctrl-C
    stops it and Ray, nothing left, exit 0, the ready line all it printed."""
    kv_dir = tmp_path / "kv"
    document = DOC[:2000] + "\n\nSummarize the text above."
    server = pagoda_serve(model_dir, kv_dir, 48)
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
    config.write_text(  # one running and one waiting request fill it
        "applications:\n  - name: pagoda\n    args:\n      engine: {max_num_seqs: 1}\n"
        "      max_waiting_requests: 1\n      llm_server: {ray_actor_options: {num_cpus: 0}}\n"
    )
    # room on the device for the front door's 2000-token stream
    server = pagoda_serve(model_dir, kv_dir, 256, "--config", str(config), "--front-door")
    try:
        again, _ = ask(document)
        (group,) = requests.get(f"{BASE}/v1/pagoda/status", timeout=30).json()["groups"]
        assert again == first
        assert group["kv_tiers"]["restored_from"]["disk"] == num_blocks
        r = requests.post(f"{BASE}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 20, "temperature": 0})
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        front_door_refuses_while_full_then_admits(BASE)
        stop_and_check_nothing_is_left(server, descendants(server.pid))  # HAProxy included
        assert server.returncode == 0
        assert server.stdout.read() == ""  # the ready line was all: Ray's forwarded lines go to stderr
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def front_door_refuses_while_full_then_admits(base: str) -> None:
    """One long stream runs, a second waits: the queue is full, so HAProxy answers the 429 (its
    header says so); once both streams are gone, requests are admitted again."""
    long = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    running = requests.post(f"{base}/v1/completions", json=long, stream=True, timeout=300)
    assert running.status_code == 200  # its first token came: it runs
    # The waiting one answers nothing until it runs, so it goes over a plain socket we can close.
    body = json.dumps(long).encode()
    host, port = base.removeprefix("http://").split(":")
    waiting = socket.create_connection((host, int(port)))
    waiting.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        # Probe only once the second stream waits in the engine: a probe that got there first would
        # itself take the one waiting place, and wait behind the 2000-token stream (seen beside a
        # CPU-bound process, where the raw request took longer to arrive).
        deadline = time.monotonic() + 120
        while requests.get(f"{base}/v1/pagoda/stats", timeout=60).json()["num_waiting"] < 1:
            assert time.monotonic() < deadline, "the second stream never reached the engine's queue"
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
        running.close()  # a closed connection cancels the request
        waiting.close()
    deadline = time.monotonic() + 120
    while requests.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the front door kept refusing after the queue emptied"
        time.sleep(0.5)


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
        stop_and_check_nothing_is_left(proc, descendants(proc.pid))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
