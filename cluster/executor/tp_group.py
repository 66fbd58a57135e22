"""TPGroup: a tensor-parallel group of Ray actors, one ModelRunner rank each, in a placement group,
joined by torch.distributed. The engine drives it like a ModelRunner: `execute(seqs)` runs the
step on every rank (each layer's all-reduce needs all of them) and returns rank 0's sampled tokens.

The all-reduce: NCCL on CUDA. On CPU, with every rank on one host, deepspeed.comm's shared-memory
all-reduce (benchmarks/allreduce.py, 2 cores, 576-wide rows: 5 us for 1 row and 18 us for 32,
against gloo's 736 us and 677 us over loopback TCP; two all-reduces a layer make gloo cost ~50 ms a step);
gloo when ranks span hosts or deepspeed is missing. deepspeed's op is compiled once per host (50-80 s on 2 cores).

Sampling happens on rank 0 with copies of the engine's per-request generators (they travel
pickled); rank 0 sends their advanced states back and they are written into the engine's own
generators, so seeded sampling goes on exactly as with one process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import ray
import torch

from cluster.engine.errors import WorkerLostError
from cluster.ports import free_port
from model.config import ModelConfig
from model.cpp_extensions import host_key, load_extension
from cluster.engine.executor import StepOutput
from model.runner import ModelRunner, kv_bytes_per_block
from model.tp_layout import head_shard


class TPWorker:
    """One rank. A Ray actor; its methods run in the actor's one thread, which also loaded the
    model (a second thread running torch would halve its speed, see LLMServer)."""

    def __init__(self, model_dir: str, rank: int, tp_size: int, init_method: str, runner_kwargs: dict,
                 torch_threads: int, shared_memory: bool):
        torch.set_num_threads(torch_threads)
        self.rank = rank
        device = str(runner_kwargs.get("device", "cpu"))
        self.collective, all_reduce = _join_group(rank, tp_size, init_method, device, shared_memory)
        self.runner = ModelRunner(model_dir, tp_rank=rank, tp_size=tp_size, reduce=all_reduce,
                                  kv_put=ray.put, kv_get=ray.get, **runner_kwargs)

    def describe(self) -> dict:
        node_id = ray.get_runtime_context().get_node_id()
        return {**self.runner.describe()[0], "node_id": node_id, "collective": self.collective}

    def read_blocks(self, block_ids: list[int]) -> tuple[tuple[int, int], list[np.ndarray]]:
        return self.runner.kv_heads, self.runner.read_blocks(block_ids)

    def write_blocks(self, pages: tuple[list[int], list[bytes]]) -> None:
        self.runner.write_blocks(*pages)

    def execute(self, seqs):
        output = self.runner.execute(seqs)
        if self.rank != 0:
            return output.kv_parts, None
        return output, [s.sampling.generator.get_state() if s.sampling and s.sampling.generator else None for s in seqs]


RENDEZVOUS_TRIES = 3


class TPGroup:
    def __init__(self, model_dir: str, tp_size: int, *, block_size: int, num_blocks: int | None, kv_cache_bytes: int,
                 max_model_len: int | None, dtype: torch.dtype, kv_cache_dtype: torch.dtype, device: str,
                 quantization: str | None, cpus_per_worker: float = 0.5, torch_threads: int | None = None,
                 collective: str = "auto", placement_strategy: str = "PACK"):
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = ModelConfig.from_dir(model_dir)
        c = self.config
        # Every rank must hold the same number of blocks; with uneven head splits their bytes per
        # block differ, so the largest one sets the count.
        largest_kv = max(len(head_shard(c.num_attention_heads, c.num_key_value_heads, tp_size, r).kv_heads)
                         for r in range(tp_size))
        bytes_per_block = kv_bytes_per_block(c, largest_kv, block_size, kv_cache_dtype)
        num_blocks = num_blocks or max(1, kv_cache_bytes // bytes_per_block)
        runner_kwargs = {"block_size": block_size, "num_blocks": num_blocks, "max_model_len": max_model_len,
                         "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "device": device, "quantization": quantization}
        if not ray.is_initialized():
            ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
        # On CUDA each rank gets a GPU of its own (Ray sets CUDA_VISIBLE_DEVICES: it is cuda:0 there).
        gpus = 1 if device.startswith("cuda") else 0
        bundle = {"CPU": cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        self.placement = placement_group([bundle] * tp_size, strategy=placement_strategy)
        ray.get(self.placement.ready(), timeout=120)
        one_host = len(set(placement_group_table(self.placement)["bundles_to_node_id"].values())) == 1
        shared_memory = collective == "auto" and one_host
        worker = ray.remote(TPWorker)
        threads = torch_threads or max(1, (os.cpu_count() or 1) // tp_size)
        on_bundle = [PlacementGroupSchedulingStrategy(placement_group=self.placement, placement_group_bundle_index=rank)
                     for rank in range(tp_size)]
        # The rendezvous port is free when picked, but another process may bind it before rank 0
        # does: the ranks then start again at a port picked anew.
        for attempt in range(RENDEZVOUS_TRIES):
            self.init_method = init_method = ray.get(
                _rendezvous_on_rank0_node.options(scheduling_strategy=on_bundle[0]).remote(), timeout=120)
            self.workers = [
                worker.options(num_cpus=cpus_per_worker, num_gpus=gpus, scheduling_strategy=on_bundle[rank]).remote(
                    model_dir, rank, tp_size, init_method, runner_kwargs, threads, shared_memory)
                for rank in range(tp_size)
            ]
            try:
                self.ranks = _get_all([w.describe.remote() for w in self.workers], timeout_s=600)
                break
            except WorkerLostError as e:
                for w in self.workers:
                    ray.kill(w)
                if "EADDRINUSE" not in str(e.__cause__) or attempt == RENDEZVOUS_TRIES - 1:
                    raise
        self.num_blocks = num_blocks
        self.max_model_len = self.ranks[0]["max_model_len"]
        self.bytes_per_block = bytes_per_block

    def describe(self) -> list[dict]:
        return self.ranks

    def read_blocks(self, block_ids: list[int]) -> list[np.ndarray]:
        """Each block's KV with every head, joined from the ranks (the first holder of each head):
        pages do not depend on the TP degree, so any group, or a single runner, can restore them."""
        parts = dict(reversed(_get_all([w.read_blocks.remote(block_ids) for w in self.workers])))
        heads = [parts[r] for r in sorted(parts)]
        return [np.concatenate([blocks[i] for blocks in heads], axis=2) for i in range(len(block_ids))]

    def write_blocks(self, block_ids, payloads) -> None:
        """Every rank takes its heads from the same pages: shipped through the object store once."""
        shipped = ray.put((list(block_ids), list(payloads)))
        _get_all([w.write_blocks.remote(shipped) for w in self.workers])

    def execute(self, seqs) -> StepOutput:
        # Pages to restore (every head) go to every rank: put them into the object store once.
        shipped = ray.put(seqs) if any(s.restore_blocks for s in seqs) else seqs
        outputs = _get_all([w.execute.remote(shipped) for w in self.workers])
        output, states = outputs[0]
        for seq, state in zip(seqs, states):
            if state is not None:
                seq.sampling.generator.set_state(state)
        for kv_parts, _ in outputs[1:]:  # each rank exports its own KV heads
            for mine, theirs in zip(output.kv_parts, kv_parts):
                mine += theirs
        return output

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.placement)


@ray.remote(num_cpus=0)
def _rendezvous_on_rank0_node() -> str:
    """Where the ranks meet: a free port on the node of rank 0's bundle, at that node's address
    (the ranks of a group may be on several nodes)."""
    host = ray.util.get_node_ip_address()
    return f"tcp://{host}:{free_port(host)}"


def _join_group(rank: int, tp_size: int, init_method: str, device: str, shared_memory: bool):
    """Joins the group's process group; returns (collective name, in-place all-reduce).
    shared_memory: every rank is on this host and the caller allows deepspeed's shm all-reduce."""
    import torch.distributed as dist

    def torch_all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    if device.startswith("cuda"):
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=tp_size)
        return "nccl", torch_all_reduce
    if shared_memory:
        try:
            import deepspeed
            import deepspeed.comm as ds_comm
        except ImportError:
            pass
        else:
            # The shared-memory op names its segment after MASTER_ADDR/MASTER_PORT (unique per
            # group here) and is used only when LOCAL_SIZE says every rank is on this host.
            host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
            os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, LOCAL_SIZE=str(tp_size), LOCAL_RANK=str(rank))
            _load_shm_op()
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=init_method,
                                       rank=rank, world_size=tp_size)
            # Every rank has mapped every rank's segment once all are initialized; the names can
            # go then, so that the memory is freed when the processes end, however they end
            # (deepspeed never unlinks them: 69 MB a rank left in /dev/shm per group otherwise).
            dist.barrier()
            Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{host}_{port}_{rank}").unlink(missing_ok=True)

            def shm_all_reduce(x: torch.Tensor) -> torch.Tensor:
                ds_comm.inference_all_reduce(x)
                return x

            return "deepspeed-shm", shm_all_reduce
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=tp_size)
    return "gloo", torch_all_reduce


def _load_shm_op() -> None:
    """deepspeed's shared-memory op, built once per host (model/cpp_extensions.py) and handed to
    deepspeed's own cache of loaded ops, where its communication backend looks first."""
    import deepspeed
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    builder = ShareMemCommBuilder()
    key = f"deepspeed {deepspeed.__version__}; {host_key()}"
    OpBuilder._loaded_ops[builder.NAME] = load_extension(builder.NAME, key, lambda: builder.jit_load(verbose=False))


def _get_all(refs: list, timeout_s: float | None = None) -> list:
    """ray.get of every rank's result, failing as soon as one rank fails: the others then wait
    in a collective for the lost rank and would never answer. A rank whose process died is a
    WorkerLostError: this group cannot run again."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                raise GetTimeoutError(f"{len(pending)} of {len(refs)} ranks did not answer within {timeout_s} s")
            ray.get(done)  # raises the rank's error
        return ray.get(refs)
    except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
        raise WorkerLostError(f"a worker of this model server died ({type(e).__name__}); retry") from e
