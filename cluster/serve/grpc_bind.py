"""Serve's gRPC proxy on the host asked for, not on every interface.

Ray Serve 2.60 binds its gRPC proxy to `[::]:PORT` whatever the HTTP host (start_grpc_server has no
host option), so a server started for 127.0.0.1 answered gRPC on every address of the machine.
`pagoda serve` starts its local Ray cluster with this module's hook as the job's
worker_process_setup_hook and the host in PAGODA_GRPC_HOST: in each Ray worker process, before
the proxy actor starts its gRPC server, the hook narrows the address Serve binds to that host.
Serve looks the binding function up when it starts the server, so the narrowed one is used.
"""

from __future__ import annotations

import os

GRPC_HOST_ENV = "PAGODA_GRPC_HOST"
SETUP_HOOK = "cluster.serve.grpc_bind.bind_grpc_proxy_to_host"


def bind_grpc_proxy_to_host() -> None:
    host = os.environ.get(GRPC_HOST_ENV)
    if not host:
        return
    from ray.serve._private import default_impl

    serves_own = default_impl.add_grpc_address

    def add_grpc_address(server, address: str) -> None:
        port = address.rsplit(":", 1)[1]
        serves_own(server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    default_impl.add_grpc_address = add_grpc_address


def runtime_env(host: str) -> dict:
    """The job runtime_env of a local cluster whose gRPC proxy listens on `host` only."""
    return {"worker_process_setup_hook": SETUP_HOOK, "env_vars": {GRPC_HOST_ENV: host}}
