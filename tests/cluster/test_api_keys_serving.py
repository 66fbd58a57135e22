"""API keys over the real server (a Serve application of its own on the session's cluster, with a
keys file of two tenants): every route and method but health refuses a missing or wrong key with
401 / UNAUTHENTICATED, and one tenant's cached prompt gives the other no prefix-cache hit."""

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
    keys.write_text(f"tenants:\n  a: {{keys: [{KEY_A}]}}\n"
                    f"  b: {{keys: ['sha256:{hashlib.sha256(KEY_B.encode()).hexdigest()}']}}\n")
    with deployed({**server, "model_dir": model_dir}, "keyed", "/keyed", api_keys_file=str(keys)) as app:
        yield app


def http(app, method: str, path: str, key: str | None, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.request(method, f"{app['http']}{path}", headers=headers, timeout=120, **kwargs)


ROUTES = [("GET", "/v1/models", {}), ("GET", "/v1/pagoda/stats", {}), ("GET", "/v1/pagoda/status", {}),
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


def test_a_tenants_cached_prompt_is_no_hit_for_another(keyed_app):
    prompt = "Pagoda keeps each tenant's KV to itself. " * 12  # ~120 tokens: 7 full blocks

    def hit_tokens_after(key: str) -> int:
        r = http(keyed_app, "POST", "/v1/completions", key, json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200
        return http(keyed_app, "GET", "/v1/pagoda/stats", key).json()["prefix_cache_hit_tokens"]

    start = http(keyed_app, "GET", "/v1/pagoda/stats", KEY_A).json()["prefix_cache_hit_tokens"]
    first_a = hit_tokens_after(KEY_A)
    assert first_a == start
    first_b = hit_tokens_after(KEY_B)
    assert first_b == first_a  # B shares nothing with A
    again_a = hit_tokens_after(KEY_A)
    assert again_a - first_b >= 6 * 16  # A's own blocks
