"""An Ingress whose engine and tenants' ledger run in this process, without Ray or Serve: the
request pipeline and both adapters exactly as a replica runs them, for the tests whose point is
the serving front (validation, tenants, errors, structured output), not Ray.

    client = InProcessIngress(model_dir, tenants=...)   # HTTP: client.http.post(...)
    client.grpc("Generate", request, authorization=...) # gRPC: the replica's method, by name
"""

from __future__ import annotations


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


class InProcessIngress:
    def __init__(self, model_dir: str, tenants=None, engine: dict | None = None, **ingress_args):
        server = InProcess(LLMServer, {"engine_config": {"model": model_dir, **ENGINE, **(engine or {})},
                                       "max_waiting_requests": 32, "request_timeout_s": 300})
        self.ingress = Ingress(server, InProcess(TenantLedger, {"tenants": tenants}), tenants=tenants, **ingress_args)
        self.http = TestClient(self.ingress.__serve_build_asgi_app__())
        self.http.__enter__()  # one event loop for the life of the client, as a replica has

    def grpc(self, method: str, request, authorization: str | None = None):
        """Calls the replica's gRPC method on the app's event loop: a list of the messages of a
        streaming method, the response of a unary one; GrpcError with the call's code on failure."""
        context = GrpcCallContext({"authorization": authorization} if authorization else {})
        call = getattr(self.ingress, method)

        async def run():
            result = call(request, context)
            if hasattr(result, "__aiter__"):
                return [message async for message in result]
            return await result

        try:
            return self.http.portal.call(run)
        except Exception as e:
            if context.code != grpc.StatusCode.OK:
                raise GrpcError(context) from e
            raise

    def close(self) -> None:
        self.http.__exit__(None, None, None)
        self.ingress.__del__()
