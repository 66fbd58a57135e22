"""`pagoda serve` (what `make serve` runs) and `serve run serve_config.yaml`, as users run them:
each starts its own local Ray cluster, answers, and on Ctrl-C leaves no process behind."""

import pytest
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
import requests

from protos import inference_pb2 as pb
from protos import inference_pb2_grpc as pb_grpc

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


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if requests.get(url, timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def test_pagoda_serve_prints_ready_answers_and_ctrl_c_stops_ray(model_dir, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(  # one running and one waiting request fill it
        "applications:\n  - name: pagoda\n    args:\n      engine: {kv_cache_bytes: 134217728, max_num_seqs: 1}\n"
        "      max_waiting_requests: 1\n      llm_server: {ray_actor_options: {num_cpus: 0}}\n"
    )
    proc = subprocess.Popen(
        [str(BIN / "pagoda"), "serve", "--model", model_dir, "--config", str(config),
         "--http-port", "18200", "--grpc-port", "19200", "--num-cpus", "1", "--front-door"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True, cwd=ROOT,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "pagoda ready grpc=127.0.0.1:19200 http=127.0.0.1:18200 model=SmolLM2-135M-Instruct"
        r = requests.post("http://127.0.0.1:18200/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 20, "temperature": 0})
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        front_door_refuses_while_full_then_admits("http://127.0.0.1:18200")
        stop_and_check_nothing_is_left(proc, descendants(proc.pid))  # HAProxy included
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


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
        wait_http("http://127.0.0.1:8000/health", proc)
        with grpc.insecure_channel("127.0.0.1:9000") as channel:
            responses = list(pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(
                prompt="The capital of France is", sampling=pb.SamplingParams(max_tokens=5, temperature=0))))
        assert responses[-1].finish_reason == "length"
        stop_and_check_nothing_is_left(proc, descendants(proc.pid))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
