"""Pagoda applications of a test's own on the session's Ray cluster, beside the session's server:
deployed for a test or module, reached by route prefix and gRPC `application` metadata, deleted
after; and the calls the tests make to them."""

import json
import os
import signal
import subprocess
import time
from contextlib import contextmanager

import grpc
import pytest
import requests
from click.testing import CliRunner

from cluster.cli import main as cli
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc as pb_grpc
from tests.conftest import METRICS_EXPORT_S, PARITY_MAX_TOKENS


def scrape_until(url: str, missing, timeout_s: float = 40) -> str:
    """The metrics page once `missing(text)` is empty (exported every METRICS_EXPORT_S, later on a
    busy host)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = requests.get(url, timeout=10).text
        gaps = missing(text)
        if not gaps:
            return text
        assert time.monotonic() < deadline, f"not exported: {gaps}"
        time.sleep(METRICS_EXPORT_S)


def metric_value(text: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples (every replica) whose labels contain `label`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


@contextmanager
def deployed(server, name: str, route: str, **args):
    """One more Pagoda application on the session's cluster, until the block ends."""
    from ray import serve

    from cluster.serve.app import build_app

    app_args = {"model": server["model_dir"], "torch_threads": 1, "request_timeout_s": 600,
                "engine": {"num_blocks": 256, **args.pop("engine", {})},
                "llm_server": {"ray_actor_options": {"num_cpus": 0}, "health_check_period_s": 1},
                "prefill_server": {"ray_actor_options": {"num_cpus": 0}, "health_check_period_s": 1},
                **args}
    serve.run(build_app(app_args), name=name, route_prefix=route, blocking=False)
    base = f"{server['http']}{route}"
    wait_healthy(base, timeout_s=300)
    channel = grpc.insecure_channel(server["grpc"])
    try:
        yield {"http": base, "channel": channel, "stub": pb_grpc.InferenceStub(channel), "metadata": (("application", name),),
               "address": f"{server['http'].removeprefix('http://')}{route}"}
    finally:
        channel.close()
        serve.delete(name)
        _kill_prefix_trees(name)
        _wait_until_routed_alone(server["grpc"], list(serve.status().applications))


def _kill_prefix_trees(app_name: str) -> None:
    """Serve's PrefixCacheAffinityRouter keeps a detached prefix-tree actor per deployment that
    only serve.shutdown() removes; an app deleted mid-session would leave them behind."""
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"] == "LlmPrefixTreeActor" and entry["namespace"].startswith(f"serve::{app_name}::"):
            ray.kill(ray.get_actor(entry["name"], namespace=entry["namespace"]))


def _wait_until_routed_alone(grpc_address: str, applications: list[str], timeout_s: float = 60) -> None:
    """Serve's HAProxy drops a deleted application's routes at its next reload, a moment after
    serve.delete returns; until then a call without `application` metadata (what the session
    server's tests send, as a client of a one-application server does) is refused NOT_FOUND.
    Where one application is left, waits until such a call reaches it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if len(applications) != 1:
        return
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(grpc_address) as channel:
        while True:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
                return
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            assert time.monotonic() < deadline, f"{applications[0]} is not routed alone after {timeout_s:.0f} s"
            time.sleep(0.2)


def wait_healthy(base: str, timeout_s: float, server: subprocess.Popen | None = None) -> None:
    """Until `base`/health answers 200; a server process of its own that exits first fails it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server is None or server.poll() is None, "the server exited"
        try:
            if requests.get(f"{base}/health", timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base} did not become healthy in {timeout_s:.0f} s")


def grpc_request(prompt: dict, **sampling) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(**{"max_tokens": PARITY_MAX_TOKENS, "temperature": 0, **sampling})
    if "prompt" in prompt:
        return pb.GenerateRequest(prompt=prompt["prompt"], sampling=sampling)
    messages = [pb.Message(role=m["role"], parts=[pb.Part(text=m["content"])]) for m in prompt["messages"]]
    return pb.GenerateRequest(messages=messages, sampling=sampling)


def answer(app, request: pb.GenerateRequest, timeout: float = 300) -> list[int]:
    return [t for r in app["stub"].Generate(request, metadata=app["metadata"], timeout=timeout) for t in r.token_ids]


def killed_mid_stream(app, request: pb.GenerateRequest, pid: int, num_tokens: int) -> grpc.RpcError:
    """Starts `request`'s stream, SIGKILLs process `pid` once two messages have come, and returns
    the error that ends the stream, checked to come before all `num_tokens` and well before the
    call's own 120 s deadline (a hung stream ends there; beside a build the error took 5.6 s)."""
    stream = app["stub"].Generate(request, metadata=app["metadata"], timeout=120)
    received = len(next(stream).token_ids) + len(next(stream).token_ids)  # streaming has begun
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(grpc.RpcError) as failure:
        for response in stream:
            received += len(response.token_ids)
    assert time.monotonic() - killed_at < 60.0
    assert received < num_tokens
    return failure.value


def answer_once_replaced(app, request: pb.GenerateRequest, timeout_s: float = 240) -> tuple[list[int], list[str]]:
    """Sends `request` until a replica Serve started in place of a killed one answers it: the
    answer's tokens and the refusals before it, each checked to be UNAVAILABLE."""
    deadline = time.monotonic() + timeout_s
    refusals = []
    while True:
        try:
            return answer(app, request, timeout=60), refusals
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()  # never anything else
            refusals.append(e.details())
            assert time.monotonic() < deadline, "Serve did not replace the killed replica"
            time.sleep(0.5)


def status(app) -> dict:
    result = CliRunner().invoke(cli, ["status", "--json", "--http", app["address"]])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
