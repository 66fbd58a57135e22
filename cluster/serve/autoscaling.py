"""LLM-aware replica autoscaling: a Ray Serve autoscaling policy fed by each engine's own signals.

Serve's default policy scales on ongoing requests per replica. An LLM replica's cost is not its
request count: four requests with long prompts can fill its KV cache while sixty short ones fit, and
a replica is saturated exactly when requests start waiting for admission. So each LLMServer replica
reports what its engine knows (`LLMServer.record_autoscaling_stats`; Serve calls it on the replica
and keeps each value per replica over `look_back_period_s`), and this policy, named in the
deployment's `autoscaling_config.policy`, turns those into a replica count:

    decode / colocated   sequences (running + waiting) against target_num_seqs per replica,
                         KV blocks in use against target_kv_usage, TTFT p95 against ttft_slo_s
    prefill              tokens still to prefill against target_tokens_to_prefill per replica,
                         TTFT p95 against ttft_slo_s

The busiest signal is the pressure (1.0 = every replica at its target); the policy asks for the
replicas that bring it back to 1. It asks for fewer only when one replica fewer would still run at
no more than `scale_down_below` of target, so a load near a boundary does not flap. Serve then
applies its own upscale/downscale delays, scaling factors and min/max bounds to the answer.

Each decision and its reason go to Ray's internal KV store, where `pagoda status` reads them.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from cluster.engine.stats import EngineStats

POLICY_FUNCTION = "cluster.serve.autoscaling:LLMAutoscalingPolicy"
# What Pagoda starts from when a server deployment autoscales (the config's keys win):
# - look_back_period_s 15: the signals are already queue lengths, not rates; 15 s of them is enough
#   (Serve wants it longer than a replica's 10 s between reports).
# - upscale_delay_s 5: a queue that has lasted look_back + 5 s is real; a new replica takes longer
#   than that to load the model, so waiting longer only makes the wait longer.
# - downscale_delay_s 120: a replica that goes takes its device prefix cache with it (down to the
#   tiers); dropping it in a lull between bursts would cost more than the replica saves.
SERVER_AUTOSCALING_DEFAULTS = {"look_back_period_s": 15.0, "upscale_delay_s": 5.0, "downscale_delay_s": 120.0}
KV_NAMESPACE = "pagoda"

# What each replica reports (the names of Serve's custom autoscaling metrics).
NUM_SEQS = "num_seqs"
KV_USAGE = "kv_usage"
TOKENS_TO_PREFILL = "num_tokens_to_prefill"
TTFT_P95 = "ttft_p95_s"


def replica_signals(stats: EngineStats, num_unadmitted: int, ttft_p95_s: float) -> dict[str, float]:
    """One replica's report: its engine's latest stats, the requests handed to the engine thread
    that it has not taken yet, and the recent TTFT p95."""
    return {NUM_SEQS: stats.num_running + stats.num_waiting + num_unadmitted, KV_USAGE: stats.kv_usage,
            TOKENS_TO_PREFILL: stats.num_tokens_to_prefill, TTFT_P95: ttft_p95_s}


class RecentPercentile:
    """A percentile over the values of the last `window_s` seconds (one writer thread, any reader)."""

    def __init__(self, window_s: float = 30.0, max_values: int = 1024, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._values: deque[tuple[float, float]] = deque(maxlen=max_values)

    def add(self, value: float) -> None:
        self._values.append((self.clock(), value))

    def percentile(self, q: float) -> float:
        """The q-th percentile (nearest rank) of the recent values; 0.0 when there are none."""
        since = self.clock() - self.window_s
        recent = sorted(v for t, v in list(self._values) if t >= since)
        if not recent:
            return 0.0
        return recent[min(len(recent) - 1, math.ceil(q / 100 * len(recent)) - 1)]


@dataclass(frozen=True)
class Decision:
    num_replicas: int  # what the policy asks Serve for (before Serve's delays)
    reason: str
    pressure: float  # the busiest signal against its target; 1.0 = at target
    signals: dict[str, float] = field(default_factory=dict)  # each signal's pressure


@dataclass
class LLMAutoscalingPolicy:
    """The policy class Serve instantiates once per deployment with `policy_kwargs`, then calls on
    every control-loop tick with an AutoscalingContext."""

    role: str = "decode"  # "decode" (also colocated) or "prefill"
    target_num_seqs: float = 48.0  # per replica: running + waiting sequences
    target_kv_usage: float = 0.8  # fraction of device KV blocks held by requests
    target_tokens_to_prefill: float = 2048.0  # per replica (prefill role)
    ttft_slo_s: float | None = None  # None: TTFT is not a signal
    scale_down_below: float = 0.7  # fewer replicas only if they would run at most this much of target
    publish: Callable[[str, dict], None] | None = None  # where decisions go (default: Ray's internal KV)

    def __post_init__(self):
        if self.role not in ("decode", "prefill"):
            raise ValueError(f"role must be 'decode' or 'prefill', got {self.role!r}")
        if not 0 < self.scale_down_below < 1:
            raise ValueError(f"scale_down_below must be in (0, 1), got {self.scale_down_below}")
        self._published: tuple | None = None
        self._published_at = 0.0

    def __call__(self, ctx) -> tuple[int, dict]:
        running = set(ctx.running_replicas)
        per_replica = {name: [v for replica, v in values.items() if replica in running]
                       for name, values in (ctx.aggregated_metrics or {}).items()}
        decision = self.decide(ctx.current_num_replicas, ctx.target_num_replicas, per_replica,
                               ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas)
        self._record(ctx, decision)
        return decision.num_replicas, {}

    def decide(self, current: int, target: int, per_replica: dict[str, list[float]],
               min_replicas: int, max_replicas: int) -> Decision:
        """The replica count for signals reported by the `current` running replicas (each name ->
        one value per replica that reported it), while Serve's target is `target`."""
        signals = self.pressures(current, per_replica)
        if current == 0 or not signals:
            return Decision(target, "no signals from running replicas yet: holding", 0.0, signals)
        name, pressure = max(signals.items(), key=lambda item: item[1])
        demand = pressure * current  # replicas the load needs, each at its target
        if pressure > 1 and current < target:
            wanted, why = target, "replicas are still starting: holding until they serve"
        elif pressure > 1:
            wanted, why = math.ceil(demand), "above target"
        elif demand <= (current - 1) * self.scale_down_below:
            wanted, why = math.ceil(demand / self.scale_down_below), "fewer replicas would stay below target"
        else:
            wanted, why = current, "within target"
        bounded = min(max(wanted, min_replicas), max_replicas)
        if bounded != wanted:
            why += f" (bounded by min {min_replicas} / max {max_replicas})"
        return Decision(bounded, f"{name} at {pressure:.2f}x target: {why}", pressure, signals)

    def pressures(self, current: int, per_replica: dict[str, list[float]]) -> dict[str, float]:
        """Each signal's load against its target: totals spread over the running replicas, usage
        and latency averaged over the replicas that reported."""
        def total(name):
            return sum(per_replica[name]) / current if per_replica.get(name) else None

        def mean(name):
            values = per_replica.get(name)
            return sum(values) / len(values) if values else None

        if self.role == "prefill":
            loads = {TOKENS_TO_PREFILL: (total(TOKENS_TO_PREFILL), self.target_tokens_to_prefill)}
        else:
            loads = {NUM_SEQS: (total(NUM_SEQS), self.target_num_seqs),
                     KV_USAGE: (mean(KV_USAGE), self.target_kv_usage)}
        if self.ttft_slo_s:
            loads[TTFT_P95] = (mean(TTFT_P95), self.ttft_slo_s)
        return {name: value / goal for name, (value, goal) in loads.items() if value is not None and current}

    def _record(self, ctx, decision: Decision) -> None:
        """Publishes a decision when it changes (and every 10 s), for `pagoda status`."""
        key = (decision.num_replicas, decision.reason.split(" at ")[0], ctx.current_num_replicas, ctx.target_num_replicas)
        now = time.time()
        if key == self._published and now - self._published_at < 10:
            return
        self._published, self._published_at = key, now
        record = {"time": now, "current_replicas": ctx.current_num_replicas,
                  "target_replicas": ctx.target_num_replicas, **asdict(decision)}
        (self.publish or publish_to_ray)(decision_key(ctx.app_name, ctx.deployment_name), record)


def decision_key(app_name: str, deployment_name: str) -> str:
    return f"autoscaling/{app_name}/{deployment_name}"


def publish_to_ray(key: str, record: dict) -> None:
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_put(key, json.dumps(record), overwrite=True, namespace=KV_NAMESPACE)


def last_decision(app_name: str, deployment_name: str) -> dict | None:
    """The policy's last published decision for a deployment, or None (not autoscaled by it)."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(decision_key(app_name, deployment_name), namespace=KV_NAMESPACE)
    return json.loads(raw) if raw else None
