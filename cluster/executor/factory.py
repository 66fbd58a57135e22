"""build_engine: an LLMEngine with what its EngineConfig asks for, built here so that the engine
is handed its parts and builds none itself:

    the Executor (cluster/engine/executor.py):

    tensor_parallel_size 1  -> ModelRunner in this process (KV to / from other engines through
                               Ray's object store when disaggregated)
    tensor_parallel_size >1 -> TPGroup: one Ray actor per rank, in a placement group
    the KV tiers below device memory (cache_service/offload.py): host RAM and disk in this
    process, or the shared CacheService actors; none when no bytes are given to them
"""

from __future__ import annotations

from pathlib import Path

from cache_service.offload import KVOffload, build_offload
from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine, model_identity
from cluster.engine.executor import Executor
from model.config import ModelConfig
from model.loader import parse_dtype


def build_engine(config: EngineConfig) -> LLMEngine:
    executor = build_executor(config)
    return LLMEngine(config, executor, build_kv_tiers(config, executor.config))


def build_kv_tiers(config: EngineConfig, model: ModelConfig) -> KVOffload | None:
    # Pages hold every KV head whatever the TP degree (TPGroup.read_blocks joins the ranks'), so
    # the degree is not part of their identity: a TP=2 server's pages serve a TP=1 one.
    identity = {"model": model_identity(Path(config.model), config), "layers": model.num_hidden_layers,
                "kv_heads": model.num_key_value_heads, "head_dim": model.head_dim, "block_size": config.block_size,
                "dtype": config.kv_dtype}
    return build_offload(identity, config.host_kv_bytes, config.disk_kv_bytes, config.kv_cache_dir,
                         config.kv_cache_service_shards, config.kv_page_codec, config.kv_cache_service_resources)


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
