"""Pagoda's model server autoscaled on a simulated cluster that Ray's autoscaler grows, under a fixed
load rather than a ramp: long streams past one replica's batch make the policy ask for a second
replica, which lands on a node the autoscaler launches and answers a request sent then; the streams
cancelled by id, every block is free, the replica goes and so does its idle node. What it saw, as
JSON on stdout. Run by tests/cluster/test_autoscaling_cluster.py in a process of its own (the load
ramp over the same cluster is benchmarks/autoscaling_ramp.py).

    python -m tests.cluster.simulated_nodes_scaling MODEL_DIR
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
from cluster.bench.ramp import pagoda_state  # noqa: E402
from cluster.ports import free_port  # noqa: E402

SERVER = "LLMServer"
# Events, each with a generous deadline: a slow or busy host takes longer, never fails for it.
DEADLINE_S = 300


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
    report = {}
    with running(simulated_cluster(node_idle_timeout_s=5)) as cluster:
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
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
