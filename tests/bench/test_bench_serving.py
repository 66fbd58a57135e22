"""`pagoda bench` against the real server: its numbers agree with the server's own metrics, and
the cross-talk probe finds nothing at 64 concurrent requests (the server's queue is capped at
32 waiting + 16 running in the tests, so the probe runs through gRPC and HTTP at 32 each)."""

import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster.bench.bench import run_bench
from cluster.bench.workloads import WorkloadSpec
from tests.conftest import METRICS_EXPORT_S


def scrape(server) -> dict[str, float]:
    """Each Pagoda metric summed over its series (one per replica); histogram buckets are keyed
    "name{le}"."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(requests.get(server["metrics"], timeout=10).text):
        for sample in family.samples:
            if sample.name.startswith("ray_pagoda_"):
                key = sample.name + (f"{{{sample.labels['le']}}}" if "le" in sample.labels else "")
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def settled(server, at_least: dict[str, float] | None = None, timeout_s: float = 45.0) -> dict[str, float]:
    """Metrics once Ray's exporter has caught up: each metric of `at_least` reached its value and
    two scrapes agree that lie further apart than one export (so every process exported between)."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        current = scrape(server)
        if current == previous and all(current.get(k, 0) >= v for k, v in (at_least or {}).items()):
            return current
        assert time.monotonic() < deadline, "the metrics exporter did not settle"
        previous = current
        time.sleep(METRICS_EXPORT_S + 2)


def test_bench_numbers_agree_with_the_servers_own_metrics(server, model_dir):
    before = settled(server)
    n = 3
    result = run_bench(server["http"], WorkloadSpec("random", num_prompts=n, input_len=32, output_len=12),
                       concurrencies=[1], warmup=0, progress=False, tokenizer_dir=model_dir, log=lambda m: None)
    summary = result["runs"][0]["summary"]
    assert summary["completed"] == n and summary["output_tokens"] == n * 12
    after = settled(server, {
        "ray_pagoda_time_to_first_token_seconds_count": before.get("ray_pagoda_time_to_first_token_seconds_count", 0) + n,
        "ray_pagoda_generation_tokens_total": before.get("ray_pagoda_generation_tokens_total", 0) + n * 12,
    })

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta("ray_pagoda_time_to_first_token_seconds_count") == n
    assert delta("ray_pagoda_generation_tokens_total") == summary["output_tokens"]  # exact
    assert delta("ray_pagoda_prompt_tokens_total") == summary["prompt_tokens"]  # from the server's usage
    # The client's TTFT holds the server's (which starts when the LLMServer gets the request) plus
    # the proxy, ingress and tokenization: milliseconds. Ray exports histograms as bucket counts
    # (its _sum is made of bucket midpoints), so compare request by request, sorted: the k-th
    # client TTFT lies at or above the lower edge of the k-th server bucket and at most 1 s above
    # its upper edge (generous: the serving path takes milliseconds on an idle host, more on a busy one).
    bucket = "ray_pagoda_time_to_first_token_seconds_bucket{"
    edges = sorted((float(key[len(bucket):-1]), key) for key in after if key.startswith(bucket))
    server_buckets = []  # (lower, upper) edge of each of the n requests' server TTFT
    lower, below = 0.0, 0.0
    for upper, key in edges:  # cumulative counts
        server_buckets += [(lower, upper)] * int(delta(key) - below)
        lower, below = upper, delta(key)
    client = sorted(r["chunk_times"][0] - r["start"] for r in result["runs"][0]["records"])
    assert len(server_buckets) == n
    for (lower, upper), seconds in zip(server_buckets, client):
        assert lower <= seconds <= upper + 1.0, (server_buckets, client)


@pytest.mark.parametrize("target", ["grpc", "http"])
def test_cross_talk_probe_finds_no_mismatch(server, model_dir, target):
    address = f"grpc://{server['grpc']}" if target == "grpc" else server["http"]
    result = run_bench(address, WorkloadSpec("probe", num_prompts=32, seed=7), concurrencies=[32], warmup=0,
                       progress=False, tokenizer_dir=model_dir, log=lambda m: None)
    summary = result["runs"][0]["summary"]
    assert summary["completed"] == 32, summary["failures"]
    assert summary["probe"] == {"checked": 32, "mismatches": 0, "cross_talk": 0, "examples": []}


@pytest.mark.parametrize("target", ["engine", "hf"])
def test_in_process_targets_answer_the_probe_with_exact_token_counts(model_dir, target):
    """The in-process peers: Pagoda's LLMServer without Ray, and HF static batches of 4."""
    result = run_bench(f"{target}:{model_dir}", WorkloadSpec("probe", num_prompts=8, seed=3), concurrencies=[8],
                       max_batch=4, warmup=0, progress=False, tokenizer_dir=model_dir, log=lambda m: None)
    summary = result["runs"][0]["summary"]
    assert summary["completed"] == 8 and summary["output_tokens"] == 8 * 8  # ignore_eos: exactly max_tokens
    assert summary["probe"]["mismatches"] == 0
    records = result["runs"][0]["records"]
    assert all(len(r["chunk_times"]) == 8 for r in records)  # one token a step on both
