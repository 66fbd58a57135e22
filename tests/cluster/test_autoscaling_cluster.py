"""Pagoda on a simulated multi-node cluster that Ray's own autoscaler grows (Ray's fake multi-node
provider, cluster/simulated_cluster.py), each run in a process of its own (this one may be
connected to the session's cluster):

- under a load ramp past one replica's capacity the model server goes from 1 to 3 replicas on
  nodes the autoscaler launches, every request succeeds, and afterwards replicas and nodes go back
  down with no KV block left held (benchmarks/autoscaling_ramp.py, short);
- a TP=2 group whose ranks land on two nodes gives TP=1's tokens.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("disaggregated", [False, True], ids=["colocated", "disaggregated-decode"])
def test_a_ramp_scales_replicas_and_nodes_up_then_back_down(model_dir, tmp_path, disaggregated):
    out = tmp_path / "ramp.json"
    # A steep ramp (8 users, four replicas' worth, within 10 s) held until 3 replicas serve (at
    # least 15 s, at most 180 s: a slow or busy host takes longer), then stopped: the policy asks
    # for all 3 replicas at once, so the nodes launch together (the gentle ramp of
    # docs/benchmarks.md, measured by the same harness, takes twice as long). Going back down waits
    # on Serve's downscale delay and the autoscaler's idle timeout: 5 and 6 s here (the harness's
    # defaults, 15 s each, only make the test longer).
    cmd = [sys.executable, "-m", "benchmarks.autoscaling_ramp", "--ramp", "1:8:10", "--hold", "15", "--fall", "0",
           "--hold-until-replicas", "3", "--max-extra-hold", "165", "--downscale-delay", "5", "--node-idle-timeout", "6",
           "--modes", "autoscaled", "--model", model_dir, "--out", str(out)] + (["--disaggregated"] if disaggregated else [])
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    [ramp] = json.loads(out.read_text())
    errors = [r["error"] for r in ramp["records"] if r["error"] is not None or not r["chunk_times"]]
    assert ramp["records"] and not errors, errors[:5]  # no 5xx, no 429: the ramp stays within max capacity
    assert ramp["max_replicas"] == 3  # from 1, one per node
    assert ramp["max_nodes"] == 1 + 3  # the head and three launched workers
    assert ramp["first_scale_up_s"] is not None
    decision = ramp["last_decision"]  # `pagoda status`: the policy's last decision and why
    assert decision["current_replicas"] >= 1 and "target" in decision["reason"], decision
    assert set(ramp["blocks_left"].values()) == {0}, ramp["blocks_left"]
    # (the harness fails unless replicas go back to 1 and idle nodes stop within 240 s each)
    assert "replicas_down_s" in ramp and "nodes_down_s" in ramp


def test_a_tp2_group_on_two_nodes_gives_the_tp1_tokens(model_dir):
    result = subprocess.run([sys.executable, "-m", "tests.cluster.simulated_nodes_tp", model_dir], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(set(report["rank_nodes"])) == 2 and report["worker_nodes"] == 2
    assert report["collective"] == "gloo"  # ranks on two hosts
    assert report["got"] == report["expected"]
