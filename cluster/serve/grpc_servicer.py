"""The servicer functions given to Serve's gRPC proxy (gRPCOptions.grpc_servicer_functions).

They register pagoda.v1.Inference like the generated `add_InferenceServicer_to_server`, and
grpc.health.v1.Health (answered by the Ingress, which asks a model server replica), and make
client cancellation of a streaming call reach the replicas.

Why: Serve 2.60's proxy streams a call through an async generator that catches BaseException
around its `yield`. When grpc cancels the call while a response is being written (the client
cancelled, or its deadline passed), the generator is closed at that `yield`, swallows the
GeneratorExit ("async generator ignored GeneratorExit"), and never cancels the request it made to
the Ingress replica, so the model keeps generating for nobody. Measured: 3 of 10 cancels lost.

The fix: the proxy's generator runs in a task of its own that only ever waits on the replica, and
the handler grpc sees reads from a queue. Whatever way grpc stops the handler, the handler's
`finally` cancels that task while it waits on the replica, which the proxy does handle: it
cancels the replica call, and the Ingress and the LLMServer abort.

Bytes that do not parse as the method's request message: grpc runs the registered deserializer
before any handler, and the generated one raises, which grpc answers UNKNOWN with the Python class
name. The proxy keeps the deserializer it is given, so Pagoda registers its own (from the service
descriptor): a message that does not parse becomes an UndecodableRequest, which the handler
answers INVALID_ARGUMENT with a plain message, without calling a replica.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.message import DecodeError

from protos import inference_pb2 as pb
from protos.inference_pb2_grpc import add_InferenceServicer_to_server

_END = object()
SERVICE = pb.DESCRIPTOR.services_by_name["Inference"]


class UndecodableRequest:
    """A request whose bytes did not parse as `message` (a full protobuf name)."""

    def __init__(self, message: str):
        self.message = message

    @property
    def details(self) -> str:
        return f"the request is not a valid {self.message} message: its bytes do not parse"


def add_inference_servicer(servicer, server) -> None:
    """Serve calls this in its proxy with a stand-in servicer and its own gRPC server, whose
    `service_handler_factory` makes the handlers that forward calls to replicas."""
    _register_with_pagoda_handlers(server, add_InferenceServicer_to_server, SERVICE, pb, servicer)


def add_health_servicer(servicer, server) -> None:
    """grpc.health.v1.Health (Kubernetes gRPC probes, grpc_health_probe, load balancers), forwarded
    to the Ingress's Check and Watch like Inference's methods, so it answers for the model server."""
    from grpc_health.v1 import health_pb2
    from grpc_health.v1.health_pb2_grpc import add_HealthServicer_to_server

    service = health_pb2.DESCRIPTOR.services_by_name["Health"]
    _register_with_pagoda_handlers(server, add_HealthServicer_to_server, service, health_pb2, servicer)


def _register_with_pagoda_handlers(server, add_generated, service, messages, servicer) -> None:
    make_handler = getattr(server, "service_handler_factory", None)
    if make_handler is None:  # not Serve's proxy server: register as generated
        add_generated(servicer, server)
        return

    def make_cancellable_handler(service_method, streaming_type):
        handler = make_handler(service_method=service_method, streaming_type=streaming_type)
        if streaming_type.name == "UNARY_STREAM":
            return _refuse_undecodable_stream(_cancel_replica_call_when_grpc_stops(handler))
        if streaming_type.name == "UNARY_UNARY":
            return _refuse_undecodable_unary(handler)
        return handler

    server.service_handler_factory = make_cancellable_handler
    try:
        _add_lenient_servicer(servicer, server, service, messages)
    finally:
        server.service_handler_factory = make_handler


def _add_lenient_servicer(servicer, server, service, messages) -> None:
    """The generated add_*Servicer_to_server of `service` (its messages in the module `messages`),
    with deserializers that turn bad bytes into UndecodableRequest."""
    handlers = {}
    for method in service.methods:
        request_cls, response_cls = getattr(messages, method.input_type.name), getattr(messages, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=_lenient(request_cls),
                                     response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _lenient(message_cls):
    def deserialize(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError:
            return UndecodableRequest(message_cls.DESCRIPTOR.full_name)

    return deserialize


def _refuse_undecodable_unary(handler):
    async def unary_unary(request, context):
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return await handler(request, context)

    return unary_unary


def _refuse_undecodable_stream(handler):
    async def unary_stream(request, context):
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        await handler(request, context)

    return unary_stream


def _cancel_replica_call_when_grpc_stops(handler):
    async def unary_stream(request, context):
        # A coroutine that writes with context.write (grpc's reader/writer form), not a generator:
        # grpc then cancels this coroutine itself, and its `finally` runs while the call is still
        # open. (A generator dropped by grpc is closed later, when the call's context is gone;
        # the proxy reads that context as it finishes, which crashed the proxy in a first try.)
        # Unbounded on purpose: a bounded put() would be a second place for the pump to wait,
        # and a cancel landing there would be lost again. Token messages are small.
        messages: asyncio.Queue = asyncio.Queue()

        async def pump():
            try:
                async for message in handler(request, context):
                    messages.put_nowait(message)
            finally:
                messages.put_nowait(_END)

        task = asyncio.create_task(pump())
        try:
            while (message := await messages.get()) is not _END:
                await context.write(message)
        finally:
            task.cancel()
            await asyncio.wait([task])
        task.result()  # an error in the proxy's handler is this call's error

    return unary_stream
