"""The load generator's own behaviour, with a stand-in backend (the real targets are exercised in
tests/bench/test_bench_serving.py)."""

import asyncio
import time

from cluster.bench.runner import run
from cluster.bench.workloads import BenchRequest


class RecordingBackend:
    def __init__(self, fail_on: str | None = None):
        self.in_flight = 0
        self.max_in_flight = 0
        self.calls = []
        self.fail_on = fail_on

    async def generate(self, prompt, messages, max_tokens, record):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.calls.append((prompt, [dict(m) for m in messages] if messages else None))
        try:
            await asyncio.sleep(0.01)
            if self.fail_on and messages and self.fail_on in messages[-1]["content"]:
                raise ConnectionResetError("server went away")
            record.chunk_times = [time.perf_counter()]
            record.output_tokens = 1
            record.text = f"answer {len(self.calls)}"
        finally:
            self.in_flight -= 1


def test_concurrency_caps_requests_in_flight():
    backend = RecordingBackend()
    records, duration = asyncio.run(run(backend, [BenchRequest(prompt=f"p{i}") for i in range(20)], concurrency=3, progress=False))
    assert len(records) == 20 and all(r.ok for r in records)
    assert backend.max_in_flight == 3
    assert duration >= 0.06  # 20 requests, 3 at a time, 10 ms each: at least 7 rounds


def test_chat_follow_ups_carry_the_history_with_the_answers():
    backend = RecordingBackend()
    request = BenchRequest(messages=[{"role": "user", "content": "hi"}], follow_ups=["more", "why"])
    records, _ = asyncio.run(run(backend, [request], progress=False))
    assert len(records) == 3
    assert [len(messages) for _, messages in backend.calls] == [1, 3, 5]
    last = backend.calls[-1][1]
    assert [m["role"] for m in last] == ["user", "assistant", "user", "assistant", "user"]
    assert last[1]["content"] == "answer 1" and last[3]["content"] == "answer 2" and last[4]["content"] == "why"
    assert request.messages == [{"role": "user", "content": "hi"}]  # the workload is not mutated


def test_a_failed_request_is_a_result_and_ends_its_conversation():
    backend = RecordingBackend(fail_on="more")
    requests = [BenchRequest(messages=[{"role": "user", "content": "hi"}], follow_ups=["more", "why"]),
                BenchRequest(prompt="plain")]
    records, _ = asyncio.run(run(backend, requests, progress=False))
    assert len(records) == 3  # hi, more (failed), plain; "why" is never sent
    assert sorted(r.error or "" for r in records) == ["", "", "ConnectionResetError"]
