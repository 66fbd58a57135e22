"""Tenants on Ray (a Serve application of its own on the session's cluster, two Ingress replicas
sharing a TenantLedger deployment, a keys file of four tenants): a compute-unit budget runs out at
exactly its units across both replicas, as the usage log and Prometheus count them; refused keys
leave no traceback in the replicas' logs; the CLI sends its key; deleting the app does not wait
for the replicas' long polls of the ledger. Each route's and method's key check, KV per tenant,
cancelling only one's own and the per-request cap: tests/cluster/test_tenants_front.py."""

from __future__ import annotations

import time

import grpc
import pytest
import requests

from protos import inference_pb2 as pb
from tests.served_apps import deployed, metric_value, scrape_until
from tests.cluster.test_tenants_front import (BUDGET_REQUESTS, COST, KEY_A, KEY_B, KEY_METERED, PROMPT, WRONG,
                                              wait_for_log, write_keys_file)

pytestmark = pytest.mark.ray  # a Ray cluster or a served model: make test only


@pytest.fixture(scope="module")
def keyed_app(server, model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    keys = write_keys_file(folder)
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
    records = wait_for_log(keyed_app["usage_log"], "metered", BUDGET_REQUESTS)
    assert len({r["replica"] for r in records}) == 2  # both ingress replicas took the tenant's requests
    assert sum_by_tenant(read_usage(keyed_app["usage_log"]))["metered"]["compute_units"] == BUDGET_REQUESTS * COST
    # and in Prometheus, per tenant (exported by the ledger through Ray's metrics agent)
    # each counter is exported on its own schedule: wait for each, not for one then read the other
    scrape_until(keyed_app["metrics"], lambda text: [] if (
        metric_value(text, "ray_pagoda_tenant_compute_units_total", 'tenant="metered"') == BUDGET_REQUESTS * COST
        and metric_value(text, "ray_pagoda_tenant_refusals_total", 'reason="quota",tenant="metered"') >= 2)
        else ["tenant counters"])


def test_the_cli_sends_its_key(keyed_app):
    from click.testing import CliRunner

    from cluster.cli import main as cli

    runner = CliRunner()
    assert runner.invoke(cli, ["status", "--json", "--http", keyed_app["address"]]).exit_code == 1  # 401, said plainly
    mine = runner.invoke(cli, ["status", "--json", "--http", keyed_app["address"]], env={"PAGODA_API_KEY": KEY_A})
    assert mine.exit_code == 0, mine.output
    refused = runner.invoke(cli, ["status", "--http", keyed_app["address"], "--api-key", KEY_B])
    assert refused.exit_code == 1 and "403" in refused.output
