"""An Ingress whose engine and tenants' ledger run in this process, without Ray or Serve: the
request pipeline and both adapters exactly as a replica runs them, for the tests whose point is
the serving front (validation, tenants, errors, structured output), not Ray.

    client = InProcessIngress(model_dir, tenants=..., usage_log=...)  # HTTP: client.http.post(...)
    client.grpc("Generate", request, authorization=...) # gRPC: the replica's method, by name
    for message in client.grpc_stream("Generate", request): ...  # each message as it is sent
"""

from __future__ import annotations

import contextlib
import inspect
import queue

import grpc
from fastapi.testclient import TestClient

from cluster.serve.in_process import InProcess
from cluster.serve.ingress import Ingress
from cluster.serve.ledger import TenantLedger
from cluster.serve.llm_server import LLMServer

ENGINE = {"kv_cache_bytes": 128 << 20, "max_num_seqs": 16}


class GrpcCallContext:
    """What a gRPC method sees of its call: metadata in, status code and details out."""

    def __init__(self, metadata: dict[str, str]):
        self._metadata = metadata
        self.code = grpc.StatusCode.OK
        self.details = ""

    def invocation_metadata(self):
        return tuple(self._metadata.items())

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class GrpcError(Exception):
    def __init__(self, context: GrpcCallContext):
        super().__init__(f"{context.code.name}: {context.details}")
        self.code, self.details = context.code, context.details


def call_context(authorization: str | None) -> GrpcCallContext:
    return GrpcCallContext({"authorization": authorization} if authorization else {})


@contextlib.contextmanager
def grpc_error(context: GrpcCallContext):
    """A failed call as the client sees it: GrpcError with the code the method set."""
    try:
        yield
    except Exception as e:
        if context.code != grpc.StatusCode.OK:
            raise GrpcError(context) from e
        raise


class InProcessIngress:
    def __init__(self, model_dir: str, tenants=None, usage_log: str | None = None, engine: dict | None = None,
                 **ingress_args):
        server = InProcess(LLMServer, {"engine_config": {"model": model_dir, **ENGINE, **(engine or {})},
                                       "max_waiting_requests": 32, "request_timeout_s": 300})
        ledger = InProcess(TenantLedger, {"tenants": tenants, "usage_log": usage_log})
        self.ingress = Ingress(server, ledger, tenants=tenants, **ingress_args)
        self.http = TestClient(self.ingress.__serve_build_asgi_app__())
        self.http.__enter__()  # one event loop for the life of the client, as a replica has

    def grpc(self, method: str, request, authorization: str | None = None):
        """Calls the replica's gRPC method on the app's event loop: a list of the messages of a
        streaming method, the response of a unary one; GrpcError with the call's code on failure."""
        call = getattr(self.ingress, method)
        if inspect.isasyncgenfunction(call):
            return list(self.grpc_stream(method, request, authorization))
        context = call_context(authorization)
        takes_context = len(inspect.signature(call).parameters) == 2  # Health and List take the request alone
        with grpc_error(context):
            return self.http.portal.call(call, *((request, context) if takes_context else (request,)))

    def grpc_stream(self, method: str, request, authorization: str | None = None):
        """A streaming method's messages, each as the replica yields it (from any thread)."""
        context = call_context(authorization)
        messages, end = queue.Queue(), object()

        async def run():
            try:
                async for message in getattr(self.ingress, method)(request, context):
                    messages.put(message)
            finally:
                messages.put(end)

        call = self.http.portal.start_task_soon(run)
        while (message := messages.get()) is not end:
            yield message
        with grpc_error(context):
            call.result()

    def close(self) -> None:
        self.http.__exit__(None, None, None)
        self.ingress.__del__()
