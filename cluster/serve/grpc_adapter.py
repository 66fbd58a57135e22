"""The gRPC adapter: pagoda.v1.Inference and grpc.health.v1.Health over the RequestPipeline.

Serve's gRPC proxy calls a replica's methods by their RPC names, so the Ingress deployment class
takes these methods (it subclasses GrpcService). Each RPC is one pipeline call between two
conversions (grpc_convert.py); errors go through the one table (error_table.py).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc_health.v1 import health_pb2

from cluster.serve import grpc_convert
from cluster.serve.error_table import wire_error
from cluster.serve.pipeline import GenerateInputs, RequestPipeline
from protos import inference_pb2 as pb

HEALTH_SERVICES = ("", pb.DESCRIPTOR.services_by_name["Inference"].full_name)  # "": the server as a whole
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@contextlib.contextmanager
def grpc_errors(grpc_context):
    """An error of the call becomes its status code and details (the proxy sends them)."""
    try:
        yield
    except Exception as e:
        error = wire_error(e)
        grpc_context.set_code(error.code)
        grpc_context.set_details(error.message)
        raise


class GrpcService:
    pipeline: RequestPipeline

    def _tenant(self, grpc_context) -> str | None:
        metadata = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        return self.pipeline.authenticate(metadata.get("authorization"))

    # ---- pagoda.v1.Inference -----------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context):
        async def read(_model) -> GenerateInputs:
            self.pipeline.check_size(request.ByteSize())
            prompt, messages = grpc_convert.prompt_or_messages(request)
            return GenerateInputs(prompt, messages,
                                  grpc_convert.grpc_sampling_params(request.sampling, request.response_format),
                                  request_id=request.request_id, cache_salt=request.cache_salt or None)

        with grpc_errors(grpc_context):
            generation = await self.pipeline.generate(self._tenant(grpc_context), read)
            num_unfinished = generation.params.n
            async with contextlib.aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    num_unfinished -= bool(delta.finished)
                    # the last message of the request carries what it cost
                    yield grpc_convert.response(delta, generation.meter if num_unfinished == 0 else None)

    async def Cancel(self, request: pb.CancelRequest, grpc_context) -> pb.CancelResponse:
        with grpc_errors(grpc_context):
            await self.pipeline.cancel(self._tenant(grpc_context), request.request_id)
        return pb.CancelResponse(request_id=request.request_id)

    async def ListRequests(self, request: pb.ListRequestsRequest, grpc_context) -> pb.RequestList:
        with grpc_errors(grpc_context):
            running = await self.pipeline.running_requests(self._tenant(grpc_context))
        return pb.RequestList(requests=[pb.RunningRequest(request_id=r["id"], created=r["created"]) for r in running])

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context) -> pb.ModelInfo:
        with grpc_errors(grpc_context):
            self._tenant(grpc_context)
            model = await self.pipeline.model()
        return grpc_convert.model_info(model.info)

    async def Health(self, request: pb.HealthRequest) -> pb.HealthResponse:
        try:
            await self.pipeline.model()
            serving = await self.pipeline.serving()
            return pb.HealthResponse(healthy=serving, status="ok" if serving else "the model server is not serving")
        except Exception as e:  # the proxy must get an answer, not an error
            return pb.HealthResponse(healthy=False, status=wire_error(e).message)

    # ---- grpc.health.v1.Health: what Kubernetes gRPC probes, grpc_health_probe and load balancers call

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context) -> health_pb2.HealthCheckResponse:
        if request.service not in HEALTH_SERVICES:  # the protocol's answer for a service it does not know
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}; this server has {', '.join(HEALTH_SERVICES[1:])}")
            raise ValueError(request.service)
        return health_pb2.HealthCheckResponse(status=await self._serving_status())

    async def List(self, request: health_pb2.HealthListRequest) -> health_pb2.HealthListResponse:
        status = health_pb2.HealthCheckResponse(status=await self._serving_status())
        return health_pb2.HealthListResponse(statuses={service: status for service in HEALTH_SERVICES})

    async def Watch(self, request: health_pb2.HealthCheckRequest):
        """The status now, then each change (looked at every second) until the client leaves."""
        last = None
        while True:
            status = (await self._serving_status() if request.service in HEALTH_SERVICES
                      else health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(1.0)

    async def _serving_status(self) -> int:
        return SERVING if await self.pipeline.serving() else NOT_SERVING
