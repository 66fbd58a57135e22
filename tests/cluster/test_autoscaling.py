"""The LLM autoscaling policy, on recorded and simulated metrics, through Serve's own wrapper (its
delays, scaling factors and the bounds its controller applies)."""

import math
import random

import pytest
from ray.serve import autoscaling_policy as serve_policy
from ray.serve.autoscaling_policy import _apply_autoscaling_config, replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.engine.stats import EngineStats
from cluster.serve.autoscaling import (
    KV_USAGE, NUM_SEQS, TOKENS_TO_PREFILL, TTFT_P95, LLMAutoscalingPolicy, RecentPercentile, replica_signals)


def decide(policy, current, per_replica, target=None, bounds=(1, 10)):
    return policy.decide(current, current if target is None else target, per_replica, *bounds)


# ---- one decision ---------------------------------------------------------------------------

def test_sequences_above_target_ask_for_the_replicas_that_bring_them_back():
    policy = LLMAutoscalingPolicy(target_num_seqs=8)
    decision = decide(policy, 2, {NUM_SEQS: [20, 20], KV_USAGE: [0.3, 0.3]})
    assert decision.num_replicas == 5  # 40 sequences / 8 per replica
    assert decision.pressure == 2.5
    assert decision.reason.startswith("num_seqs at 2.50x target: above target")


def test_kv_pressure_alone_scales_up():
    policy = LLMAutoscalingPolicy(target_num_seqs=48, target_kv_usage=0.8)
    decision = decide(policy, 1, {NUM_SEQS: [4], KV_USAGE: [0.96]})
    assert decision.num_replicas == 2 and decision.reason.startswith("kv_usage at 1.20x")


def test_prefill_scales_on_tokens_to_prefill_not_sequences():
    policy = LLMAutoscalingPolicy(role="prefill", target_tokens_to_prefill=2048)
    decision = decide(policy, 1, {TOKENS_TO_PREFILL: [6000], NUM_SEQS: [1000], KV_USAGE: [1.0]})
    assert decision.num_replicas == 3 and decision.signals == {TOKENS_TO_PREFILL: 6000 / 2048}


def test_ttft_counts_only_with_an_slo():
    signals = {NUM_SEQS: [1], KV_USAGE: [0.1], TTFT_P95: [3.0]}
    assert decide(LLMAutoscalingPolicy(), 1, signals).num_replicas == 1
    assert decide(LLMAutoscalingPolicy(ttft_slo_s=1.0), 1, signals).num_replicas == 3


def test_fewer_replicas_only_when_they_would_stay_below_target():
    policy = LLMAutoscalingPolicy(target_num_seqs=10, scale_down_below=0.7)
    # 3 replicas, 15 sequences: 2 replicas would run at 0.75 of target -> hold
    assert decide(policy, 3, {NUM_SEQS: [5, 5, 5]}).num_replicas == 3
    # 13 sequences: 2 replicas at 0.65 -> 2
    assert decide(policy, 3, {NUM_SEQS: [5, 4, 4]}).num_replicas == 2
    # nothing running: down to the minimum
    assert decide(policy, 3, {NUM_SEQS: [0, 0, 0]}, bounds=(1, 10)).num_replicas == 1


def test_while_replicas_start_it_holds_at_the_target():
    policy = LLMAutoscalingPolicy(target_num_seqs=8)
    decision = decide(policy, 1, {NUM_SEQS: [40]}, target=3)
    assert decision.num_replicas == 3 and "still starting" in decision.reason


def test_no_signals_hold_the_target_and_bounds_are_named():
    policy = LLMAutoscalingPolicy(target_num_seqs=8)
    assert decide(policy, 2, {}, target=2).num_replicas == 2
    decision = decide(policy, 2, {NUM_SEQS: [80, 80]}, bounds=(1, 4))
    assert decision.num_replicas == 4 and decision.reason.endswith("(bounded by min 1 / max 4)")


def test_signals_of_replicas_that_are_not_running_are_ignored():
    policy = LLMAutoscalingPolicy(target_num_seqs=8, publish=lambda key, record: None)
    ctx = context(AutoscalingConfig(min_replicas=1, max_replicas=10), current=1, target=1,
                  metrics={NUM_SEQS: {"r0": 8.0, "gone": 80.0}}, total_requests=8)
    assert policy(ctx) == (1, {})


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="role"):
        LLMAutoscalingPolicy(role="encode")
    with pytest.raises(ValueError, match="scale_down_below"):
        LLMAutoscalingPolicy(scale_down_below=1.5)


def test_each_decision_is_published_once_until_it_changes():
    records = []
    policy = LLMAutoscalingPolicy(target_num_seqs=8, publish=lambda key, record: records.append((key, record)))
    config = AutoscalingConfig(min_replicas=1, max_replicas=10)
    for seqs in (8.0, 7.0, 20.0):
        policy(context(config, current=1, target=1, metrics={NUM_SEQS: {"r0": seqs}}, total_requests=seqs))
    assert [(key, r["num_replicas"], r["reason"].split(":")[1].strip()) for key, r in records] == [
        ("autoscaling/pagoda/LLMServer", 1, "within target"),
        ("autoscaling/pagoda/LLMServer", 3, "above target"),
    ]
    assert records[1][1]["current_replicas"] == 1 and records[1][1]["signals"] == {NUM_SEQS: 2.5}


def test_replica_signals_and_recent_percentile():
    stats = EngineStats(num_running=3, num_waiting=2, num_prefilling=1, num_tokens_to_prefill=700, kv_blocks_total=100,
                        kv_blocks_free=40, prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0, num_preemptions=0,
                        num_swapped_in=0, num_swapped_blocks=0, last_step_s=0.0, last_execute_s=0.0)
    assert replica_signals(stats, num_unadmitted=1, ttft_p95_s=0.5) == {
        NUM_SEQS: 6, KV_USAGE: 0.6, TOKENS_TO_PREFILL: 700, TTFT_P95: 0.5}
    now = [0.0]
    recent = RecentPercentile(window_s=30, clock=lambda: now[0])
    assert recent.percentile(95) == 0.0
    for i in range(1, 101):
        recent.add(float(i))
    assert recent.percentile(95) == 95.0 and recent.percentile(50) == 50.0
    now[0] = 31.0
    recent.add(7.0)
    assert recent.percentile(95) == 7.0  # the old values left the window


# ---- over time: Serve's wrapper, delays and bounds, on simulated replicas ------------------------

def context(config, current, target, metrics, total_requests, state=None):
    return AutoscalingContext(
        deployment_id=None, deployment_name="LLMServer", app_name="pagoda", current_num_replicas=current,
        target_num_replicas=target, running_replicas=[f"r{i}" for i in range(current)],
        total_num_requests=total_requests, total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=config)


class SimulatedDeployment:
    """Serve's control loop in miniature, one tick a second: replicas report the load they carry
    (averaged over the look-back window, as Serve aggregates), the wrapped policy decides, Serve's
    bounds apply, and a new replica serves `startup_s` after it is asked for."""

    def __init__(self, policy, config: AutoscalingConfig, replicas: int, kv_per_seq: float, startup_s: int = 20):
        self.policy = _apply_autoscaling_config(policy)
        self.config = config
        self.running = self.target = replicas
        self.kv_per_seq = kv_per_seq
        self.startup_s = startup_s
        self.starting: list[int] = []  # when each asked-for replica will serve
        self.window: list[float] = []
        self.state: dict = {}
        self.now = 0

    def tick(self, load: float) -> int:
        self.now += 1
        self.running += sum(1 for t in self.starting if t == self.now)
        self.starting = [t for t in self.starting if t > self.now]
        self.window = (self.window + [load])[-int(self.config.look_back_period_s):]
        mean_load = sum(self.window) / len(self.window)
        per_replica = mean_load / self.running
        metrics = {NUM_SEQS: {f"r{i}": per_replica for i in range(self.running)},
                   KV_USAGE: {f"r{i}": min(1.0, per_replica * self.kv_per_seq) for i in range(self.running)}}
        ctx = context(self.config, self.running, self.target, metrics, mean_load, self.state)
        decision, self.state = self.policy(ctx)
        decision = max(self.config.min_replicas, min(self.config.max_replicas, math.ceil(decision)))
        if decision > self.target:
            self.starting += [self.now + self.startup_s] * (decision - self.target)
        elif decision < self.target:
            self.running = decision
            self.starting = []
        self.target = decision
        return self.target

    def run(self, loads) -> list[int]:
        return [self.tick(load) for load in loads]


@pytest.fixture
def fake_clock(monkeypatch):
    """Serve's delay logic reads time.time(); the simulation's clock is its tick count."""
    clock = {"now": 1_000_000.0}

    class Time:
        @staticmethod
        def time():
            return clock["now"]

    monkeypatch.setattr(serve_policy, "time", Time)
    return clock


def simulate(fake_clock, policy, config, loads, replicas=1, kv_per_seq=0.01):
    sim = SimulatedDeployment(policy, config, replicas, kv_per_seq)
    targets = []
    for load in loads:
        fake_clock["now"] += 1
        targets.append(sim.tick(load))
    return targets


def config(**options):
    return AutoscalingConfig(**{"min_replicas": 1, "max_replicas": 8, "look_back_period_s": 15,
                                "upscale_delay_s": 5, "downscale_delay_s": 120, **options})


def quiet(key, record):
    pass


def test_long_documents_scale_up_on_kv_before_the_request_count_would(fake_clock):
    """Sequences that each hold 18% of a replica's KV: a replica is full at five of them, while a
    request-count policy set to the same replica's sequence target (8) waits for nine."""
    loads = [min(12, 1 + t // 10) for t in range(120)]  # one more sequence every 10 s
    kv = simulate(fake_clock, LLMAutoscalingPolicy(target_num_seqs=8, target_kv_usage=0.8, publish=quiet),
                  config(), loads, kv_per_seq=0.18)
    requests = simulate(fake_clock, replica_queue_length_autoscaling_policy, config(target_ongoing_requests=8),
                        loads, kv_per_seq=0.18)
    first_kv, first_requests = kv.index(2), requests.index(2)
    assert first_kv < first_requests - 30, (first_kv, first_requests)
    # 5 x 18% = 90% of the KV, over the 80% target (seen through the 15 s window and 5 s delay)
    assert loads[first_kv] == 6 and loads[first_requests] == 9, (loads[first_kv], loads[first_requests])


def test_steady_load_holds_steady_for_five_minutes(fake_clock):
    """22 sequences +-15% for 300 s against 8 per replica: 3 replicas throughout, no flapping."""
    rng = random.Random(0)
    loads = [22 * (1 + rng.uniform(-0.15, 0.15)) for _ in range(300)]
    targets = simulate(fake_clock, LLMAutoscalingPolicy(target_num_seqs=8, publish=quiet), config(), loads, replicas=3)
    assert set(targets) == {3}


def test_scales_down_only_after_the_delay(fake_clock):
    loads = [24] * 100 + [4] * 300
    targets = simulate(fake_clock, LLMAutoscalingPolicy(target_num_seqs=8, publish=quiet), config(), loads, replicas=3)
    assert set(targets[:100 + 120]) == {3}  # not before downscale_delay_s after the drop
    assert targets[100 + 120 + 15 + 5] == 1  # after it (and the look-back window) it has


def test_never_below_min_or_above_max(fake_clock):
    loads = [1000] * 60 + [0] * 300
    targets = simulate(fake_clock, LLMAutoscalingPolicy(target_num_seqs=8, publish=quiet),
                       config(min_replicas=2, max_replicas=4), loads, replicas=2)
    assert max(targets) == 4 and min(targets) == 2
    assert targets[59] == 4 and targets[-1] == 2
