"""Prometheus metrics of the engine, exported through Ray's metrics agent (each Ray node serves
them on its metrics export port), plus NVML GPU telemetry where a GPU and its driver exist.

Names carry the `pagoda_` prefix; Ray adds `ray_` in the export.
"""

from __future__ import annotations

import logging
import threading
import time

from ray.util import metrics

from cluster.engine.stats import EngineStats

logger = logging.getLogger("pagoda.metrics")

_LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]


class EngineMetrics:
    def __init__(self, model: str):
        tags = {"model": model}
        self.ttft = _histogram("pagoda_time_to_first_token_seconds", "Request arrival to its first token", tags)
        self.tpot = _histogram("pagoda_time_per_output_token_seconds", "Mean time per output token after the first", tags)
        self.itl = _histogram("pagoda_inter_token_latency_seconds", "Time between consecutive tokens of a request", tags)
        self.e2e = _histogram("pagoda_e2e_request_latency_seconds", "Request arrival to its last token", tags)
        self.running = _gauge("pagoda_num_requests_running", "Requests in the running batch", tags)
        self.waiting = _gauge("pagoda_num_requests_waiting", "Requests waiting for admission", tags)
        self.kv_used = _gauge("pagoda_kv_blocks_used", "KV blocks holding live requests", tags)
        self.kv_free = _gauge("pagoda_kv_blocks_free", "KV blocks free (cached or empty)", tags)
        self.prefix_hit_rate = _gauge("pagoda_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens", tags)
        self.preemptions = _Total(_counter("pagoda_num_preemptions_total", "Requests preempted for lack of KV blocks", tags))
        self.prompt_tokens = _counter("pagoda_prompt_tokens_total", "Prompt tokens admitted", tags)
        self.generation_tokens = _counter("pagoda_generation_tokens_total", "Tokens generated", tags)
        # The tiers below device memory (cache_service/offload.py), fed from its running totals.
        self.kv_spilled = _Total(_counter("pagoda_kv_spilled_blocks_total", "KV blocks written down to the lower tiers", tags))
        self.kv_restored = _Total(_counter("pagoda_kv_restored_blocks_total", "KV blocks restored from a lower tier",
                                           tags, ("tier",)))
        self.kv_bad_pages = _Total(_counter("pagoda_kv_bad_pages_total", "KV pages that failed their checks (quarantined)",
                                            tags, ("tier", "reason")))
        self.kv_prefetches = _Total(_counter("pagoda_kv_prefetches_total", "Prefetches that found pages, by outcome",
                                             tags, ("outcome",)))
        self.kv_tier_used = _gauge("pagoda_kv_tier_used_bytes", "Bytes held by a lower tier of this process", tags, ("tier",))

    def record_engine(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_free.set(stats.kv_blocks_free)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.preemptions.update(stats.num_preemptions)

    def record_tiers(self, offload) -> None:
        """From KVOffload's own counters (no calls to the cache service: this runs every step)."""
        stats = offload.stats
        self.kv_spilled.update(stats.spilled_blocks)
        for tier, count in stats.restored_from.items():
            self.kv_restored.update(count, {"tier": tier})
        prefetches = {"on_time": stats.prefetch_on_time, "late": stats.prefetch_late, "stale": stats.prefetch_stale}
        for outcome, count in prefetches.items():
            self.kv_prefetches.update(count, {"outcome": outcome})
        for tier in offload.tiers:
            for reason, count in tier.stats.bad_pages.items():
                self.kv_bad_pages.update(count, {"tier": tier.name, "reason": reason})
            if tier.used_bytes is not None:  # local tiers; the service's shards report in `pagoda status`
                self.kv_tier_used.set(tier.used_bytes, {"tier": tier.name})


class MediaMetrics:
    """Media of multimodal requests: items accepted (ingress), encoder latency and embedding-cache
    hits and misses (where the encoder runs: an engine, colocated, or an EncoderServer)."""

    def __init__(self, model: str):
        tags = {"model": model}
        self.items = _counter("pagoda_media_items_total", "Media items accepted, by modality", tags, ("modality",))
        self.encode_latency = _tagged(metrics.Histogram(
            "pagoda_encoder_latency_seconds", "Time to encode one media item (cache misses)",
            boundaries=_LATENCY_BUCKETS, tag_keys=("model", "modality", "placement")), tags)
        self.cache_hits = _Total(_counter("pagoda_encoder_cache_hits_total", "Media items found in the embedding cache",
                                          tags, ("placement",)))
        self.cache_misses = _Total(_counter("pagoda_encoder_cache_misses_total", "Media items encoded (not in the cache)",
                                            tags, ("placement",)))

    def record_items(self, items) -> None:
        for item in items:
            self.items.inc(1, {"modality": item.modality})

    def record_encoder(self, stats, placement: str) -> None:
        """From a CachingEncoder's EncoderStats (cluster/engine/embedding_cache.py)."""
        for modality, seconds in stats.take_latencies():
            self.encode_latency.observe(seconds, {"modality": modality, "placement": placement})
        self.cache_hits.update(stats.cache_hits, {"placement": placement})
        self.cache_misses.update(stats.cache_misses, {"placement": placement})


class TenantMetrics:
    """Per tenant (the TenantLedger's view, over every ingress replica); an open server's tenant
    is "-"."""

    def __init__(self):
        self.requests = _counter("pagoda_tenant_requests_total", "Requests that ended, by outcome", {}, ("tenant", "outcome"))
        self.refusals = _counter("pagoda_tenant_refusals_total", "Requests refused by a tenant's limits, by reason",
                                 {}, ("tenant", "reason"))
        self.units = _counter("pagoda_tenant_compute_units_total", "Compute units charged", {}, ("tenant",))
        self.tokens = _counter("pagoda_tenant_tokens_total", "Tokens of ended requests, by kind (prompt, cached, output)",
                               {}, ("tenant", "kind"))

    def refused(self, tenant: str, reason: str) -> None:
        self.refusals.inc(1, {"tenant": tenant or "-", "reason": reason})

    def finished(self, tenant: str, usage, units: float, outcome: str) -> None:
        tags = {"tenant": tenant or "-"}
        self.requests.inc(1, {**tags, "outcome": outcome})
        if units > 0:
            self.units.inc(units, tags)
        for kind, count in (("prompt", usage.prompt_tokens), ("cached", usage.cached_tokens), ("output", usage.output_tokens)):
            if count > 0:
                self.tokens.inc(count, {**tags, "kind": kind})


def start_gpu_telemetry(interval_s: float = 5.0) -> bool:
    """NVML utilization, memory, temperature and power per GPU in a daemon thread; False (and
    nothing started) where there is no GPU driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # NVMLError_LibraryNotFound and friends: no GPU here, stay silent
        return False
    if not handles:
        return False
    gauges = {
        name: metrics.Gauge(f"pagoda_gpu_{name}", description, tag_keys=("gpu",))
        for name, description in [
            ("utilization_percent", "GPU utilization"), ("memory_used_bytes", "GPU memory used"),
            ("temperature_celsius", "GPU temperature"), ("power_watts", "GPU power draw"),
        ]
    }

    def loop():
        while True:
            for i, handle in enumerate(handles):
                tags = {"gpu": str(i)}
                try:
                    gauges["utilization_percent"].set(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu, tags)
                    gauges["memory_used_bytes"].set(pynvml.nvmlDeviceGetMemoryInfo(handle).used, tags)
                    gauges["temperature_celsius"].set(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU), tags)
                    gauges["power_watts"].set(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000, tags)
                except Exception as e:  # a flaky reading must not kill the thread
                    logger.debug("NVML read failed: %s", e)
            time.sleep(interval_s)

    threading.Thread(target=loop, name="pagoda-nvml", daemon=True).start()
    return True


class _Total:
    """A Prometheus counter fed from a running total kept elsewhere: adds what is new, per tag set."""

    def __init__(self, counter):
        self.counter = counter
        self._seen: dict[tuple, float] = {}

    def update(self, total: float, tags: dict | None = None) -> None:
        key = tuple(sorted((tags or {}).items()))
        new = total - self._seen.get(key, 0)
        if new > 0:
            self.counter.inc(new, tags)
            self._seen[key] = total


def _histogram(name, description, tags):
    return _tagged(metrics.Histogram(name, description, boundaries=_LATENCY_BUCKETS, tag_keys=tuple(tags)), tags)


def _gauge(name, description, tags, extra_tags=()):
    return _tagged(metrics.Gauge(name, description, tag_keys=(*tags, *extra_tags)), tags)


def _counter(name, description, tags, extra_tags=()):
    return _tagged(metrics.Counter(name, description, tag_keys=(*tags, *extra_tags)), tags)


def _tagged(metric, tags):
    metric.set_default_tags(tags)
    return metric
