"""cluster/serve/grpc_bind.py on Serve's own start_grpc_server, in this process (no Ray cluster)."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve._private import default_impl, grpc_util
from ray.serve.config import gRPCOptions

from cluster.serve import grpc_bind
from cluster.ports import free_port


def unused_handler(*args, **kwargs) -> None:
    """Serve's handler factory, called for each RPC method; no RPC is made here."""


@pytest.fixture
def mended(monkeypatch):
    """The hook's replacements, undone after the test."""
    monkeypatch.setattr(grpc_util, "gRPCGenericServer", grpc_util.gRPCGenericServer)
    monkeypatch.setattr(default_impl, "add_grpc_address", default_impl.add_grpc_address)
    monkeypatch.setenv(grpc_bind.GRPC_HOST_ENV, "127.0.0.1")
    grpc_bind.mend_serve_grpc_servers()


async def start_two_servers_on(port: int) -> None:
    """Starts Serve's gRPC server twice on one port, as two local clusters' Ingress replicas do."""
    servers = []
    try:
        for _ in range(2):
            _, server = await grpc_util.start_grpc_server(
                unused_handler, gRPCOptions(port=port), event_loop=asyncio.get_running_loop())
            servers.append(server)
    finally:
        for server in servers:
            await server.stop(None)


def test_a_second_server_on_a_taken_port_fails_to_bind_so_serve_tries_the_next(mended):
    """Without the mend the second server shares the port (SO_REUSEPORT) and no error is raised."""
    port = free_port()
    with pytest.raises(RuntimeError, match=f"Failed to bind to address 127.0.0.1:{port}"):
        asyncio.run(start_two_servers_on(port))


def test_a_server_that_asks_for_so_reuseport_still_gets_it(mended):
    """Serve's own proxy asks for SO_REUSEPORT where it wants it; the mend keeps that."""
    port = free_port()

    async def bind_twice() -> list[int]:
        servers = [grpc_util.gRPCGenericServer(unused_handler, extra_options=[(grpc_bind.SO_REUSEPORT_OPTION, "1")])
                   for _ in range(2)]
        return [server.add_insecure_port(f"127.0.0.1:{port}") for server in servers]

    assert asyncio.run(bind_twice()) == [port, port]
