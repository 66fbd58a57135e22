"""`pagoda serve` processes of a test's own (each its own local Ray cluster): started as users run
them, stopped by a signal, and checked to leave no process behind; and the drain that SIGTERM
(what Kubernetes sends) or Ctrl-C starts: new requests are refused with 503 / UNAVAILABLE, streams
in flight finish (or, past the grace period, end with an explicit error), the process exits 0."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
import requests
import urllib3

from protos import inference_pb2 as pb
from protos import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MODEL_NAME = "SmolLM2-135M-Instruct"
# Long enough for the short streams to finish on a busy host; the long ones outlast it.
DRAIN_S, SHORT = 15, 64


def pagoda_serve(model_dir, http: int, grpc_port: int, *options: str) -> subprocess.Popen:
    """`pagoda serve` on these ports, once it has printed its ready line."""
    proc = subprocess.Popen(
        [str(BIN / "pagoda"), "serve", "--model", model_dir, "--http-port", str(http), "--grpc-port", str(grpc_port),
         "--num-cpus", "1", *options],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True, cwd=ROOT,
    )
    line = proc.stdout.readline()
    assert line.strip() == f"pagoda ready grpc=127.0.0.1:{grpc_port} http=127.0.0.1:{http} model={MODEL_NAME}", line
    return proc


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


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


def ctrl_c(proc: subprocess.Popen) -> None:
    """Ctrl-C in a terminal: SIGINT to the whole foreground group, Ray's processes included."""
    os.killpg(proc.pid, signal.SIGINT)


def sigterm(proc: subprocess.Popen) -> None:
    """What Kubernetes does: SIGTERM to the process alone."""
    os.kill(proc.pid, signal.SIGTERM)


def assert_drains(proc: subprocess.Popen, http: int, grpc_port: int, stop) -> None:
    """Short and long streams (two HTTP, one gRPC each) in flight when `stop(proc)` comes: the
    short ones finish, the long ones end with an explicit error at the drain period's end (the
    server started with --drain-timeout DRAIN_S and room for six running requests); new requests
    are refused in the API's JSON, never cut without an answer; the server exits 0 and leaves no
    process behind."""
    children = descendants(proc.pid)
    assert children, "the server started no Ray processes?"
    base = f"http://127.0.0.1:{http}"
    short_threads, short = _start_streams(base, grpc_port, max_tokens=SHORT)
    long_threads, long = _start_streams(base, grpc_port, max_tokens=4000)
    stop(proc)
    probes: list = []
    prober = threading.Thread(target=_probe_until_gone, args=(base, probes))
    prober.start()
    r, error = _refused_while_draining(base, grpc_port)
    assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "service_unavailable", r.text
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.details()
    for t in short_threads + long_threads:
        t.join(300)
    for out in short[:2]:  # within the drain period: finished as usual
        assert out["events"][-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0] for e in out["events"][:-1]]
        assert texts[-1]["finish_reason"] == "length"
    assert short[2]["result"] == ("OK", SHORT)
    for out in long[:2]:  # past it: an explicit error event, not a cut connection
        last = json.loads(out["events"][-1])
        assert last["error"]["type"] == "service_unavailable" and "drain period" in last["error"]["message"]
    code, tokens, details = long[2]["result"]
    assert code == "UNAVAILABLE" and "drain period" in details and 0 < tokens < 4000
    assert proc.wait(timeout=300) == 0
    assert_all_gone(children)
    prober.join(60)
    assert probes[-1] == "refused" and set(probes) <= {200, 503, "refused"}, probes
    assert 503 in probes


def _http_stream(base: str, max_tokens: int, started: threading.Event, out: dict) -> None:
    with requests.post(f"{base}/v1/completions", stream=True, timeout=300, json={
            "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}) as r:
        events = []
        for line in r.iter_lines():
            if line:
                events.append(line.decode().removeprefix("data: "))
                started.set()
        out["events"] = events


def _grpc_stream(grpc_port: int, max_tokens: int, started: threading.Event, out: dict) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        request = pb.GenerateRequest(prompt="In a galaxy far away", sampling=pb.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0))
        tokens = 0
        try:
            for response in pb_grpc.InferenceStub(channel).Generate(request, timeout=300):
                tokens += len(response.token_ids)
                started.set()
            out["result"] = ("OK", tokens)
        except grpc.RpcError as e:
            out["result"] = (e.code().name, tokens, e.details())


def _start_streams(base: str, grpc_port: int, max_tokens: int):
    """Two HTTP streams and one gRPC stream of `max_tokens` each, each started once the one before
    has its first token (a server whose queue takes one request refuses a burst): (threads, outputs)."""
    outs = [{}, {}, {}]
    threads = []
    for i, (stream, to) in enumerate([(_http_stream, base), (_http_stream, base), (_grpc_stream, grpc_port)]):
        started = threading.Event()
        threads.append(threading.Thread(target=stream, args=(to, max_tokens, started, outs[i])))
        threads[-1].start()
        assert started.wait(120), outs[i]
    return threads, outs


def _refused_while_draining(base: str, grpc_port: int) -> tuple[requests.Response, grpc.RpcError]:
    """New HTTP, then gRPC requests until one of each is refused: the Ingress and the model
    server each learn of the drain within ~1 s, on their own, so one may admit a request
    after the other has refused one. The first gRPC request that fails must be the drain's
    refusal: with another server on this host (the suite's session server), one whose gRPC
    port the kernel shared between both (cluster/serve/grpc_bind.py) failed here."""
    deadline = time.monotonic() + 60  # generous: on a busy host each "hi" can take seconds
    while True:
        r = requests.post(f"{base}/v1/completions", timeout=30, json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            break
        assert time.monotonic() < deadline
    while True:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            try:
                list(pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))))
            except grpc.RpcError as error:
                return r, error
        assert time.monotonic() < deadline, f"gRPC still admitted after HTTP was refused with {r.text}"


def _probe_until_gone(base: str, outcomes: list) -> None:
    """A new request every 0.1 s through the whole stop, until the port refuses connections: each
    must be answered in the API's JSON (503 once the drain is known) or refused, never cut
    without an answer."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            r = requests.post(f"{base}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 2})
            json_body = r.headers.get("content-type", "").startswith("application/json")
            outcomes.append(r.status_code if json_body else f"{r.status_code}, not JSON: {r.text[:80]}")
        except requests.ConnectionError as e:
            refused = isinstance(getattr(e.args[0], "reason", None), urllib3.exceptions.NewConnectionError)
            outcomes.append("refused" if refused else f"cut: {e}")
            if refused:
                return
        time.sleep(0.1)
