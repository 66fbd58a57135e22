"""`pagoda bench` against the real server: its numbers agree with the server's own metrics, and
the cross-talk probe finds nothing at 64 concurrent requests (the server's queue is capped at
32 waiting + 16 running in the tests, so the probe runs through gRPC and HTTP at 32 each)."""

import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster.bench.bench import run_bench
from cluster.bench.workloads import WorkloadSpec


def scrape(server) -> dict[str, float]:
    """Sum of every sample of each Pagoda metric (the exporter reports one series per replica)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(requests.get(server["metrics"], timeout=10).text):
        for sample in family.samples:
            if sample.name.startswith("ray_pagoda_"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def settled(server, count_at_least: float = 0.0, timeout_s: float = 45.0) -> dict[str, float]:
    """Metrics once Ray's exporter has caught up: the TTFT count reached `count_at_least` and two
    scrapes 3 s apart agree."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        current = scrape(server)
        if current == previous and current.get("ray_pagoda_time_to_first_token_seconds_count", 0) >= count_at_least:
            return current
        assert time.monotonic() < deadline, "the metrics exporter did not settle"
        previous = current
        time.sleep(3)


def test_bench_numbers_agree_with_the_servers_own_metrics(server, model_dir):
    before = settled(server)
    n = 3
    result = run_bench(server["http"], WorkloadSpec("random", num_prompts=n, input_len=32, output_len=12),
                       concurrencies=[1], warmup=0, progress=False, tokenizer_dir=model_dir, log=lambda m: None)
    summary = result["runs"][0]["summary"]
    assert summary["completed"] == n and summary["output_tokens"] == n * 12
    after = settled(server, before.get("ray_pagoda_time_to_first_token_seconds_count", 0) + n)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta("ray_pagoda_time_to_first_token_seconds_count") == n
    assert delta("ray_pagoda_generation_tokens_total") == summary["output_tokens"]  # exact
    assert delta("ray_pagoda_prompt_tokens_total") == summary["prompt_tokens"]  # from the server's usage
    # The client's TTFT holds the server's (which starts when the LLMServer gets the request) plus
    # the proxy, ingress and tokenization, which are milliseconds on this path.
    server_ttft_ms = delta("ray_pagoda_time_to_first_token_seconds_sum") / n * 1000
    client_ttft_ms = summary["ttft_ms"]["mean"]
    assert server_ttft_ms <= client_ttft_ms < server_ttft_ms + 250, (client_ttft_ms, server_ttft_ms)


@pytest.mark.parametrize("target", ["grpc", "http"])
def test_cross_talk_probe_finds_no_mismatch(server, model_dir, target):
    address = f"grpc://{server['grpc']}" if target == "grpc" else server["http"]
    result = run_bench(address, WorkloadSpec("probe", num_prompts=32, seed=7), concurrencies=[32], warmup=0,
                       progress=False, tokenizer_dir=model_dir, log=lambda m: None)
    summary = result["runs"][0]["summary"]
    assert summary["completed"] == 32, summary["failures"]
    assert summary["probe"] == {"checked": 32, "mismatches": 0, "cross_talk": 0, "examples": []}
