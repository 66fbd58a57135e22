"""A TP=2 group whose ranks Ray places on two nodes of a simulated cluster (Ray's fake multi-node
autoscaler launches them): its greedy tokens, with TP=1's from this process, as JSON on stdout.
Run by tests/cluster/test_autoscaling_cluster.py in a process of its own.

    python -m tests.cluster.simulated_nodes_tp MODEL_DIR
"""

import json
import os
import sys

# Before anything touches Ray: Ray reads its auth mode once, and the cluster uses Ray's token.
os.environ["RAY_AUTH_MODE"] = "token"

from cluster import LLM, SamplingParams  # noqa: E402
from cluster.simulated_cluster import SimulatedCluster  # noqa: E402
from tests.parity_prompts import RAW_PROMPTS  # noqa: E402

PROMPTS = RAW_PROMPTS[:3]
GREEDY = SamplingParams(max_tokens=16, temperature=0)


def main(model: str) -> int:
    one = LLM(model, num_blocks=128)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    del one
    # One-CPU nodes (Ray wants whole CPUs), none at the start; STRICT_SPREAD puts the two ranks
    # (0.5 CPU each) on two of them.
    cluster = SimulatedCluster(head_resources={"CPU": 0, "object_store_memory": 300 << 20},
                               worker_node_types={"rank": {"resources": {"CPU": 1, "object_store_memory": 300 << 20},
                                                           "min_workers": 0, "max_workers": 2}})
    try:
        cluster.start()
        cluster.connect(log_to_driver=False)
        two = LLM(model, num_blocks=128, tensor_parallel_size=2, tp_collective="gloo",
                  tp_placement_strategy="STRICT_SPREAD")
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY)]
        ranks = two.engine.executor.describe()
        print(json.dumps({"expected": expected, "got": got, "rank_nodes": [r["node_id"] for r in ranks],
                          "collective": ranks[0]["collective"], "worker_nodes": len(cluster.worker_nodes())}))
    finally:
        import ray

        ray.shutdown()
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
