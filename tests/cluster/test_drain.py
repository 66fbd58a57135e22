"""SIGTERM (what Kubernetes sends) drains `pagoda serve`: new requests are refused with 503 /
UNAVAILABLE, streams in flight finish (or, past the grace period, end with an explicit error),
the process exits 0 and no Ray or Pagoda process is left. One server, short and long streams."""

import json
import os
import signal
import subprocess
import threading
import time

import grpc
import psutil
import pytest
import requests
import urllib3

from protos import inference_pb2 as pb
from protos import inference_pb2_grpc as pb_grpc
from tests.cluster.test_serve_cli import BIN, ROOT, assert_all_gone, descendants

pytestmark = pytest.mark.ray  # a Ray cluster or a served model: make test only

HTTP, GRPC = 18400, 19400


def start_server(model_dir, drain_timeout: float, *options: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [str(BIN / "pagoda"), "serve", "--model", model_dir, "--http-port", str(HTTP), "--grpc-port", str(GRPC),
         "--num-cpus", "1", "--drain-timeout", str(drain_timeout), *options],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True, cwd=ROOT,
    )
    assert proc.stdout.readline().startswith("pagoda ready")
    return proc


def http_stream(max_tokens: int, started: threading.Event, out: dict) -> None:
    with requests.post(f"http://127.0.0.1:{HTTP}/v1/completions", stream=True, timeout=300, json={
            "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}) as r:
        events = []
        for line in r.iter_lines():
            if line:
                events.append(line.decode().removeprefix("data: "))
                started.set()
        out["events"] = events


def grpc_stream(max_tokens: int, started: threading.Event, out: dict) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{GRPC}") as channel:
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


def start_streams(max_tokens: int):
    """Two HTTP streams and one gRPC stream of `max_tokens` each: (threads, outputs, first-token events)."""
    outs = [{}, {}, {}]
    events = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=http_stream, args=(max_tokens, events[0], outs[0])),
               threading.Thread(target=http_stream, args=(max_tokens, events[1], outs[1])),
               threading.Thread(target=grpc_stream, args=(max_tokens, events[2], outs[2]))]
    for t in threads:
        t.start()
    return threads, outs, events


def refused_while_draining() -> tuple[requests.Response, grpc.RpcError]:
    """New HTTP, then gRPC requests until one of each is refused: the Ingress and the model
    server each learn of the drain within ~1 s, on their own, so one may admit a request
    after the other has refused one. The first gRPC request that fails must be the drain's
    refusal: with another server on this host (the suite's session server), one whose gRPC
    port the kernel shared between both (cluster/serve/grpc_bind.py) failed here."""
    deadline = time.monotonic() + 60  # generous: on a busy host each "hi" can take seconds
    while True:
        r = requests.post(f"http://127.0.0.1:{HTTP}/v1/completions", timeout=30, json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            break
        assert time.monotonic() < deadline
    while True:
        with grpc.insecure_channel(f"127.0.0.1:{GRPC}") as channel:
            try:
                list(pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))))
            except grpc.RpcError as error:
                return r, error
        assert time.monotonic() < deadline, f"gRPC still admitted after HTTP was refused with {r.text}"


def probe_until_gone(outcomes: list) -> None:
    """A new request every 0.1 s through the whole stop, until the port refuses connections: each
    must be answered in the API's JSON (503 once the drain is known) or refused, never cut
    without an answer."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            r = requests.post(f"http://127.0.0.1:{HTTP}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 2})
            json_body = r.headers.get("content-type", "").startswith("application/json")
            outcomes.append(r.status_code if json_body else f"{r.status_code}, not JSON: {r.text[:80]}")
        except requests.ConnectionError as e:
            refused = isinstance(getattr(e.args[0], "reason", None), urllib3.exceptions.NewConnectionError)
            outcomes.append("refused" if refused else f"cut: {e}")
            if refused:
                return
        time.sleep(0.1)


def assert_no_port_shared_with_another_server(children: list[psutil.Process]) -> None:
    """Every address this server listens on is its own. Serve's replicas pick their ports from one
    range per cluster (direct ingress: 40000+ for gRPC), so a second cluster on the host tries the
    first's; a bind that shares the port instead of failing lets the kernel hand this server's
    connections to the other (cluster/serve/grpc_bind.py)."""
    pids = {p.pid for p in children}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    ours = {c.laddr for c in listening if c.pid in pids}
    assert ours, "the server listens nowhere?"
    shared = [(c.laddr, psutil.Process(c.pid).name()) for c in listening if c.pid not in pids and c.laddr in ours]
    assert not shared, shared


def exits_cleanly(proc: subprocess.Popen, children: list[psutil.Process]) -> None:
    assert proc.wait(timeout=300) == 0
    assert_all_gone(children)


# Long enough for the short streams to finish on a busy host; the long ones outlast it.
DRAIN_S, SHORT = 15, 64


# The two deployments behind the front door, as `make serve` runs them (serve_config.yaml).
@pytest.mark.parametrize("options", [("--front-door",), ("--engine-in-ingress",)],
                         ids=["two deployments, front door", "engine in ingress"])
def test_sigterm_finishes_short_streams_ends_long_ones_with_an_error_refuses_new_ones_and_leaves_nothing(
        model_dir, server, options):
    """With the session's server up too: two servers on one host, as in the suite and on a developer's
    machine. With the engine in the ingress's process too: the engine ends the long streams at the
    deadline while the replica still lives to send their error events."""
    proc = start_server(model_dir, DRAIN_S, *options)
    try:
        children = descendants(proc.pid)
        assert_no_port_shared_with_another_server(children)
        short_threads, short, short_started = start_streams(max_tokens=SHORT)
        long_threads, long, long_started = start_streams(max_tokens=4000)
        for started in short_started + long_started:
            assert started.wait(120)
        os.kill(proc.pid, signal.SIGTERM)  # the process alone, as Kubernetes does
        probes: list = []
        prober = threading.Thread(target=probe_until_gone, args=(probes,))
        prober.start()
        r, error = refused_while_draining()
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
        exits_cleanly(proc, children)
        prober.join(60)
        assert probes[-1] == "refused" and set(probes) <= {200, 503, "refused"}, probes
        assert 503 in probes
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_drain_counts_replicas_that_report_and_forgets_those_gone_quiet():
    from cluster.serve.drain import GONE_AFTER_S, Report, count_in_flight

    now = 1_000.0
    before_the_drain = [Report(2, now, False), Report(0, now, False)]
    assert count_in_flight(before_the_drain, now) == (2, 2)  # neither has heard of the drain yet
    a_heard = [Report(1, now + 1, True), Report(0, now, False)]
    assert count_in_flight(a_heard, now + 1) == (1, 1)
    b_gone_quiet = [Report(1, now + GONE_AFTER_S, True), Report(0, now, False)]  # Serve replaced b
    assert count_in_flight(b_gone_quiet, now + GONE_AFTER_S) == (1, 0)


def test_replicas_report_to_the_gcs_and_a_new_server_forgets_an_earlier_drain(server):
    from cluster.serve import drain

    def live_reports():
        return drain.live_reports(drain.read_reports(), time.time())

    deadline = time.monotonic() + 10
    while len(live_reports()) < 2 and time.monotonic() < deadline:  # the Ingress and the LLMServer
        time.sleep(0.2)
    assert len(live_reports()) >= 2 and drain.read_deadline() is None
    assert drain.count_in_flight(drain.read_reports(), time.time()) == (0, len(live_reports()))

    # An earlier server's drain left on the cluster (far off: nothing here fails at it).
    from ray.experimental import internal_kv
    internal_kv._internal_kv_put(drain.DEADLINE_KEY, str(time.time() + 3600), namespace=drain.KV_NAMESPACE)
    drain.reset()
    assert drain.read_deadline() is None
    deadline = time.monotonic() + 10
    while any(r.knew_deadline for r in live_reports()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(r.knew_deadline for r in live_reports())  # as before, within a report or two
    assert requests.get(f"{server['http']}/health", timeout=30).status_code == 200
