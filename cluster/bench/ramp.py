"""A load ramp and its timeline (`pagoda bench run --ramp LOW:HIGH:RISE`).

The offered load is a number of users (closed loop: each sends its next request when its last one
ends) that rises linearly from LOW to HIGH over RISE seconds, holds for HOLD seconds, then falls
back over FALL seconds (as long as the rise unless given; 0: the load stops at once). Meanwhile
the target's own view is sampled every few seconds (Pagoda's /v1/pagoda/status: replicas per deployment, Ray nodes, requests waiting in the engines). The
timeline, one row per window, puts them side by side: users, requests started and failed, TTFT and
TPOT percentiles of the requests that started in the window, replicas, nodes, queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import asdict, dataclass

from cluster.bench.metrics import RequestRecord, percentile
from cluster.bench.workloads import BenchRequest


@dataclass(frozen=True)
class RampSpec:
    low: int
    high: int
    rise_s: float
    hold_s: float = 0.0
    window_s: float = 10.0
    fall_s: float | None = None  # None: as long as the rise

    def __post_init__(self):
        if self.fall_s is None:
            object.__setattr__(self, "fall_s", self.rise_s)

    @classmethod
    def parse(cls, text: str, hold_s: float = 0.0, window_s: float = 10.0, fall_s: float | None = None) -> "RampSpec":
        """"1:16:120" -> from 1 to 16 users over 120 s (and back down over 120 s, or `fall_s`)."""
        try:
            low, high, rise = text.split(":")
            spec = cls(int(low), int(high), float(rise), hold_s, window_s, fall_s)
        except ValueError:
            raise ValueError(f"--ramp: expected LOW:HIGH:SECONDS (e.g. 1:16:120), got {text!r}") from None
        if not 1 <= spec.low <= spec.high or spec.rise_s <= 0 or spec.hold_s < 0 or spec.window_s <= 0:
            raise ValueError(f"--ramp: need 1 <= LOW <= HIGH and SECONDS > 0, got {text!r}")
        if spec.fall_s < 0:
            raise ValueError(f"the ramp's fall: expected SECONDS >= 0, got {fall_s}")
        return spec

    @property
    def duration_s(self) -> float:
        return self.rise_s + self.hold_s + self.fall_s

    def users_at(self, t: float) -> int:
        """Users active `t` seconds into the ramp."""
        if t < self.rise_s:
            share = t / self.rise_s
        elif t < self.rise_s + self.hold_s:
            share = 1.0
        elif self.fall_s > 0:
            share = max(0.0, 1 - (t - self.rise_s - self.hold_s) / self.fall_s)
        else:
            share = 0.0
        return self.low + round(share * (self.high - self.low))


class _RampClock:
    """Time into the ramp: wall time, except that at the end of the hold it stands still while
    `hold_until(samples)` is false, for at most `max_extra_hold_s` (then the ramp goes on)."""

    def __init__(self, spec: RampSpec, samples: list[dict], hold_until, max_extra_hold_s: float):
        self.start = time.perf_counter()
        self.hold_end = spec.rise_s + spec.hold_s
        self.samples, self.hold_until, self.max_extra_hold_s = samples, hold_until, max_extra_hold_s
        self.extra_hold_s = 0.0
        self.holding = hold_until is not None

    def now(self) -> float:
        t = time.perf_counter() - self.start - self.extra_hold_s
        # stands a hair before the hold's end: still in the hold, even for a ramp that ends there
        stand = self.hold_end - 1e-6
        if self.holding and t > stand:
            if self.hold_until(self.samples) or self.extra_hold_s + (t - stand) >= self.max_extra_hold_s:
                self.holding = False
            else:
                self.extra_hold_s += t - stand
                t = stand
        return t


async def run_ramp(backend, requests: list[BenchRequest], spec: RampSpec, sample=None, sample_every_s: float = 2.0,
                   hold_until=None, max_extra_hold_s: float = 0.0):
    """Drives the ramp; returns (records, samples, the ramp as run). `sample()` (blocking, run in
    a thread) returns the target's state as a dict; each sample gets its time `t` (seconds into the
    ramp). `hold_until(samples)`: the hold lasts until it is true (at least `spec.hold_s`, at most
    `max_extra_hold_s` more), e.g. until the replicas a test waits for serve, whatever the host's
    speed; the ramp as run has the hold it got."""
    records: list[RequestRecord] = []
    samples: list[dict] = []
    clock = _RampClock(spec, samples, hold_until, max_extra_hold_s)
    start = clock.start
    next_request = iter(range(10**9))

    async def user(i: int) -> None:
        while (t := clock.now()) < spec.duration_s:
            if i >= spec.users_at(t):
                await asyncio.sleep(0.2)
                continue
            request = requests[next(next_request) % len(requests)]
            record = RequestRecord(start=time.perf_counter())
            records.append(record)
            try:
                await backend.generate(request.prompt, request.messages, request.max_tokens, record)
            except Exception as e:  # noqa: BLE001 - a failed request is a result
                record.error = type(e).__name__

    async def sampler() -> None:
        while clock.now() < spec.duration_s:
            t = time.perf_counter() - start
            try:
                state = await asyncio.to_thread(sample)
            except Exception as e:  # noqa: BLE001 - a missed sample is a gap in the timeline
                state = {"error": type(e).__name__}
            samples.append({"t": t, **state})
            await asyncio.sleep(sample_every_s)

    tasks = [user(i) for i in range(spec.high)] + ([sampler()] if sample else [])
    await asyncio.gather(*tasks)
    for record in records:
        record.start -= start  # seconds into the ramp, like the samples
        record.chunk_times = [c - start for c in record.chunk_times]
    return records, samples, dataclasses.replace(spec, hold_s=spec.hold_s + clock.extra_hold_s)


def timeline(records: list[RequestRecord], samples: list[dict], spec: RampSpec) -> list[dict]:
    """One row per window: the load, what it got, and what the target looked like at its end."""
    rows = []
    for k in range(math.ceil(spec.duration_s / spec.window_s)):
        begin, end = k * spec.window_s, (k + 1) * spec.window_s
        started = [r for r in records if begin <= r.start < end]
        ok = [r for r in started if r.ok]
        seen = [s for s in samples if s["t"] < end and "error" not in s]
        state = seen[-1] if seen else {}
        rows.append({
            "t_s": end, "users": spec.users_at(begin + spec.window_s / 2), "started": len(started),
            "failed": len(started) - len(ok),
            "ttft_p50_ms": percentile([r.ttft * 1000 for r in ok], 50),
            "ttft_p95_ms": percentile([r.ttft * 1000 for r in ok], 95),
            "tpot_p50_ms": percentile([r.tpot * 1000 for r in ok if r.tpot is not None], 50),
            "tpot_p95_ms": percentile([r.tpot * 1000 for r in ok if r.tpot is not None], 95),
            "replicas": state.get("replicas", {}), "nodes": state.get("nodes"), "waiting": state.get("waiting"),
        })
    return rows


def pagoda_state(status: dict) -> dict:
    """What a ramp samples from Pagoda's /v1/pagoda/status: running replicas per deployment, Ray
    nodes, and requests waiting in every engine."""
    replicas = {name: d["replicas"].get("RUNNING", 0) for name, d in status.get("deployments", {}).items()}
    waiting = sum(g.get("stats", {}).get("num_waiting", 0) for g in status.get("groups", []))
    return {"replicas": replicas, "nodes": status.get("nodes"), "waiting": waiting}


def ramp_result(label: str, spec: RampSpec, records: list[RequestRecord], samples: list[dict]) -> dict:
    ttfts = [r.ttft * 1000 for r in records if r.ok]
    return {"label": label, "ramp": asdict(spec), "timeline": timeline(records, samples, spec),
            "ok": len(ttfts), "ttft_p50_ms": percentile(ttfts, 50), "ttft_p95_ms": percentile(ttfts, 95),
            "samples": samples, "records": [r.to_json() for r in records]}


def plot_timelines(results: list[dict], path) -> None:
    """Users, replicas and nodes over time (top), TTFT p95 (middle), queue (bottom), one line per result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_load, ax_ttft, ax_queue) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    first = results[0]["timeline"]
    ax_load.step([r["t_s"] for r in first], [r["users"] for r in first], where="pre", color="black", label="users")
    for result in results:
        samples = [s for s in result["samples"] if "error" not in s]
        for name in sorted({n for s in samples for n in s.get("replicas", {})}):
            if name == "Ingress":
                continue
            ax_load.step([s["t"] for s in samples], [s["replicas"].get(name, 0) for s in samples], where="post",
                         label=f"{result['label']}: {name} replicas")
        if any(s.get("nodes") is not None for s in samples):
            ax_load.step([s["t"] for s in samples], [s.get("nodes") or 0 for s in samples], where="post",
                         linestyle=":", label=f"{result['label']}: Ray nodes")
        rows = result["timeline"]
        ax_ttft.plot([r["t_s"] for r in rows], [r["ttft_p95_ms"] for r in rows], marker="o", label=result["label"])
        ax_queue.step([s["t"] for s in samples], [s.get("waiting") or 0 for s in samples], where="post",
                      label=result["label"])
    ax_load.set_ylabel("users / replicas / nodes")
    ax_ttft.set_ylabel("TTFT p95 (ms)")
    ax_ttft.set_yscale("log")
    ax_queue.set_ylabel("requests waiting")
    ax_queue.set_xlabel("seconds into the ramp")
    for ax in (ax_load, ax_ttft, ax_queue):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
