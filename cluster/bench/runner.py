"""Drive a backend with a workload: fixed concurrency, or Poisson arrivals at a request rate.

A workload item is a conversation: one request, plus its follow-up turns for the chat workload,
each sent after the previous answer with the whole history. Concurrency counts conversations in
flight (users); every turn is its own RequestRecord.
"""

from __future__ import annotations

import asyncio
import math
import random
import time

from tqdm import tqdm

from cluster.bench.metrics import RequestRecord
from cluster.bench.workloads import BenchRequest


def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive arrivals: gamma-distributed with mean 1/rate (burstiness 1 is
    a Poisson process; below 1 burstier, above 1 more regular), all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1 / (request_rate * burstiness)) for _ in range(n)]


async def run(
    backend,
    requests: list[BenchRequest],
    *,
    concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Returns every turn's record and the wall time of the whole run."""
    limit = asyncio.Semaphore(concurrency or len(requests) or 1)
    bar = tqdm(total=sum(1 + len(r.follow_ups) for r in requests), disable=not progress, unit="req", leave=False)
    records: list[RequestRecord] = []

    async def conversation(request: BenchRequest) -> None:
        async with limit:
            messages = list(request.messages) if request.messages is not None else None
            answer = None
            for turn in [None, *request.follow_ups]:
                if turn is not None:
                    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": turn}]
                record = RequestRecord(start=time.perf_counter(), expected=request.expected)
                records.append(record)
                try:
                    await backend.generate(request.prompt, messages, request.max_tokens, record)
                except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
                    record.error = type(e).__name__
                bar.update()
                if not record.ok:
                    break  # a conversation cannot go on without its answer
                answer = record.text

    tasks = []
    start = time.perf_counter()
    for request, gap in zip(requests, arrival_gaps(len(requests), request_rate, burstiness, seed)):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(conversation(request)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return records, duration
