"""What one benchmark request measured, and the run's statistics.

Definitions (as `vllm bench serve` and genai-perf use them):
    TTFT  send -> first output token
    TPOT  (E2E - TTFT) / (output tokens - 1): the time per token after the first; requests with a
          single output token have none
    ITL   the gaps between consecutive output chunks (a chunk may carry several tokens)
    E2E   send -> last output token
Goodput: requests per second that finished without error and met every SLO given.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

PERCENTILES = (90, 95, 99)  # plus the median


@dataclass
class RequestRecord:
    start: float  # perf_counter seconds when the request was sent
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with output
    error: str | None = None  # a short kind: "http_429", "grpc_RESOURCE_EXHAUSTED", "timeout", ...
    text: str = ""
    expected: str | None = None  # for the cross-talk probe: the text the answer must start with

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0 and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_json(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe(values: list[float], scale: float = 1.0) -> dict:
    """mean, median and the PERCENTILES of `values` times `scale` (e.g. 1000 for ms)."""
    values = [v * scale for v in values]
    out = {"mean": sum(values) / len(values) if values else math.nan, "median": percentile(values, 50)}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """"ttft=500,tpot=50" (milliseconds) -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"--slo: expected name=milliseconds with name in ttft, tpot, e2e; got {part!r}")
        slo[name] = float(value) / 1000
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    if not record.ok:
        return False
    for name, limit in slo.items():
        value = getattr(record, name)
        if value is not None and value > limit:
            return False
    return True


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> dict:
    """The run's aggregate: latency statistics in milliseconds, throughput per second, failures by
    kind, goodput under `slo` (seconds, as parse_slo returns)."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "requests": len(records),
        "completed": len(ok),
        "failures": dict(Counter(r.error or "empty_output" for r in records if not r.ok)),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "ttft_ms": describe([r.ttft for r in ok], 1000),
        "tpot_ms": describe([r.tpot for r in ok if r.tpot is not None], 1000),
        "itl_ms": describe([gap for r in ok for gap in r.itls], 1000),
        "e2e_ms": describe([r.e2e for r in ok], 1000),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        summary["slo_ms"] = {name: limit * 1000 for name, limit in slo.items()}
        summary["goodput"] = good / duration_s
        summary["slo_attainment"] = good / len(records) if records else math.nan
    probes = [r for r in records if r.expected is not None]
    if probes:
        summary["probe"] = cross_talk(probes)
    return summary


def cross_talk(probes: list[RequestRecord]) -> dict:
    """Each probe's answer must start with its own expected text. A wrong answer that starts with
    another probe's expected text is cross-talk (one request got another's tokens)."""
    expected = {r.expected for r in probes}
    wrong = [r for r in probes if r.ok and not r.text.startswith(r.expected)]
    crossed = [r for r in wrong if any(r.text.startswith(e) for e in expected - {r.expected})]
    return {"checked": sum(r.ok for r in probes), "mismatches": len(wrong), "cross_talk": len(crossed),
            "examples": [{"expected": r.expected, "got": r.text[:40]} for r in wrong[:5]]}
