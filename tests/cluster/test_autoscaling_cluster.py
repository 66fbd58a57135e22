"""Pagoda on a simulated multi-node cluster that Ray's own autoscaler grows (Ray's fake multi-node
provider, cluster/simulated_cluster.py), each run in a process of its own (this one may be
connected to the session's cluster):

- under load past one replica's batch the model server goes from 1 to 2 replicas on nodes the
  autoscaler launches and answers; the load cancelled, replicas and nodes go back down with no KV
  block left held (tests/cluster/simulated_nodes_scaling.py; the load ramp is a benchmark:
  benchmarks/autoscaling_ramp.py);
- a TP=2 group whose ranks land on two nodes gives TP=1's tokens.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray  # a Ray cluster or a served model: make test only

ROOT = Path(__file__).resolve().parents[2]


def test_load_past_one_replica_adds_a_replica_and_a_node_and_both_go_when_it_ends(model_dir):
    result = subprocess.run([sys.executable, "-m", "tests.cluster.simulated_nodes_scaling", model_dir], cwd=ROOT,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    report = last_json_line(result.stdout)
    assert report["replicas_at_start"] == 1
    assert report["nodes_at_two_replicas"] == 1 + 2  # the head and two launched workers, a replica each
    decision = report["decision"]  # `pagoda status`: the policy's last decision and why
    assert decision["current_replicas"] >= 1 and "target" in decision["reason"], decision
    assert report["answered_at_two_replicas"] == 200
    assert report["stream_ends"] == ["cancelled"] * 4  # cancelled by id, an explicit end each
    assert set(report["blocks_held"]) == {0}, report["blocks_held"]
    assert report["replicas_at_end"] == 1 and report["worker_nodes_at_end"] == 1


def test_a_tp2_group_on_two_nodes_gives_the_tp1_tokens(model_dir):
    result = subprocess.run([sys.executable, "-m", "tests.cluster.simulated_nodes_tp", model_dir], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = last_json_line(result.stdout)
    assert len(set(report["rank_nodes"])) == 2 and report["worker_nodes"] == 2
    assert report["collective"] == "gloo"  # ranks on two hosts
    assert report["got"] == report["expected"]


def last_json_line(stdout: str) -> dict:
    """The script's report: Ray's own messages (a raylet's, as the cluster stops) may follow it."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))
