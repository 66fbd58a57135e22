"""Pagoda on a simulated multi-node cluster that Ray's own autoscaler grows (Ray's fake multi-node
provider, cluster/simulated_cluster.py), run once for the module in a process of its own
(tests/cluster/simulated_nodes.py; this one may be connected to the session's cluster):

- under load past one replica's batch the model server goes from 1 to 2 replicas on nodes the
  autoscaler launches and answers; the load cancelled, replicas and nodes go back down with no KV
  block left held (the load ramp is a benchmark: benchmarks/autoscaling_ramp.py);
- then a TP=2 group whose ranks land on two more nodes gives TP=1's tokens.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray  # a Ray cluster or a served model: make test only

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(model_dir) -> dict:
    result = subprocess.run([sys.executable, "-m", "tests.cluster.simulated_nodes", model_dir], cwd=ROOT,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    return last_json_line(result.stdout)


def test_load_past_one_replica_adds_a_replica_and_a_node_and_both_go_when_it_ends(report):
    scaling = report["scaling"]
    assert scaling["replicas_at_start"] == 1
    assert scaling["nodes_at_two_replicas"] == 1 + 2  # the head and two launched workers, a replica each
    decision = scaling["decision"]  # `pagoda status`: the policy's last decision and why
    assert decision["current_replicas"] >= 1 and "target" in decision["reason"], decision
    assert scaling["answered_at_two_replicas"] == 200
    assert scaling["stream_ends"] == ["cancelled"] * 4  # cancelled by id, an explicit end each
    assert set(scaling["blocks_held"]) == {0}, scaling["blocks_held"]
    assert scaling["replicas_at_end"] == 1 and scaling["worker_nodes_at_end"] == 1


def test_a_tp2_group_on_two_nodes_gives_the_tp1_tokens(report):
    tp2 = report["tp2"]
    assert len(set(tp2["rank_nodes"])) == 2 and tp2["worker_nodes"] == 1 + 2  # the replica's node, a rank's each
    assert tp2["collective"] == "gloo"  # ranks on two hosts
    assert tp2["got"] == report["tp1"]


def last_json_line(stdout: str) -> dict:
    """The script's report: Ray's own messages (a raylet's, as the cluster stops) may follow it."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))
