"""The load ramp's shape and timeline, on a backend of the test's (no server)."""

import asyncio
import math

import pytest

from cluster.bench.metrics import RequestRecord
from cluster.bench.ramp import RampSpec, pagoda_state, run_ramp, timeline
from cluster.bench.workloads import BenchRequest


def test_the_ramp_rises_holds_and_falls():
    spec = RampSpec.parse("1:9:8", hold_s=4)
    assert spec.duration_s == 20
    assert [spec.users_at(t) for t in (0, 2, 4, 6, 8, 10, 12, 14, 16, 19.9)] == [1, 3, 5, 7, 9, 9, 9, 7, 5, 1]


def test_a_ramp_with_no_fall_stops_the_load_after_the_hold():
    spec = RampSpec.parse("1:8:10", hold_s=5, fall_s=0)
    assert spec.duration_s == 15
    assert [spec.users_at(t) for t in (0, 5, 10, 14.9)] == [1, 5, 8, 8]
    with pytest.raises(ValueError, match="fall"):
        RampSpec.parse("1:8:10", fall_s=-1)


@pytest.mark.parametrize("text", ["16:1:10", "1:16", "a:b:c", "0:4:10", "1:4:0"])
def test_bad_ramps_are_refused(text):
    with pytest.raises(ValueError, match="--ramp"):
        RampSpec.parse(text)


class CountingBackend:
    """Answers each request with 3 tokens after 50 ms, counting how many are in flight."""

    def __init__(self):
        self.in_flight = 0
        self.most = []

    async def generate(self, prompt, messages, max_tokens, record: RequestRecord):
        self.in_flight += 1
        self.most.append(self.in_flight)
        try:
            for _ in range(3):
                await asyncio.sleep(0.05 / 3)
                record.chunk_times.append(record.start + 0.05)
                record.output_tokens += 1
        finally:
            self.in_flight -= 1


def test_the_users_follow_the_ramp_and_the_timeline_counts_them():
    spec = RampSpec(1, 4, rise_s=1.0, window_s=0.5)
    backend = CountingBackend()
    requests = [BenchRequest(prompt=f"p{i}", messages=None, max_tokens=3) for i in range(5)]
    samples_taken = []

    def sample():
        samples_taken.append(backend.in_flight)
        return {"replicas": {"LLMServer": 1}, "nodes": 2, "waiting": 0}

    records, samples, as_run = asyncio.run(run_ramp(backend, requests, spec, sample, sample_every_s=0.25))
    assert as_run == spec
    assert max(backend.most) == 4 and all(r.ok for r in records) and len(samples) >= 4
    rows = timeline(records, samples, spec)
    assert [row["users"] for row in rows] == [spec.users_at(0.25), spec.users_at(0.75), spec.users_at(1.25), spec.users_at(1.75)]
    assert sum(row["started"] for row in rows) == len(records) and all(row["failed"] == 0 for row in rows)
    assert rows[-1]["replicas"] == {"LLMServer": 1} and rows[-1]["nodes"] == 2
    assert all(not math.isnan(row["ttft_p95_ms"]) for row in rows)


def test_pagoda_state_reads_the_status_report():
    status = {"deployments": {"Ingress": {"replicas": {"RUNNING": 1}}, "LLMServer": {"replicas": {"RUNNING": 2, "STARTING": 1}}},
              "groups": [{"stats": {"num_waiting": 3}}, {"stats": {"num_waiting": 4}}], "nodes": 3}
    assert pagoda_state(status) == {"replicas": {"Ingress": 1, "LLMServer": 2}, "nodes": 3, "waiting": 7}


def test_the_hold_waits_for_the_target_within_its_cap():
    """hold_until: the hold goes on past hold_s until the samples say so (here: the third one),
    and the ramp as run says how long it held; a target that never gets there stops at the cap."""
    backend = CountingBackend()
    requests = [BenchRequest(prompt="p", messages=None, max_tokens=3)]
    spec = RampSpec(2, 2, rise_s=0.2, hold_s=0.2, fall_s=0)
    count = iter(range(100))

    def sample():
        return {"replicas": {"LLMServer": 1 + (next(count) >= 6)}}

    def three_replicas_seen(samples):
        return any(s.get("replicas", {}).get("LLMServer") == 2 for s in samples)

    records, samples, as_run = asyncio.run(run_ramp(backend, requests, spec, sample, sample_every_s=0.1,
                                                    hold_until=three_replicas_seen, max_extra_hold_s=5))
    assert three_replicas_seen(samples) and 0.3 < as_run.hold_s < 1.5
    assert max(r.start for r in records) < as_run.duration_s + 0.1
    _, _, capped = asyncio.run(run_ramp(backend, requests, spec, lambda: {}, sample_every_s=0.1,
                                        hold_until=three_replicas_seen, max_extra_hold_s=0.3))
    assert 0.2 < capped.hold_s - spec.hold_s <= 0.3 + 1e-3  # the cap, less at most one look at the clock
