"""build_executor: the Executor an EngineConfig asks for (cluster/engine/executor.py).

    tensor_parallel_size 1  -> ModelRunner in this process (KV to / from other engines through
                               Ray's object store when disaggregated)
    tensor_parallel_size >1 -> TPGroup: one Ray actor per rank, in a placement group
"""

from __future__ import annotations

from pathlib import Path

from cluster.engine.config import EngineConfig
from cluster.engine.executor import Executor
from model.loader import parse_dtype


def build_executor(config: EngineConfig) -> Executor:
    options = dict(block_size=config.block_size, num_blocks=config.num_blocks, kv_cache_bytes=config.kv_cache_bytes,
                   max_model_len=config.max_model_len, dtype=parse_dtype(config.dtype),
                   kv_cache_dtype=parse_dtype(config.kv_dtype), device=config.device,
                   quantization=config.quantization)
    if config.tensor_parallel_size > 1:
        from cluster.executor.tp_group import TPGroup

        return TPGroup(config.model, config.tensor_parallel_size, collective=config.tp_collective,
                       placement_strategy=config.tp_placement_strategy, **options)
    from model.runner import ModelRunner

    if config.kv_role is not None:  # KV goes to / comes from another process
        import ray

        options.update(kv_put=ray.put, kv_get=ray.get)
    return ModelRunner(Path(config.model), **options)
