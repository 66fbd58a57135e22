"""API keys over the real server (a Serve application of its own on the session's cluster, with a
keys file of two tenants): every route and method but health refuses a missing or wrong key with
401 / UNAUTHENTICATED, and KV is shared only within a tenant (and a client's cache_salt)."""

from __future__ import annotations

import hashlib

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import inference_pb2 as pb
from tests.cluster.test_disaggregated_serving import deployed

KEY_A = "sk-team-a-0123456789"
KEY_B = "sk-team-b-9876543210"
WRONG = "sk-nobody-0000000000"


@pytest.fixture(scope="module")
def keyed_app(server, model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "tenants.yaml"
    keys.write_text(f"tenants:\n  a: {{keys: [{KEY_A}], admin: true}}\n"
                    f"  b: {{keys: ['sha256:{hashlib.sha256(KEY_B.encode()).hexdigest()}']}}\n")
    with deployed({**server, "model_dir": model_dir}, "keyed", "/keyed", api_keys_file=str(keys)) as app:
        yield app


def http(app, method: str, path: str, key: str | None, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.request(method, f"{app['http']}{path}", headers=headers, timeout=120, **kwargs)


ROUTES = [("GET", "/v1/models", {}), ("GET", "/v1/pagoda/stats", {}),
          ("POST", "/v1/completions", {"json": {"prompt": "Hi", "max_tokens": 1}}),
          ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}})]


@pytest.mark.parametrize("method, path, kwargs", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_http_route_needs_a_tenants_key(keyed_app, method, path, kwargs):
    for key in (None, WRONG):
        r = http(keyed_app, method, path, key, **kwargs)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", r.text
        assert r.json()["error"]["type"] == "authentication_error"
    r = requests.request(method, f"{keyed_app['http']}{path}", headers={"Authorization": f"Basic {KEY_A}"},
                         timeout=120, **kwargs)
    assert r.status_code == 401
    for key in (KEY_A, KEY_B):
        assert http(keyed_app, method, path, key, **kwargs).status_code == 200


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
             lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=120)]
    for call in calls:
        for auth in ((), (("authorization", f"Bearer {WRONG}"),), (("authorization", KEY_A),)):
            with pytest.raises(grpc.RpcError) as error:
                call(keyed_app["metadata"] + auth)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, error.value.details()
        assert call(keyed_app["metadata"] + (("authorization", f"Bearer {KEY_B}"),))


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
