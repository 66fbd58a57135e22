"""Pagoda under a load ramp on a simulated multi-node cluster that Ray's autoscaler grows: the
model server autoscaled (1 to 3 replicas, one per worker node, nodes launched as replicas need
them) against one fixed replica under the same ramp.

    python -m benchmarks.autoscaling_ramp [--ramp 1:12:90] [--hold 30] [--fall SECONDS] [--disaggregated]
                                          [--hold-until-replicas N --max-extra-hold SECONDS]
        [--modes autoscaled,fixed] [--out benchmarks/results/autoscaling_ramp.json] [--plot PNG]

The cluster (cluster/simulated_cluster.py): a head with no CPU for replicas (Serve's controller,
proxies and the 0-CPU ingress run there) and a worker node type with room for one model-server
replica (1 CPU), at most 3 of them, stopped after 15 s idle. Each replica's engine batches at
most 2 sequences (so that this 2-core machine has a replica's capacity to exceed); the policy's
target is those 2. After the ramp it waits for replicas and nodes to go back down, and checks that
no replica that served holds a KV block. tests/cluster/test_autoscaling_cluster.py runs it short.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

# Before Ray is imported (it reads this once): the simulated cluster uses Ray's token auth.
os.environ["RAY_AUTH_MODE"] = "token"

import requests  # noqa: E402

from cluster.bench import ramp as ramp_module  # noqa: E402
from cluster.bench.backends import OpenAIHTTPBackend, default_model  # noqa: E402
from cluster.bench.report import markdown_rows  # noqa: E402
from cluster.bench.workloads import WorkloadSpec, build  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from cluster.simulated_cluster import SimulatedCluster  # noqa: E402

MAX_WORKERS = 3
SEQS_PER_REPLICA = 2


def app_args(model: str, autoscaled: bool, disaggregated: bool, downscale_delay_s: float = 15.0,
             max_replicas: int = MAX_WORKERS) -> dict:
    server_cpu = {"ray_actor_options": {"num_cpus": 1}, "health_check_period_s": 2}
    scaling = {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": max_replicas, "initial_replicas": 1, "look_back_period_s": 4,
        "upscale_delay_s": 2, "downscale_delay_s": downscale_delay_s,
        "policy": {"policy_kwargs": {"target_num_seqs": SEQS_PER_REPLICA}}}} if autoscaled else {"num_replicas": 1}
    args = {"model": model, "torch_threads": 1, "request_timeout_s": 600, "max_waiting_requests": 256,
            "engine": {"max_num_seqs": SEQS_PER_REPLICA, "num_blocks": 256},
            "llm_server": {**server_cpu, **scaling}}
    if disaggregated:  # the decode side scales as above; the prefill side is one replica on the head
        args.update(disaggregated=True, prefill_server={"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}})
    return args


def deploy(model: str, autoscaled: bool, disaggregated: bool, http_port: int, downscale_delay_s: float,
           max_replicas: int = MAX_WORKERS) -> str:
    from ray import serve
    from ray.serve.config import HTTPOptions

    from cluster.serve.app import build_app

    # One proxy, on the head: the simulated nodes share this machine's ports.
    serve.start(proxy_location="HeadOnly", http_options=HTTPOptions(host="127.0.0.1", port=http_port))
    serve.run(build_app(app_args(model, autoscaled, disaggregated, downscale_delay_s, max_replicas)), name="pagoda",
              route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{http_port}"
    wait_for(lambda: _get(f"{base}/health") is not None, 600, "Pagoda did not become ready")
    return base


def simulated_cluster(node_idle_timeout_s: float) -> SimulatedCluster:
    """A head with no CPU for replicas, and worker nodes of one model-server replica each."""
    # Replicas report their queue every second (Ray's default, 10 s, would lag a short ramp).
    return SimulatedCluster(
        head_resources={"CPU": 0, "object_store_memory": 400 << 20},
        worker_node_types={"server": {"resources": {"CPU": 1, "object_store_memory": 300 << 20},
                                      "min_workers": 0, "max_workers": MAX_WORKERS}},
        idle_timeout_minutes=node_idle_timeout_s / 60,
        env={"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"})


@contextlib.contextmanager
def running(cluster: SimulatedCluster):
    """The cluster started, with this process connected; afterwards Serve, the connection and the
    cluster stopped, whatever happened."""
    import ray

    try:
        cluster.start()
        cluster.connect(log_to_driver=False)
        yield cluster
    finally:
        try:
            from ray import serve

            serve.shutdown()
        except Exception:  # noqa: BLE001 - the cluster goes anyway
            pass
        ray.shutdown()
        cluster.stop()


def status(base: str) -> dict:
    return requests.get(f"{base}/v1/pagoda/status", timeout=60).json()


def run_mode(model: str, mode: str, spec, disaggregated: bool, log, hold_until_replicas: int | None = None,
             max_extra_hold_s: float = 0.0, downscale_delay_s: float = 15.0, node_idle_timeout_s: float = 15.0) -> dict:
    """One cluster, one deployment, one ramp; the ramp's result with what happened after it."""
    autoscaled = mode == "autoscaled"
    with running(simulated_cluster(node_idle_timeout_s)) as cluster:
        base = deploy(model, autoscaled, disaggregated, free_port(), downscale_delay_s)
        server = "LLMServer"
        tokenizer_spec = WorkloadSpec("random", num_prompts=400, input_len=64, output_len=48, seed=1)
        from transformers import AutoTokenizer

        requests_ = build(tokenizer_spec, AutoTokenizer.from_pretrained(model))
        served_at = time.monotonic()
        # a test's ramp holds until the replicas it checks for serve (a slow host takes longer)
        hold_until = None if hold_until_replicas is None else (
            lambda got: any(s.get("replicas", {}).get(server, 0) >= hold_until_replicas for s in got))
        records, samples, spec = asyncio.run(_ramp(base, requests_, spec, hold_until, max_extra_hold_s))
        result = ramp_module.ramp_result(f"{mode}{' (disaggregated)' if disaggregated else ''}", spec, records, samples)
        result["max_replicas"] = max((s["replicas"].get(server, 0) for s in samples if "replicas" in s), default=0)
        result["max_nodes"] = max((s.get("nodes") or 0 for s in samples), default=0)
        result["first_scale_up_s"] = next((s["t"] for s in samples if s.get("replicas", {}).get(server, 0) > 1), None)
        # when the load first passed one replica's batch, and how long until a second replica served
        result["overloaded_at_s"] = next(t / 10 for t in range(int(spec.duration_s * 10))
                                         if spec.users_at(t / 10) > SEQS_PER_REPLICA)
        if result["first_scale_up_s"] is not None:
            result["overload_to_new_replica_s"] = result["first_scale_up_s"] - result["overloaded_at_s"]
        result["last_decision"] = status(base)["deployments"][server].get("autoscaling")  # what `pagoda status` shows
        # The load is gone: every replica that served lets go of its blocks at once...
        report = wait_for(lambda: idle(status(base)), 60, "a replica kept KV blocks after the load stopped")
        result["blocks_left"] = {f"{g['deployment']}#{i}": g["stats"]["kv_blocks_total"] - g["stats"]["kv_blocks_free"]
                                 for i, g in enumerate(report["groups"])}
        # ...then Serve stops the extra replicas and Ray's autoscaler the idle nodes.
        if autoscaled:
            down = time.monotonic()
            wait_for(lambda: ramp_module.pagoda_state(status(base))["replicas"].get(server) == 1, 240, "the replicas did not go back to 1")
            result["replicas_down_s"] = time.monotonic() - down
            try:
                wait_for(lambda: len(cluster.worker_nodes()) == 1, 240, "the idle nodes were not stopped")
            except TimeoutError as e:
                raise TimeoutError(f"{e}; alive on the worker nodes: {what_runs_on(cluster.worker_nodes())}") from None
            result["nodes_down_s"] = time.monotonic() - down
        result["wall_s"] = time.monotonic() - served_at
        log(f"{result['label']}: {sum(r.ok for r in records)}/{len(records)} ok, replicas up to "
            f"{result['max_replicas']}, nodes up to {result['max_nodes']}")
        return result


async def _ramp(base: str, requests_, spec, hold_until, max_extra_hold_s: float):
    backend = OpenAIHTTPBackend(base, ignore_eos=True)
    await backend.start()
    try:
        return await ramp_module.run_ramp(backend, requests_, spec, lambda: ramp_module.pagoda_state(status(base)),
                                          sample_every_s=2.0, hold_until=hold_until, max_extra_hold_s=max_extra_hold_s)
    finally:
        await backend.close()


def what_runs_on(nodes: list[dict]) -> dict:
    """Each node's alive actors and free resources (why the autoscaler keeps it). From the GCS:
    the simulated cluster runs no dashboard, which Ray's state API needs."""
    from ray._private.state import state

    ids = {n["NodeID"] for n in nodes}
    actors = [a for a in state.actor_table(None).values() if a["State"] == "ALIVE" and a["Address"]["NodeID"] in ids]
    free = state.available_resources_per_node()
    return {node[-5:]: {"actors": [(a["ActorClassName"], a["Name"], a["Pid"], f"created from node {a['OwnerAddress']['NodeID'][-5:]}")
                                   for a in actors if a["Address"]["NodeID"] == node],
                        "free": free.get(node)} for node in ids}


def idle(report: dict) -> dict | None:
    groups = report.get("groups", [])
    # A replica that did not answer (starting, stopping, too busy to answer in time) is not known idle.
    busy = [g for g in groups if "stats" not in g
            or g["stats"]["kv_blocks_free"] != g["stats"]["kv_blocks_total"] or g["stats"]["num_running"]]
    return report if groups and not busy else None


def _get(url: str):
    try:
        response = requests.get(url, timeout=10)
        return response if response.status_code == 200 else None
    except requests.RequestException:
        return None


def wait_for(check, timeout_s: float, message: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1.0)
    raise TimeoutError(message)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ramp", default="1:12:90", help="LOW:HIGH:SECONDS users (then back down)")
    parser.add_argument("--hold", type=float, default=30.0, help="seconds at HIGH")
    parser.add_argument("--hold-until-replicas", type=int, default=None,
                        help="hold at HIGH past --hold until this many model server replicas run ...")
    parser.add_argument("--max-extra-hold", type=float, default=0.0, help="... for at most this many seconds more")
    parser.add_argument("--fall", type=float, default=None, help="seconds back down to LOW (default: as the rise; 0: stop)")
    parser.add_argument("--window", type=float, default=10.0, help="timeline window, seconds")
    parser.add_argument("--downscale-delay", type=float, default=15.0, help="Serve's downscale_delay_s, seconds")
    parser.add_argument("--node-idle-timeout", type=float, default=15.0,
                        help="seconds a node stays idle before the autoscaler stops it")
    parser.add_argument("--disaggregated", action="store_true", help="autoscale the decode side of a disaggregated app")
    parser.add_argument("--modes", default="autoscaled,fixed")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default="benchmarks/results/autoscaling_ramp.json")
    parser.add_argument("--plot", default=None, help="PNG of the timelines")
    args = parser.parse_args(argv)
    spec = ramp_module.RampSpec.parse(args.ramp, hold_s=args.hold, window_s=args.window, fall_s=args.fall)
    model = default_model(args.model)
    results = [run_mode(model, mode, spec, args.disaggregated, log=lambda m: print(m, file=sys.stderr),
                        hold_until_replicas=args.hold_until_replicas, max_extra_hold_s=args.max_extra_hold,
                        downscale_delay_s=args.downscale_delay, node_idle_timeout_s=args.node_idle_timeout)
               for mode in args.modes.split(",")]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results))
    for result in results:
        print(f"\n{result['label']}: {result['ok']} requests ok, TTFT p50 {result['ttft_p50_ms']:.0f} ms, "
              f"p95 {result['ttft_p95_ms']:.0f} ms; replicas up to {result['max_replicas']}, nodes up to {result['max_nodes']}, "
              f"overload at {result['overloaded_at_s']:.0f} s, a second replica serving "
              f"{result.get('overload_to_new_replica_s', float('nan')):.0f} s later")
        rows = result["timeline"]
        print(markdown_rows(["t (s)", "users", "ok", "failed", "TTFT p50 (ms)", "TTFT p95 (ms)", "replicas", "nodes", "waiting"],
                            [[f"{r['t_s']:.0f}", str(r["users"]), str(r["started"] - r["failed"]), str(r["failed"]),
                              f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p95_ms']:.0f}", str(r["replicas"].get("LLMServer", "")),
                              str(r["nodes"]), str(r["waiting"])] for r in rows]))
    if args.plot:
        ramp_module.plot_timelines(results, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
