"""Serve's gRPC servers on the host asked for, each on a port of its own.

Two faults of Ray Serve 2.60's gRPC servers (the proxy's and each Ingress replica's direct-ingress
server), mended in every Ray worker process of a local cluster by this module's hook, which
`pagoda serve` installs as the job's worker_process_setup_hook (before any server starts):

- Every interface: start_grpc_server binds `[::]:PORT` whatever the HTTP host (it has no host
  option), so a server started for 127.0.0.1 answered gRPC on every address of the machine. The
  hook narrows the address to the host in PAGODA_GRPC_HOST.
- A shared port: Serve asks gRPC not to set SO_REUSEPORT with the option's value as a string
  ("0"); gRPC reads only integers there and falls back to its default, which sets it. So a second
  local cluster's Ingress replica bound the same direct-ingress port (40000) as the first without
  an error, and the kernel split HAProxy's gRPC connections between two servers' replicas. The
  hook passes the value as the integer gRPC reads, so the bind fails and Serve tries the next port.

Serve looks both names up when it starts a server, so the replaced ones are used.
"""

from __future__ import annotations

import os

GRPC_HOST_ENV = "PAGODA_GRPC_HOST"
SETUP_HOOK = "cluster.serve.grpc_bind.mend_serve_grpc_servers"
SO_REUSEPORT_OPTION = "grpc.so_reuseport"


def mend_serve_grpc_servers() -> None:
    honour_so_reuseport()
    host = os.environ.get(GRPC_HOST_ENV)
    if host:
        bind_to_host(host)


def honour_so_reuseport() -> None:
    from ray.serve._private import grpc_util

    serves_own = grpc_util.gRPCGenericServer

    class gRPCGenericServer(serves_own):
        def __init__(self, service_handler_factory, *, extra_options=None):
            options = [(name, int(value)) if name == SO_REUSEPORT_OPTION else (name, value)
                       for name, value in extra_options or []]
            super().__init__(service_handler_factory, extra_options=options)

    grpc_util.gRPCGenericServer = gRPCGenericServer


def bind_to_host(host: str) -> None:
    from ray.serve._private import default_impl

    serves_own = default_impl.add_grpc_address

    def add_grpc_address(server, address: str) -> None:
        port = address.rsplit(":", 1)[1]
        serves_own(server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    default_impl.add_grpc_address = add_grpc_address


def runtime_env(host: str) -> dict:
    """The job runtime_env of a local cluster whose gRPC servers listen on `host` only."""
    return {"worker_process_setup_hook": SETUP_HOOK, "env_vars": {GRPC_HOST_ENV: host}}
