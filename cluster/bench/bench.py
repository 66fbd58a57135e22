"""One `pagoda bench run`: a workload against a target at one or more loads."""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import asdict, replace

from cluster.bench import report, runner, workloads
from cluster.bench.backends import make_backend
from cluster.bench.metrics import summarize


def run_bench(
    target: str,
    spec: workloads.WorkloadSpec,
    *,
    label: str | None = None,
    concurrencies: list[int | None] = (None,),
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    ignore_eos: bool = True,
    max_batch: int | None = None,
    slo: dict[str, float] | None = None,
    tokenizer_dir: str | None = None,
    warmup: int = 2,
    progress: bool = True,
    engine_options: dict | None = None,
    log=print,
) -> dict:
    """Runs the workload once per concurrency level (None: no cap, arrivals by request_rate) and
    returns the result file's dict. An in-process HF target batches up to the concurrency level
    unless max_batch is given; an in-process engine target takes engine_options."""
    tokenizer = _tokenizer(tokenizer_dir)
    # Warm-up prompts of their own, so that no measured request finds its prompt cached.
    warmup_requests = workloads.build(replace(spec, seed=spec.seed + 1_000_003), tokenizer)[:warmup]
    runs = []
    for index, concurrency in enumerate(concurrencies):
        requests = workloads.build(level_workload(spec, index), tokenizer)
        backend = make_backend(target, ignore_eos=ignore_eos, max_batch=max_batch or concurrency,
                               engine_options=engine_options)
        records, duration = asyncio.run(
            _run_once(backend, requests, warmup_requests, concurrency, request_rate, burstiness, spec.seed, progress))
        summary = summarize(records, duration, slo)
        runs.append({"concurrency": concurrency, "request_rate": None if math.isinf(request_rate) else request_rate,
                     "summary": summary, "records": [r.to_json() for r in records]})
        log(f"{label or target} c={concurrency}: {summary['completed']}/{summary['requests']} ok, "
            f"{summary['output_throughput']:.1f} out tok/s, TTFT p50 {summary['ttft_ms']['median']:.0f} ms, "
            f"TPOT p50 {summary['tpot_ms']['median']:.1f} ms")
    options = {**asdict(spec), "request_rate": request_rate if not math.isinf(request_rate) else None,
               "burstiness": burstiness, "ignore_eos": ignore_eos, "max_batch": max_batch,
               "slo_ms": {k: v * 1000 for k, v in (slo or {}).items()}}
    return report.result_file(label or target, target, options, runs)


def run_ramp_bench(target: str, spec: workloads.WorkloadSpec, ramp_spec, *, label: str | None = None,
                   status_url: str | None = None, ignore_eos: bool = True, tokenizer_dir: str | None = None,
                   warmup: int = 2, log=print) -> dict:
    """A load ramp against the target, sampling `status_url` (Pagoda's /v1/pagoda/status) as it
    goes; returns the ramp's result (timeline, samples, records)."""
    from cluster.bench import ramp

    tokenizer = _tokenizer(tokenizer_dir)
    requests = workloads.build(spec, tokenizer)
    warmup_requests = workloads.build(replace(spec, seed=spec.seed + 1_000_003), tokenizer)[:warmup]
    sample = None
    if status_url:
        import requests as http

        def sample():
            return ramp.pagoda_state(http.get(status_url, timeout=30).json())

    async def go():
        backend = make_backend(target, ignore_eos=ignore_eos)
        await backend.start()
        try:
            if warmup_requests:
                await runner.run(backend, warmup_requests, concurrency=1, progress=False)
            return await ramp.run_ramp(backend, requests, ramp_spec, sample)
        finally:
            await backend.close()

    records, samples, ramp_spec = asyncio.run(go())
    result = ramp.ramp_result(label or target, ramp_spec, records, samples)
    failed = sum(not r.ok for r in records)
    log(f"{label or target} ramp {ramp_spec.low}->{ramp_spec.high} users over {ramp_spec.rise_s:.0f} s: "
        f"{len(records) - failed}/{len(records)} ok")
    return result


def level_workload(spec: workloads.WorkloadSpec, index: int) -> workloads.WorkloadSpec:
    """The workload of a run's index-th concurrency level: prompts of its own (the first level keeps
    spec's seed), so that no level finds an earlier level's prompts in a server's prefix cache. With
    one seed for all, the first 64 prompts of a 64-stream level were the 32-stream level's, cached
    by Pagoda but not by peers restarted per level (docs/benchmarks-log.md)."""
    return replace(spec, seed=spec.seed + index)


def run_levels(label: str, levels: list[int], spec: workloads.WorkloadSpec, target_at, num_prompts_at=None, **options) -> dict:
    """One result with a run per concurrency level. `target_at(level)` is a context manager that
    yields the target for that level (a peer may be restarted per level, e.g. with as many slots as
    requests); `num_prompts_at(level)` sizes each level's workload (default: spec.num_prompts)."""
    runs = []
    for index, level in enumerate(levels):
        level_spec = level_workload(spec, index)
        if num_prompts_at:
            level_spec = replace(level_spec, num_prompts=num_prompts_at(level))
        with target_at(level) as target:
            result = run_bench(target, level_spec, label=label, concurrencies=[level], **options)
        runs += result["runs"]
    result["runs"] = runs
    return result


def already_running(target: str):
    """`target_at` for a target that is up for every level."""
    return lambda level: contextlib.nullcontext(target)


async def _run_once(backend, requests, warmup_requests, concurrency, request_rate, burstiness, seed, progress):
    await backend.start()
    try:
        if warmup_requests:  # first requests pay for lazy initialisation on every server; not measured
            await runner.run(backend, warmup_requests, concurrency=1, progress=False)
        return await runner.run(backend, requests, concurrency=concurrency, request_rate=request_rate,
                                burstiness=burstiness, seed=seed, progress=progress)
    finally:
        await backend.close()


def _tokenizer(tokenizer_dir: str | None):
    from transformers import AutoTokenizer

    from cluster.bench.backends import default_model

    return AutoTokenizer.from_pretrained(default_model(tokenizer_dir))
