"""The benchmark's statistics, with exact expectations."""

import math

import numpy as np
import pytest

from cluster.bench.metrics import (
    RequestRecord,
    cross_talk,
    describe,
    parse_slo,
    percentile,
    summarize,
)
from cluster.bench.runner import arrival_gaps


def record(start, chunks, tokens=None, **kw) -> RequestRecord:
    return RequestRecord(start=start, chunk_times=list(chunks), output_tokens=len(chunks) if tokens is None else tokens, **kw)


@pytest.mark.parametrize("q", [0, 10, 25, 50, 90, 95, 99, 100])
def test_percentile_matches_numpys_linear_interpolation(q):
    values = [7.0, 1.0, 3.0, 10.0, 2.5, 4.0, 9.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-12)


def test_percentile_exact_values():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))


def test_ttft_tpot_itl_e2e_definitions():
    r = record(10.0, [10.5, 10.6, 10.8, 11.1])  # 4 tokens, one per chunk
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)  # excludes the first token
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    # Chunks carrying several tokens: TPOT counts tokens, ITL counts chunks.
    r = record(0.0, [1.0, 2.0], tokens=5)
    assert r.tpot == pytest.approx(0.25) and r.itls == pytest.approx([1.0])
    assert record(0.0, [1.0]).tpot is None  # one token: no TPOT


def test_summary_throughput_failures_and_goodput():
    records = [
        record(0.0, [0.1, 0.2, 0.3], prompt_tokens=10),  # TTFT 100 ms, TPOT 100 ms
        record(0.0, [0.4, 0.5, 0.6], prompt_tokens=10),  # TTFT 400 ms: misses ttft=300
        record(0.0, [0.1, 0.5, 0.9], prompt_tokens=10),  # TPOT 400 ms: misses tpot=200
        RequestRecord(start=0.0, error="http_429"),
        RequestRecord(start=0.0, error="http_429"),
        RequestRecord(start=0.0),  # no output at all
    ]
    s = summarize(records, duration_s=2.0, slo=parse_slo("ttft=300,tpot=200"))
    assert s["requests"] == 6 and s["completed"] == 3
    assert s["failures"] == {"http_429": 2, "empty_output": 1}
    assert s["output_tokens"] == 9 and s["prompt_tokens"] == 30
    assert s["output_throughput"] == 4.5 and s["total_token_throughput"] == 19.5
    assert s["request_throughput"] == 1.5
    assert s["ttft_ms"]["median"] == pytest.approx(100.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(200.0)
    assert s["goodput"] == 0.5  # one request of six met both SLOs, in 2 s
    assert s["slo_attainment"] == pytest.approx(1 / 6)


def test_describe_scales_and_names_percentiles():
    d = describe([0.001, 0.002, 0.003], scale=1000)
    assert d == pytest.approx({"mean": 2.0, "median": 2.0, "p90": 2.8, "p95": 2.9, "p99": 2.98})


@pytest.mark.parametrize("text", ["ttft", "ttft=", "speed=3", "ttft=fast"])
def test_bad_slo_is_a_clear_error(text):
    with pytest.raises(ValueError, match="ttft|could not convert"):
        parse_slo(text)


def test_cross_talk_probe_tells_a_wrong_answer_from_anothers_answer():
    probes = [
        record(0, [1], text=" 111111\n", expected=" 111111"),
        record(0, [1], text=" 222222\n", expected=" 333333"),  # another request's answer
        record(0, [1], text=" 999999\n", expected=" 222222"),  # simply wrong
        record(0, [1], text=" 333333", expected=" 444444"),  # 333333 is expected of probe 2
    ]
    result = cross_talk(probes)
    assert result["checked"] == 4 and result["mismatches"] == 3 and result["cross_talk"] == 2


def test_arrival_gaps():
    assert arrival_gaps(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    gaps = arrival_gaps(20000, 4.0, 1.0, seed=1)
    assert gaps == arrival_gaps(20000, 4.0, 1.0, seed=1)  # reproducible
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    bursty = arrival_gaps(20000, 4.0, 0.25, seed=1)
    assert np.mean(bursty) == pytest.approx(0.25, rel=0.05) and np.std(bursty) > 1.8 * np.std(gaps)
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0, 1.0, 0)
