"""A multi-node Ray cluster on one machine that Ray's own autoscaler grows and shrinks.

Ray's fake multi-node node provider (what Ray's autoscaler tests and
`ray.cluster_utils.AutoscalingCluster` use) starts a raylet with a worker node type's resources
whenever the autoscaler sees pending work that needs one, and stops it once idle. Here it stands
for a KubeRay cluster's worker pods: `tests/cluster/test_autoscaling_cluster.py` and
`benchmarks/autoscaling_ramp.py` run Pagoda on it.

AutoscalingCluster itself is not used as is: its start() and shutdown() run `ray stop --force`,
which stops every Ray cluster on the machine (a test session's own included), and the wheel lacks
the example config it builds on. So this starts the same thing (`ray start --head
--autoscaling-config` with RAY_FAKE_CLUSTER=1, Ray's fake_multinode provider) on a port and temp
directory of its own, and stops only the processes of its session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.ports import free_port


MARKER = "PAGODA_SIMULATED_CLUSTER"


class SimulatedCluster:
    def __init__(self, head_resources: dict, worker_node_types: dict, idle_timeout_minutes: float = 0.25,
                 env: dict | None = None):
        """head_resources: e.g. {"CPU": 0}; worker_node_types: Ray's `available_node_types`
        entries, e.g. {"server": {"resources": {"CPU": 1}, "min_workers": 0, "max_workers": 3}}."""
        self.head_resources = dict(head_resources)
        self.worker_node_types = {name: {"node_config": {}, **spec} for name, spec in worker_node_types.items()}
        self.idle_timeout_minutes = idle_timeout_minutes
        self.env = env or {}
        self.temp_dir = Path(tempfile.mkdtemp(prefix="pgsim-"))
        self.address: str | None = None
        self.session: str | None = None

    def autoscaling_config(self, host: str, port: int) -> dict:
        """Ray's fake multi-node example config, with these node types."""
        head = {"resources": self.head_resources, "node_config": {}, "max_workers": 0}
        return {
            "cluster_name": f"pagoda-sim-{port}", "max_workers": sum(t.get("max_workers", 0) for t in self.worker_node_types.values()),
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "gcs_address": f"{host}:{port}"},
            "available_node_types": {**self.worker_node_types, "ray.head.default": head},
            "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_minutes, "docker": {}, "initialization_commands": [],
            "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
            "head_start_ray_commands": [], "worker_start_ray_commands": [], "file_mounts": {},
            "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        }

    def start(self) -> str:
        """Starts the head (with the autoscaler); returns the address to ray.init."""
        from ray._private.services import get_node_ip_address

        host, port = get_node_ip_address(), free_port()
        config = self.temp_dir / "autoscaling.json"
        config.write_text(json.dumps(self.autoscaling_config(host, port)))
        resources = dict(self.head_resources)
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}",
               f"--autoscaling-config={config}", f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
               f"--num-cpus={resources.pop('CPU', 0)}", f"--num-gpus={resources.pop('GPU', 0)}",
               *([f"--object-store-memory={resources.pop('object_store_memory')}"]
                 if "object_store_memory" in resources else []),
               f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}"]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        # Every process of this cluster inherits the marker, whatever title it gives itself later.
        # Each simulated node's memory monitor would count the whole host's memory as its own,
        # and kill this cluster's workers (Serve's controller, the proxy) for what other processes
        # on the host use: the kernel's OOM killer is left to judge instead.
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": "token",
               "RAY_memory_monitor_refresh_ms": "0", MARKER: self.temp_dir.name, **self.env}
        started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        if started.returncode != 0:
            self.session = self._session_name()
            self.stop()  # what did start (the GCS, the autoscaler) must not outlive the failure
            raise RuntimeError(f"ray start failed: {started.stderr.strip()[-2000:]}")
        self.session = self._session_name()
        self.address = f"{host}:{port}"
        return self.address

    def connect(self, **init_kwargs) -> None:
        """ray.init to this cluster. The cluster uses Ray's token auth, and a driver that joins it
        must have RAY_AUTH_MODE=token in its environment before it imports Ray (read once)."""
        import ray

        if os.environ.get("RAY_AUTH_MODE") != "token":
            raise RuntimeError("set RAY_AUTH_MODE=token before Ray is imported to join a simulated cluster")
        ray.init(address=self.address, **init_kwargs)

    def _session_name(self) -> str:
        latest = self.temp_dir / "session_latest"
        return os.readlink(latest).rsplit("/", 1)[-1] if latest.is_symlink() else self.temp_dir.name

    def worker_nodes(self) -> list[dict]:
        """The alive worker nodes (this process must be connected to the cluster)."""
        import ray

        return [n for n in ray.nodes() if n["Alive"] and not n["Resources"].get("node:__internal_head__")]

    def stop(self) -> None:
        """Stops every process of this cluster's session (head, autoscaler, simulated nodes,
        their workers), and nothing else on the machine."""
        if self.session is None:
            return
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
            pids = self._session_pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self._session_pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        self.session = None

    def _session_pids(self) -> list[int]:
        """This cluster's processes: those with its marker in their environment (Ray's agents
        rename themselves, so command lines do not tell)."""
        me, marker = os.getpid(), f"{MARKER}={self.temp_dir.name}".encode()
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == me:
                continue
            try:
                if marker in (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
        return pids
