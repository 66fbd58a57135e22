"""Pagoda on one simulated cluster that Ray's autoscaler grows, what it saw as JSON on stdout. Run
by tests/cluster/test_autoscaling_cluster.py in a process of its own, each behaviour in turn on
the same cluster (a cluster's head and nodes are the costly part to start and stop):

1. The model server autoscaled under a fixed load rather than a ramp: long streams past one
   replica's batch make the policy ask for a second replica, which lands on a node the autoscaler
   launches and answers a request sent then; the streams cancelled by id, every block is free, the
   replica goes and so does its idle node (the load ramp over the same cluster is
   benchmarks/autoscaling_ramp.py).
2. A TP=2 group whose ranks Ray places on two more nodes it launches: its greedy tokens, with
   TP=1's from this process.

    python -m tests.cluster.simulated_nodes MODEL_DIR
"""

import json
import os
import sys
import threading

# Before anything touches Ray: Ray reads its auth mode once, and the cluster uses Ray's token.
os.environ["RAY_AUTH_MODE"] = "token"

import requests  # noqa: E402

from benchmarks.autoscaling_ramp import (SEQS_PER_REPLICA, deploy, idle, running, simulated_cluster,  # noqa: E402
                                         status, wait_for)
from cluster import LLM, SamplingParams  # noqa: E402
from cluster.bench.ramp import pagoda_state  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from tests.parity_prompts import RAW_PROMPTS  # noqa: E402

SERVER = "LLMServer"
# Events, each with a generous deadline: a slow or busy host takes longer, never fails for it.
DEADLINE_S = 300
TP_PROMPTS = RAW_PROMPTS[:3]
GREEDY = SamplingParams(max_tokens=16, temperature=0)


def stream(base: str, request_id: str, ended: dict) -> None:
    body = {"prompt": "Count to ten thousand:", "max_tokens": 4000, "ignore_eos": True, "temperature": 0,
            "stream": True, "request_id": request_id}
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=DEADLINE_S) as r:
        for line in r.iter_lines():
            if line:
                ended[request_id] = line.decode()  # the last event: the cancellation's


def replicas(base: str) -> int:
    return pagoda_state(status(base))["replicas"].get(SERVER, 0)


def main(model: str) -> int:
    report = {"tp1": [o.outputs[0].token_ids for o in LLM(model, num_blocks=128).generate(TP_PROMPTS, GREEDY)]}
    with running(simulated_cluster(node_idle_timeout_s=5)) as cluster:
        report["scaling"] = scale_up_and_down(cluster, model)
        report["tp2"] = tp2_on_two_more_nodes(cluster, model)
    print(json.dumps(report))
    return 0


def scale_up_and_down(cluster, model: str) -> dict:
    report = {}
    base = deploy(model, autoscaled=True, disaggregated=False, http_port=free_port(), downscale_delay_s=3,
                  max_replicas=2)
    report["replicas_at_start"] = replicas(base)
    # Twice one replica's batch: two sequences run, two wait, and the policy asks for two replicas.
    ids = [f"long-{i}" for i in range(2 * SEQS_PER_REPLICA)]
    ended: dict = {}
    threads = [threading.Thread(target=stream, args=(base, i, ended), daemon=True) for i in ids]
    for t in threads:
        t.start()
    wait_for(lambda: replicas(base) == 2, DEADLINE_S, "no second replica")
    report["nodes_at_two_replicas"] = status(base)["nodes"]
    report["decision"] = status(base)["deployments"][SERVER].get("autoscaling")
    answer = requests.post(f"{base}/v1/completions", timeout=DEADLINE_S,
                           json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
    report["answered_at_two_replicas"] = answer.status_code
    for i in ids:
        requests.delete(f"{base}/v1/pagoda/requests/{i}", timeout=60).raise_for_status()
    for t in threads:
        t.join(DEADLINE_S)
    report["stream_ends"] = [json.loads(ended[i].removeprefix("data: "))["error"]["type"] for i in ids]
    groups = wait_for(lambda: idle(status(base)), DEADLINE_S, "a replica kept KV blocks")["groups"]
    report["blocks_held"] = [g["stats"]["kv_blocks_total"] - g["stats"]["kv_blocks_free"] for g in groups]
    wait_for(lambda: replicas(base) == 1, DEADLINE_S, "the second replica did not go")
    wait_for(lambda: len(cluster.worker_nodes()) == 1, DEADLINE_S, "the idle node was not stopped")
    report["replicas_at_end"], report["worker_nodes_at_end"] = replicas(base), len(cluster.worker_nodes())
    return report


def tp2_on_two_more_nodes(cluster, model: str) -> dict:
    """The one replica left fills its node's CPU: STRICT_SPREAD's two ranks (0.5 CPU each) need two
    more nodes, which the autoscaler launches."""
    two = LLM(model, num_blocks=128, tensor_parallel_size=2, tp_collective="gloo", tp_placement_strategy="STRICT_SPREAD")
    got = [o.outputs[0].token_ids for o in two.generate(TP_PROMPTS, GREEDY)]
    ranks = two.engine.executor.describe()
    two.shutdown()
    return {"got": got, "rank_nodes": [r["node_id"] for r in ranks], "collective": ranks[0]["collective"],
            "worker_nodes": len(cluster.worker_nodes())}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
