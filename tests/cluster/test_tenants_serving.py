"""Tenants over the real server (a Serve application of its own on the session's cluster, two
ingress replicas, a keys file of four tenants): every route and method but health refuses a
missing or wrong key with 401 / UNAUTHENTICATED; KV is shared only within a tenant (and a client's
cache_salt); a tenant sees and cancels only its own requests; compute-unit budgets run out at
exactly the computed units across both ingress replicas, and a per-request cap stops generation;
deleting the app does not wait for the ingress replicas' long polls of the ledger."""

from __future__ import annotations

import hashlib
import time

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import inference_pb2 as pb
from tests.cluster.test_disaggregated_serving import deployed
from tests.cluster.test_kv_tiers_serving import metric_value

pytestmark = pytest.mark.ray  # a Ray cluster or a served model: make test only

KEY_A = "sk-team-a-0123456789"
KEY_B = "sk-team-b-9876543210"
KEY_METERED = "sk-metered-01234567"
KEY_CAPPED = "sk-capped-012345678"
WRONG = "sk-nobody-0000000000"
# prompt tokens cost 1 unit, output tokens 2; a request of PROMPT with max_tokens 4 costs 5 + 8
PROMPT, COST = [1, 2, 3, 4, 5], 13
BUDGET_REQUESTS = 8  # the metered tenant's budget: exactly this many such requests
CAP = 15  # the capped tenant's max_units_per_request: 5 prompt units + 5 output tokens


@pytest.fixture(scope="module")
def keyed_app(server, model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    keys = folder / "tenants.yaml"
    keys.write_text(f"compute_units: {{prompt_token: 1, output_token: 2}}\n"
                    f"tenants:\n  a: {{keys: [{KEY_A}], admin: true}}\n"
                    f"  b: {{keys: ['sha256:{hashlib.sha256(KEY_B.encode()).hexdigest()}']}}\n"
                    f"  metered: {{keys: [{KEY_METERED}], budget: {{units: {BUDGET_REQUESTS * COST}, window_s: 3600}}}}\n"
                    f"  capped: {{keys: [{KEY_CAPPED}], max_units_per_request: {CAP}}}\n")
    with deployed({**server, "model_dir": model_dir}, "keyed", "/keyed", api_keys_file=str(keys),
                  usage_log=str(folder / "usage.jsonl"), ingress={"num_replicas": 2}) as app:
        yield {**app, "usage_log": folder / "usage.jsonl", "metrics": server["metrics"]}
        deleting = time.monotonic()
    assert_deleted_without_waiting_for_a_long_poll(time.monotonic() - deleting)


def assert_deleted_without_waiting_for_a_long_poll(seconds: float) -> None:
    """Deleting the app (as this module's fixture ends) does not wait for its ingress replicas'
    long polls of the TenantLedger (each started with the replica's first request): Serve stops a
    replica once its requests end, so a poll left at the ledger held the delete until it returned
    (POLL_TIMEOUT_S after it began), or until Serve killed the ledger."""
    from cluster.serve.ledger import POLL_TIMEOUT_S

    assert seconds < POLL_TIMEOUT_S / 2


def http(app, method: str, path: str, key: str | None, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.request(method, f"{app['http']}{path}", headers=headers, timeout=120, **kwargs)


# (method, path, body, the answer to a tenant's key)
ROUTES = [("GET", "/v1/models", {}, 200), ("GET", "/v1/pagoda/stats", {}, 200),
          ("POST", "/v1/completions", {"json": {"prompt": "Hi", "max_tokens": 1}}, 200),
          ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}}, 200),
          ("GET", "/v1/pagoda/requests", {}, 200), ("DELETE", "/v1/pagoda/requests/none-such", {}, 404)]


@pytest.mark.parametrize("method, path, kwargs, answer", ROUTES, ids=[f"{r[0]} {r[1]}" for r in ROUTES])
def test_every_http_route_needs_a_tenants_key(keyed_app, method, path, kwargs, answer):
    for key in (None, WRONG):
        r = http(keyed_app, method, path, key, **kwargs)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", r.text
        assert r.json()["error"]["type"] == "authentication_error"
    r = requests.request(method, f"{keyed_app['http']}{path}", headers={"Authorization": f"Basic {KEY_A}"},
                         timeout=120, **kwargs)
    assert r.status_code == 401
    for key in (KEY_A, KEY_B):
        assert http(keyed_app, method, path, key, **kwargs).status_code == answer


def test_refused_keys_leave_no_traceback_in_the_logs(keyed_app):
    """A flood of requests without a key must not flood the replica's log with stack traces."""
    import glob
    import os

    for _ in range(3):
        assert http(keyed_app, "GET", "/v1/models", WRONG).status_code == 401
    logs = glob.glob(os.path.join(_session_dir(), "logs", "serve", "replica_keyed_Ingress_*.log"))
    assert logs and not any("Traceback" in open(path).read() for path in logs)


def _session_dir() -> str:
    import ray

    return ray._private.worker._global_node.get_session_dir_path()


def test_status_needs_an_admins_key(keyed_app):
    assert http(keyed_app, "GET", "/v1/pagoda/status", KEY_A).status_code == 200
    r = http(keyed_app, "GET", "/v1/pagoda/status", KEY_B)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert http(keyed_app, "GET", "/v1/pagoda/status", None).status_code == 401


def test_health_needs_no_key(keyed_app):
    assert http(keyed_app, "GET", "/health", None).status_code == 200
    stub, metadata = keyed_app["stub"], keyed_app["metadata"]
    assert stub.Health(pb.HealthRequest(), metadata=metadata, timeout=60).healthy
    check = health_pb2_grpc.HealthStub(keyed_app["channel"]).Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=60)
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_methods_need_a_tenants_key(keyed_app):
    stub = keyed_app["stub"]
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=2, temperature=0))
    calls = [lambda md: list(stub.Generate(request, metadata=md, timeout=120)),
             lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=120),
             lambda md: stub.ListRequests(pb.ListRequestsRequest(), metadata=md, timeout=120) or True]
    for call in calls:
        for auth in ((), (("authorization", f"Bearer {WRONG}"),), (("authorization", KEY_A),)):
            with pytest.raises(grpc.RpcError) as error:
                call(keyed_app["metadata"] + auth)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, error.value.details()
        assert call(keyed_app["metadata"] + (("authorization", f"Bearer {KEY_B}"),))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Cancel(pb.CancelRequest(request_id="none-such"), metadata=keyed_app["metadata"], timeout=60)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_kv_is_shared_within_a_tenant_and_a_cache_salt_only(keyed_app):
    """Cache hits as OpenAI reports them (usage.prompt_tokens_details.cached_tokens) and as gRPC
    does (cached_tokens): A's document is no hit for B, nor for A with another cache_salt."""
    prompt = "Pagoda keeps each tenant's KV to itself. " * 12  # ~120 tokens: 7 full blocks

    def cached(key: str, **extra) -> int:
        r = http(keyed_app, "POST", "/v1/completions", key, json={"prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(KEY_A) == 0
    assert cached(KEY_B) == 0  # B shares nothing with A
    assert cached(KEY_A, cache_salt="mine") == 0
    hit = cached(KEY_A)
    assert hit >= 6 * 16 and hit % 16 == 0  # A's own full blocks
    assert cached(KEY_A, cache_salt="mine") == hit
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=1, temperature=0))
    auth = keyed_app["metadata"] + (("authorization", f"Bearer {KEY_B}"),)
    [response] = keyed_app["stub"].Generate(request, metadata=auth, timeout=120)
    assert response.cached_tokens == hit and response.prompt_tokens > hit


def complete(app, key: str, **body) -> requests.Response:
    return http(app, "POST", "/v1/completions", key, json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True,
                                                          "temperature": 0, **body})


def test_a_budget_runs_out_at_exactly_its_units_across_two_ingress_replicas(keyed_app):
    from cluster.serve.usage_log import read_usage, sum_by_tenant

    for _ in range(BUDGET_REQUESTS):
        r = complete(keyed_app, KEY_METERED)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["compute_units"] == COST and "compute_units_limit" not in r.json()["usage"]
    refused = complete(keyed_app, KEY_METERED)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error", refused.text
    assert "0 of its 104 compute units" in refused.json()["error"]["message"]
    assert 3500 <= int(refused.headers["Retry-After"]) <= 3600  # when the first charge leaves the window
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.RpcError) as error:
        list(keyed_app["stub"].Generate(request, metadata=keyed_app["metadata"] + (("authorization", f"Bearer {KEY_METERED}"),),
                                        timeout=120))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert complete(keyed_app, KEY_B).status_code == 200  # another tenant is not held back
    records = _wait_for_log(keyed_app["usage_log"], "metered", BUDGET_REQUESTS)
    assert len({r["replica"] for r in records}) == 2  # both ingress replicas took the tenant's requests
    assert sum_by_tenant(read_usage(keyed_app["usage_log"]))["metered"]["compute_units"] == BUDGET_REQUESTS * COST
    # and in Prometheus, per tenant (exported by the ledger through Ray's metrics agent)
    def metric(name: str, label: str) -> float:
        return metric_value(requests.get(keyed_app["metrics"], timeout=30).text, name, label)

    # each counter is exported on its own schedule (1 s): wait for each, not for one then read the other
    _eventually(lambda: metric("ray_pagoda_tenant_compute_units_total", 'tenant="metered"') == BUDGET_REQUESTS * COST)
    _eventually(lambda: metric("ray_pagoda_tenant_refusals_total", 'reason="quota",tenant="metered"') >= 2)


def _wait_for_log(path, tenant: str, count: int, request_id: str | None = None) -> list[dict]:
    """The tenant's records (of one request id, if given) once there are `count`: each request's
    end reaches the ledger just after its response."""
    from cluster.serve.usage_log import read_usage

    def records():
        found = read_usage(path) if path.exists() else []
        return [r for r in found if r["tenant"] == tenant and request_id in (None, r["request_id"])]

    _eventually(lambda: len(records()) >= count)
    assert len(records()) == count, records()
    return records()


def _eventually(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.2)


def test_a_per_request_cap_stops_generation_at_it(keyed_app):
    r = complete(keyed_app, KEY_CAPPED, max_tokens=16)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5  # (15 - 5 prompt units) / 2 per output token
    assert body["usage"]["compute_units"] == CAP == body["usage"]["compute_units_limit"]
    assert complete(keyed_app, KEY_CAPPED, max_tokens=2).json()["usage"] == {  # under the cap: not lowered
        "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0},
        "compute_units": 9.0}
    too_long = complete(keyed_app, KEY_CAPPED, prompt=list(range(1, 20)))
    assert too_long.status_code == 400 and "max_units_per_request is 15" in too_long.json()["error"]["message"]
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=64, ignore_eos=True))
    auth = keyed_app["metadata"] + (("authorization", f"Bearer {KEY_CAPPED}"),)
    responses = list(keyed_app["stub"].Generate(request, metadata=auth, timeout=120))
    last = responses[-1]
    assert last.finish_reason == "length" and last.compute_units_limit <= CAP
    assert last.compute_units == last.prompt_tokens + 2 * sum(len(m.token_ids) for m in responses) <= CAP


def test_a_tenant_sees_and_cancels_only_its_own_requests(keyed_app):
    import json
    import threading

    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "request_id": "job-1"}
    stream = http(keyed_app, "POST", "/v1/completions", KEY_A, json=body, stream=True)
    assert stream.status_code == 200
    lines = stream.iter_lines()
    first = json.loads(next(line for line in lines if line).removeprefix(b"data: "))
    assert first["id"] == "cmpl-job-1"
    # the same id is another request for another tenant, but the same tenant cannot reuse it yet
    assert complete(keyed_app, KEY_B, request_id="job-1").status_code == 200
    dup = complete(keyed_app, KEY_A, request_id="job-1")
    assert dup.status_code == 409 and dup.json()["error"]["param"] == "request_id"
    mine = http(keyed_app, "GET", "/v1/pagoda/requests", KEY_A).json()["data"]
    assert [r["id"] for r in mine] == ["job-1"]
    assert http(keyed_app, "GET", "/v1/pagoda/requests", KEY_B).json()["data"] == []
    r = http(keyed_app, "DELETE", "/v1/pagoda/requests/job-1", KEY_B)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(grpc.RpcError) as error:
        keyed_app["stub"].Cancel(pb.CancelRequest(request_id="job-1"),
                                 metadata=keyed_app["metadata"] + (("authorization", f"Bearer {KEY_B}"),), timeout=60)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    events = []
    reader = threading.Thread(target=lambda: events.extend(json.loads(line.removeprefix(b"data: "))
                                                           for line in lines if line and line != b"data: [DONE]"))
    reader.start()
    reader.join(timeout=2)
    assert reader.is_alive()  # B's cancel did nothing: A's request still streams
    assert http(keyed_app, "DELETE", "/v1/pagoda/requests/job-1", KEY_A).json() == {
        "id": "job-1", "object": "request", "cancelled": True}
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert events[-1]["error"]["type"] == "cancelled"
    assert len(events) < 400
    _eventually(lambda: http(keyed_app, "GET", "/v1/pagoda/requests", KEY_A).json()["data"] == [])
    [record] = _wait_for_log(keyed_app["usage_log"], "a", 1, request_id="job-1")
    assert record["outcome"] == "cancelled" and 0 < record["output_tokens"] < 400


def test_the_cli_sends_its_key(keyed_app):
    from click.testing import CliRunner

    from cluster.cli import main as cli

    runner = CliRunner()
    assert runner.invoke(cli, ["status", "--json", "--http", keyed_app["address"]]).exit_code == 1  # 401, said plainly
    mine = runner.invoke(cli, ["status", "--json", "--http", keyed_app["address"]], env={"PAGODA_API_KEY": KEY_A})
    assert mine.exit_code == 0, mine.output
    refused = runner.invoke(cli, ["status", "--http", keyed_app["address"], "--api-key", KEY_B])
    assert refused.exit_code == 1 and "403" in refused.output
