"""Start (or join) a Ray cluster, start Serve's HTTP and gRPC ingress, deploy Pagoda, wait until
it answers; drain and stop it. Used by `pagoda serve` and by the integration tests, so both run
the same path."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import requests
import yaml

from cluster.model_fetch import pagoda_home
from cluster.ports import free_port
from cluster.serve import drain as drain_module
from cluster.serve import grpc_bind
from cluster.serve.haproxy_guard import guarded_haproxy, soft_stop_serve_haproxy
from cluster.serve.app import GRPC_SERVICERS, build_app, check_app_args, max_pending_requests
from cluster.serve.placement import check_fit, check_fit_on_new_node, cluster_nodes
from cluster.serve.front_door import FrontDoor

logger = logging.getLogger("pagoda.launcher")
APP_NAME = "pagoda"
PUSH_INTERVAL_ENV = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"
HA_PROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
INGRESS_DEREGISTRATION_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
PROXY_READY_TIMEOUT_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
# Serve settings for the clusters started here (a variable already set is kept):
# - autoscaled replicas report their engine's queue and KV use every 2 s (Ray's default, 10 s,
#   makes the policy see a burst late);
# - Serve's controller loops every 0.5 s instead of 0.1, and handles export their metrics every
#   second instead of every 0.1 s. On a node the engine shares with Serve, every wakeup of another
#   process takes a core from one of the step's two OpenMP threads and holds the other at the
#   region's end: an idle server's ~2,070 wakeups a second slowed a one-stream step beside it by
#   1.14-1.16x, ~1,740 with these by 1.09-1.13x (benchmarks/idle_cluster_cost.py). Serve's
#   autoscaling delays are timed, not counted in loops, so they mean the same;
# - a replica runs its deployment's code on its own event loop, and a handle routes on its
#   caller's loop, instead of each on a thread of its own: a streamed message then wakes one
#   thread fewer in each process (one served stream on 2 cores: the Ingress's and LLMServer's
#   CPU a token ~0.5 and ~0.37 ms -> ~0.34 and ~0.29; docs/benchmarks-log.md). Pagoda's deployments
#   run their blocking work on threads of their own (the engine, tokenizing).
# - a proxy actor (HAProxy's manager) gets 60 s to start instead of Serve's 5: on a busy host its
#   process start and imports took longer, Serve's controller killed it, and serve.start failed
#   with ActorDiedError (the suite beside a `make -j2` build, docs/benchmarks-log.md).
SERVE_ENV_DEFAULTS = {PUSH_INTERVAL_ENV: "2", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
                      PROXY_READY_TIMEOUT_ENV: "60",
                      "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
                      "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
_front_door: FrontDoor | None = None


def load_app_args(config_path: str | Path | None) -> dict:
    """The `args` of the pagoda application in a Serve config YAML (serve_config.yaml)."""
    if config_path is None:
        return {}
    config = yaml.safe_load(Path(config_path).read_text())
    for application in config.get("applications", []):
        if application.get("name") == APP_NAME:
            return dict(application.get("args") or {})
    raise ValueError(f"{config_path} has no application named {APP_NAME!r}")


def start(
    app_args: dict,
    http_port: int = 8000,
    grpc_port: int = 9000,
    address: str | None = None,
    num_cpus: int | None = None,
    ready_timeout_s: float = 300.0,
    metrics_port: int | None = None,
) -> dict:
    """Deploys and blocks until /health answers; returns {"id": the served model's name}. Ray stays up."""
    import ray
    from ray import serve

    config, prefill_engine, decode_engine = check_app_args(app_args)
    if not config.api_keys_file:
        logger.warning("no API keys (--api-keys / api_keys_file): the server answers anyone who can reach it")
    if address is None and num_cpus is not None and not ray.is_initialized():
        check_fit_on_new_node(config, prefill_engine, decode_engine, num_cpus)
    if start_ray(address, num_cpus, metrics_port):
        # This cluster cannot grow: a shape that does not fit it fails now, not after Serve's retries.
        check_fit(config, prefill_engine, decode_engine, cluster_nodes())
    global _front_door
    drain_module.reset()  # before the replicas look: an earlier server's drain on this cluster is over
    serve_http_port = http_port
    if config.front_door:  # HAProxy takes the HTTP port; Serve's proxy listens behind it
        serve_http_port = free_port()
        _front_door = FrontDoor("127.0.0.1", http_port, serve_http_port, max_pending_requests(config),
                                idle_timeout_s=(config.request_timeout_s or 3600) + 60)
        _front_door.start()
        app_args = {**app_args, "front_door_dir": str(_front_door.dir)}
    start_serve(serve_http_port, grpc_port)
    serve.run(build_app(app_args), name=APP_NAME, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            health = requests.get(f"{base}/health", timeout=30)
            if health.status_code == 200:
                return {"id": health.json()["model"]}
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Pagoda did not become ready within {ready_timeout_s:.0f}s")
        time.sleep(0.5)


def start_ray(address: str | None = None, num_cpus: int | None = None, metrics_port: int | None = None) -> bool:
    """Joins the cluster at `address`, or starts a new local one; True where it started one.
    Nothing where this process is connected already."""
    import ray

    for name, value in SERVE_ENV_DEFAULTS.items():  # a local cluster's processes inherit them
        os.environ.setdefault(name, value)
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address)
        return False
    # A new local cluster ("local": never attach to another one found on this machine), bound to
    # loopback, without the dashboard (~0.9 GB less memory), and without the workers Ray starts
    # ahead for its first driver (one a CPU): those no actor took only waited, each waking ~150
    # times a second (an idle server's wakeups 1,599 -> 1,427 a second, benchmarks/idle_cluster_cost.py;
    # its ready time the same, 25.6-26.9 s against 24.6-28.1).
    start_local_ray(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                    _metrics_export_port=metrics_port,  # Prometheus scrapes Pagoda's metrics here
                    runtime_env=local_runtime_env("127.0.0.1"),
                    _system_config={"prestart_worker_first_driver": False})
    return True


LOCAL_STARTS = 3
NODE_STARTUP_TIMEOUT = "The current node timed out during startup"


def start_local_ray(**init_options) -> None:
    """ray.init of a new local cluster, started again where its node died starting. On a busy
    host Ray's dashboard agent can take longer than the raylet's fixed 30 s wait for its ports
    (Ray 2.60: the raylet aborts, "Timed out waiting for file .../metrics_agent_port_..."), and
    ray.init then fails with NODE_STARTUP_TIMEOUT; the processes of that attempt are stopped."""
    import psutil
    import ray

    for attempt in range(1, LOCAL_STARTS + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(address="local", **init_options)
            return
        except Exception as error:  # noqa: BLE001 - ray.init raises a bare Exception for this
            if NODE_STARTUP_TIMEOUT not in str(error) or attempt == LOCAL_STARTS:
                raise
            logger.warning("Ray's local node died starting (a busy host?); starting it again (%d of %d)",
                           attempt + 1, LOCAL_STARTS)
        ray.shutdown()
        for process in psutil.Process().children(recursive=True):
            if process.pid not in before:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass


def start_serve(http_port: int, grpc_port: int) -> None:
    """Serve's HTTP and gRPC ingress on these ports (loopback), Pagoda's gRPC service on the latter."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=http_port),
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICERS))


def local_runtime_env(host: str) -> dict:
    """The runtime_env of a local cluster: Serve's gRPC ingress on `host` only (grpc_bind), and
    Serve's HAProxy mode unless RAY_SERVE_ENABLE_HA_PROXY=0 is set: HAProxy on the HTTP and gRPC
    ports hands each connection to an Ingress replica's own server (Serve's direct ingress), one
    Python proxy actor fewer on every streamed message (one stream's served TPOT ~13.5 -> ~11 ms
    on 2 cores, docs/benchmarks-log.md). The ports Serve fixes in this mode get free ones here:
    HAProxy's stats and metrics, and the fallback proxy's, which listens with SO_REUSEPORT, so
    two servers on one host would otherwise share it and answer each other's requests.
    An Ingress replica that stops stays reachable a while so that load balancers drop it first
    (Serve's default: 30 s, for HAProxies on other nodes); this cluster's one HAProxy drops it
    within a reload (~0.5 s), so a few seconds do, and stopping the server takes that, not 30 s."""
    runtime_env = grpc_bind.runtime_env(host)
    if os.environ.get(HA_PROXY_ENV, "1") == "1":
        fixed_ports = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                       "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
        runtime_env["env_vars"].update({HA_PROXY_ENV: "1", **{name: str(free_port()) for name in fixed_ports}})
        runtime_env["env_vars"][INGRESS_DEREGISTRATION_ENV] = os.environ.get(INGRESS_DEREGISTRATION_ENV, "3")
        if HAPROXY_BINARY_ENV not in os.environ:  # a user's own HAProxy is left as it is
            guard = guarded_haproxy(pagoda_home() / "bin")  # HAProxy goes when its actor goes, even on SIGKILL
            if guard:
                runtime_env["env_vars"][HAPROXY_BINARY_ENV] = guard
    return runtime_env


def drain(timeout_s: float, log=print) -> bool:
    """Refuse new requests (503 / UNAVAILABLE), give the ones in flight `timeout_s` to finish,
    end the rest with an error. Returns whether all finished in time."""
    import ray

    if not ray.is_initialized():
        return True
    return drain_module.drain(timeout_s, log)


def stop() -> None:
    import ray
    from ray import serve

    global _front_door
    # The front door and Serve's own HAProxy go first, softly: from then on a new connection is
    # refused (a client retries elsewhere), where during Serve's shutdown it would have been
    # accepted and then cut.
    try:
        if _front_door is not None:
            _front_door.stop()
            _front_door = None
        if ray.is_initialized():
            soft_stop_serve_haproxy(ray.get_runtime_context().get_node_id())
    finally:
        if ray.is_initialized():
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
