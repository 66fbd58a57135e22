"""Tenants at the serving front (the Ingress with its engine in this process, tests/in_process_ingress.py,
a keys file of four tenants): every route and method but health refuses a missing or wrong key
with 401 / UNAUTHENTICATED; KV is shared only within a tenant (and a client's cache_salt); a
tenant sees and cancels only its own requests; a per-request cap stops generation. Budgets, which
two Ingress replicas on Ray share, with the usage log and Prometheus: test_tenants_serving.py."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from cluster.serve.tenants import load_keys_file
from cluster.serve.usage_log import read_usage
from protos import inference_pb2 as pb
from tests.in_process_ingress import GrpcError, InProcessIngress

pytestmark = pytest.mark.ray  # a served model: make test only

KEY_A = "sk-team-a-0123456789"
KEY_B = "sk-team-b-9876543210"
KEY_METERED = "sk-metered-01234567"
KEY_CAPPED = "sk-capped-012345678"
WRONG = "sk-nobody-0000000000"
# prompt tokens cost 1 unit, output tokens 2; a request of PROMPT with max_tokens 4 costs 5 + 8
PROMPT, COST = [1, 2, 3, 4, 5], 13
BUDGET_REQUESTS = 8  # the metered tenant's budget: exactly this many such requests
CAP = 15  # the capped tenant's max_units_per_request: 5 prompt units + 5 output tokens


def write_keys_file(folder):
    """The four tenants, B's key kept as its SHA-256 only."""
    keys = folder / "tenants.yaml"
    keys.write_text(f"compute_units: {{prompt_token: 1, output_token: 2}}\n"
                    f"tenants:\n  a: {{keys: [{KEY_A}], admin: true}}\n"
                    f"  b: {{keys: ['sha256:{hashlib.sha256(KEY_B.encode()).hexdigest()}']}}\n"
                    f"  metered: {{keys: [{KEY_METERED}], budget: {{units: {BUDGET_REQUESTS * COST}, window_s: 3600}}}}\n"
                    f"  capped: {{keys: [{KEY_CAPPED}], max_units_per_request: {CAP}}}\n")
    return keys


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    client = InProcessIngress(model_dir, tenants=load_keys_file(write_keys_file(folder)),
                              usage_log=str(folder / "usage.jsonl"))
    client.usage_log = folder / "usage.jsonl"
    yield client
    client.close()


def http(keyed, method: str, path: str, key: str | None, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return keyed.http.request(method, path, headers=headers, **kwargs)


def complete(keyed, key: str, **body):
    return http(keyed, "POST", "/v1/completions", key, json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True,
                                                              "temperature": 0, **body})


# (method, path, body, the answer to a tenant's key)
ROUTES = [("GET", "/v1/models", {}, 200), ("GET", "/v1/pagoda/stats", {}, 200),
          ("POST", "/v1/completions", {"json": {"prompt": "Hi", "max_tokens": 1}}, 200),
          ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}}, 200),
          ("GET", "/v1/pagoda/requests", {}, 200), ("DELETE", "/v1/pagoda/requests/none-such", {}, 404)]


@pytest.mark.parametrize("method, path, kwargs, answer", ROUTES, ids=[f"{r[0]} {r[1]}" for r in ROUTES])
def test_every_http_route_needs_a_tenants_key(keyed, method, path, kwargs, answer):
    for key in (None, WRONG):
        r = http(keyed, method, path, key, **kwargs)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", r.text
        assert r.json()["error"]["type"] == "authentication_error"
    r = keyed.http.request(method, path, headers={"Authorization": f"Basic {KEY_A}"}, **kwargs)
    assert r.status_code == 401
    for key in (KEY_A, KEY_B):
        assert http(keyed, method, path, key, **kwargs).status_code == answer


def test_status_needs_an_admins_key(keyed):
    """An admin's key passes the check (what `pagoda status` then asks of Serve's controller
    needs Ray: the CLI test in test_tenants_serving.py); another tenant's is 403."""
    r = http(keyed, "GET", "/v1/pagoda/status", KEY_B)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert http(keyed, "GET", "/v1/pagoda/status", None).status_code == 401


def test_health_needs_no_key(keyed):
    assert http(keyed, "GET", "/health", None).status_code == 200
    assert keyed.grpc("Health", pb.HealthRequest()).healthy
    check = keyed.grpc("Check", health_pb2.HealthCheckRequest())
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_methods_need_a_tenants_key(keyed):
    calls = [("Generate", pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=2, temperature=0))),
             ("GetModelInfo", pb.GetModelInfoRequest()), ("ListRequests", pb.ListRequestsRequest())]
    for method, request in calls:
        for authorization in (None, f"Bearer {WRONG}", KEY_A):
            with pytest.raises(GrpcError) as error:
                keyed.grpc(method, request, authorization)
            assert error.value.code == grpc.StatusCode.UNAUTHENTICATED, error.value.details
        keyed.grpc(method, request, f"Bearer {KEY_B}")
    with pytest.raises(GrpcError) as refused:
        keyed.grpc("Cancel", pb.CancelRequest(request_id="none-such"))
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_kv_is_shared_within_a_tenant_and_a_cache_salt_only(keyed):
    """Cache hits as OpenAI reports them (usage.prompt_tokens_details.cached_tokens) and as gRPC
    does (cached_tokens): A's document is no hit for B, nor for A with another cache_salt."""
    prompt = "Pagoda keeps each tenant's KV to itself. " * 12  # ~120 tokens: 7 full blocks

    def cached(key: str, **extra) -> int:
        r = http(keyed, "POST", "/v1/completions", key, json={"prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(KEY_A) == 0
    assert cached(KEY_B) == 0  # B shares nothing with A
    assert cached(KEY_A, cache_salt="mine") == 0
    hit = cached(KEY_A)
    assert hit >= 6 * 16 and hit % 16 == 0  # A's own full blocks
    assert cached(KEY_A, cache_salt="mine") == hit
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=1, temperature=0))
    [response] = keyed.grpc("Generate", request, f"Bearer {KEY_B}")
    assert response.cached_tokens == hit and response.prompt_tokens > hit


def test_a_per_request_cap_stops_generation_at_it(keyed):
    r = complete(keyed, KEY_CAPPED, max_tokens=16)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5  # (15 - 5 prompt units) / 2 per output token
    assert body["usage"]["compute_units"] == CAP == body["usage"]["compute_units_limit"]
    assert complete(keyed, KEY_CAPPED, max_tokens=2).json()["usage"] == {  # under the cap: not lowered
        "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0},
        "compute_units": 9.0}
    too_long = complete(keyed, KEY_CAPPED, prompt=list(range(1, 20)))
    assert too_long.status_code == 400 and "max_units_per_request is 15" in too_long.json()["error"]["message"]
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=64, ignore_eos=True))
    responses = keyed.grpc("Generate", request, f"Bearer {KEY_CAPPED}")
    last = responses[-1]
    assert last.finish_reason == "length" and last.compute_units_limit <= CAP
    assert last.compute_units == last.prompt_tokens + 2 * sum(len(m.token_ids) for m in responses) <= CAP


def test_a_tenant_sees_and_cancels_only_its_own_requests(keyed):
    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "request_id": "job-1"}
    with keyed.http.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {KEY_A}"}, json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        first = json.loads(next(line for line in lines if line).removeprefix("data: "))
        assert first["id"] == "cmpl-job-1"
        # the same id is another request for another tenant, but the same tenant cannot reuse it yet
        assert complete(keyed, KEY_B, request_id="job-1").status_code == 200
        dup = complete(keyed, KEY_A, request_id="job-1")
        assert dup.status_code == 409 and dup.json()["error"]["param"] == "request_id"
        mine = http(keyed, "GET", "/v1/pagoda/requests", KEY_A).json()["data"]
        assert [r["id"] for r in mine] == ["job-1"]
        assert http(keyed, "GET", "/v1/pagoda/requests", KEY_B).json()["data"] == []
        r = http(keyed, "DELETE", "/v1/pagoda/requests/job-1", KEY_B)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        with pytest.raises(GrpcError) as error:
            keyed.grpc("Cancel", pb.CancelRequest(request_id="job-1"), f"Bearer {KEY_B}")
        assert error.value.code == grpc.StatusCode.NOT_FOUND
        events = []
        reader = threading.Thread(target=lambda: events.extend(json.loads(line.removeprefix("data: "))
                                                               for line in lines if line and line != "data: [DONE]"))
        reader.start()
        reader.join(timeout=2)
        assert reader.is_alive()  # B's cancel did nothing: A's request still streams
        assert http(keyed, "DELETE", "/v1/pagoda/requests/job-1", KEY_A).json() == {
            "id": "job-1", "object": "request", "cancelled": True}
        reader.join(timeout=60)
        assert not reader.is_alive()
    assert events[-1]["error"]["type"] == "cancelled"
    assert len(events) < 400
    eventually(lambda: http(keyed, "GET", "/v1/pagoda/requests", KEY_A).json()["data"] == [])
    [record] = wait_for_log(keyed.usage_log, "a", 1, request_id="job-1")
    assert record["outcome"] == "cancelled" and 0 < record["output_tokens"] < 400


def wait_for_log(path, tenant: str, count: int, request_id: str | None = None) -> list[dict]:
    """The tenant's records (of one request id, if given) once there are `count`: each request's
    end reaches the ledger just after its response."""

    def records():
        found = read_usage(path) if path.exists() else []
        return [r for r in found if r["tenant"] == tenant and request_id in (None, r["request_id"])]

    eventually(lambda: len(records()) >= count)
    assert len(records()) == count, records()
    return records()


def eventually(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.2)
