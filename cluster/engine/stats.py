"""EngineStats: what an engine reports about itself, read by the server, its metrics and tests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_prefilling: int  # running requests whose prompt is not all computed yet
    num_tokens_to_prefill: int  # tokens whose KV must still be computed before first tokens (waiting and prefilling)
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_queried_tokens: int  # prompt tokens looked up in the prefix cache (admitted requests)
    prefix_cache_hit_tokens: int  # of which the device cache had
    num_preemptions: int
    num_swapped_in: int  # preempted requests that came back from their swap copy
    num_swapped_blocks: int  # blocks that preempted requests hold in host memory now
    last_step_s: float  # the last step that ran, whole
    last_execute_s: float  # of which the executor (model and sampling)

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens if self.prefix_cache_queried_tokens else 0.0
