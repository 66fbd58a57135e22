"""All-reduce latency between two Ray actors on this host: gloo (torch.distributed over loopback
TCP) vs deepspeed.comm's shared-memory op, for the row counts a TP step all-reduces.

    python -m benchmarks.allreduce [--rows 1,32,128,512]

Rows are hidden-size wide (576, SmolLM2); a TP step all-reduces [tokens, hidden] twice per layer.
"""

from __future__ import annotations

import argparse
import time

import ray
import torch

from cluster.executor.tp_group import _join_group
from cluster.ports import free_port

HIDDEN = 576


@ray.remote(num_cpus=0.5)
class Rank:
    def __init__(self, rank: int, world: int, init_method: str, shared_memory: bool):
        torch.set_num_threads(1)
        self.collective, self.all_reduce = _join_group(rank, world, init_method, "cpu", shared_memory)

    def microseconds(self, rows: int, calls: int = 300) -> float:
        x = torch.randn(rows, HIDDEN)
        for _ in range(20):
            self.all_reduce(x)
        start = time.perf_counter()
        for _ in range(calls):
            self.all_reduce(x)
        return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,32,128,512")
    args = parser.parse_args()
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    rows = [int(r) for r in args.rows.split(",")]
    print("| collective | " + " | ".join(f"{r} rows (µs)" for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for shared_memory in (False, True):
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ranks = [Rank.remote(r, 2, init_method, shared_memory) for r in range(2)]
        name = ray.get(ranks[0].__ray_call__.remote(lambda self: self.collective))
        times = [max(ray.get([rank.microseconds.remote(n) for rank in ranks])) for n in rows]
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
        for rank in ranks:
            ray.kill(rank)
    ray.shutdown()


if __name__ == "__main__":
    main()
