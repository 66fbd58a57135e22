"""Ingress: the wire formats in and out. gRPC methods (called by Serve's gRPC proxy by name) and
OpenAI routes (FastAPI) share one path:

    wire request -> validate + tokenize (PromptEncoder) -> GenerationRequest
      -> LLMServer.generate over a streaming deployment handle (or in this process with
         engine_in_ingress: in_process.py) -> RequestDelta stream -> wire

Errors are mapped in one table (`_error_kind`) to HTTP status + OpenAI error JSON and to gRPC
status codes; a client never sees a stack trace.

Work is refused in order of cost: the queue bound first (a request over it gets 429 before its
body is parsed or tokenized), then size, JSON depth and the limits (cluster/serve/limits.py), then
tokenizing, which runs on a thread of its own so that no body stalls the event loop that answers
everyone else (a fast tokenizer is not safe to share between threads, hence one).
"""

# No `from __future__ import annotations` here: FastAPI must see real types on the route methods.
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import math
import re
import time
import uuid

import grpc
from grpc_health.v1 import health_pb2
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from transformers import AutoTokenizer

from cluster.engine.errors import InvalidRequestError
from cluster.engine.media_prompt import MediaPromptEncoder
from cluster.engine.prompt import PromptEncoder
from cluster.engine.sampling_params import SamplingParams
from cluster.serve import grpc_convert
from cluster.serve.errors import (
    DuplicateRequestError,
    EngineOverloadedError,
    QuotaExceededError,
    RequestCancelledError,
    RequestFailedError,
    RequestNotFoundError,
    RequestTimeoutError,
    RequestTooLargeError,
    UnsupportedMediaTypeError,
    WorkerLostError,
)
from cluster.serve.circuit_breaker import CircuitBreaker, CircuitBreakerConfig, CircuitOpenError
from cluster.serve.drain import DrainWatcher, ServerDrainingError, replica_name
from cluster.serve.front_door import FrontDoorFlag
from cluster.serve.in_process import InProcess, LocalHandle
from cluster.serve.ledger import Admission, RequestMeter, RequestSize
from cluster.serve.limits import InputLimits
from cluster.serve.llm_server import GenerationRequest
from cluster.serve.metrics import MediaMetrics
from cluster.serve.tools import calls_as_text, forced_call, offer_tools
from cluster.serve.tenants import ComputeUnitPrices, ForbiddenError, KeyRing, TenantsFile, UnauthenticatedError, bearer_key
from cluster.serve.openai_protocol import (
    ChatCompletionRequest,
    ChatResponseBuilder,
    CompletionRequest,
    CompletionResponseBuilder,
    ResponseBuilder,
    chat_messages,
    error_body,
    refuse_unsupported,
    openai_sampling_params,
)
from model.multimodal import MultimodalSpec
from protos import inference_pb2 as pb

logger = logging.getLogger("pagoda.ingress")

# curl -d sends form-urlencoded and text/plain is what some clients send with a JSON body: both are
# read as JSON, as vLLM and OpenAI do; anything else (a multipart upload, XML) is 415.
JSON_CONTENT_TYPES = ("application/json", "application/x-www-form-urlencoded", "text/plain", "")
HEALTH_SERVICES = ("", pb.DESCRIPTOR.services_by_name["Inference"].full_name)  # "": the server as a whole
HEALTH_TIMEOUT_S = 1.0
TIMEOUT_HEADER = "x-request-timeout-seconds"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

@functools.cache
def _error_table() -> list[tuple[tuple[type, ...], int, str, grpc.StatusCode]]:
    """(exception classes, HTTP status, OpenAI error type, gRPC code), first match wins."""
    from ray.serve.exceptions import BackPressureError

    codes = grpc.StatusCode
    return [
        ((UnauthenticatedError,), 401, "authentication_error", codes.UNAUTHENTICATED),
        ((ForbiddenError,), 403, "permission_error", codes.PERMISSION_DENIED),
        ((RequestTooLargeError,), 413, "invalid_request_error", codes.RESOURCE_EXHAUSTED),
        ((UnsupportedMediaTypeError,), 415, "invalid_request_error", codes.INVALID_ARGUMENT),
        ((InvalidRequestError, ValidationError), 400, "invalid_request_error", codes.INVALID_ARGUMENT),
        ((DuplicateRequestError,), 409, "invalid_request_error", codes.ALREADY_EXISTS),
        ((RequestNotFoundError,), 404, "not_found_error", codes.NOT_FOUND),
        ((RequestCancelledError,), 499, "cancelled", codes.CANCELLED),
        ((QuotaExceededError, EngineOverloadedError, BackPressureError), 429, "rate_limit_error", codes.RESOURCE_EXHAUSTED),
        ((RequestTimeoutError, TimeoutError), 504, "timeout_error", codes.DEADLINE_EXCEEDED),
        ((RequestFailedError,), 500, "internal_error", codes.INTERNAL),
        ((WorkerLostError, ServerDrainingError, CircuitOpenError), 503, "service_unavailable", codes.UNAVAILABLE),
    ]


def _is_backend_failure(exc: BaseException) -> bool:
    """The backend's fault (what a circuit breaker counts), not the client's."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    cause = _cause(exc)
    return isinstance(cause, (WorkerLostError, RequestFailedError, RequestTimeoutError, RayActorError,
                              DeploymentUnavailableError))


def _cause(exc: BaseException) -> BaseException:
    """The error itself: a RayTaskError carries the original as .cause."""
    return getattr(exc, "cause", None) or exc


def _error_kind(exc: BaseException) -> tuple[int, str, grpc.StatusCode, str]:
    """(HTTP status, OpenAI error type, gRPC code, message) for an exception."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    cause = _cause(exc)
    for classes, status, kind, code in _error_table():
        if isinstance(cause, classes):
            return status, kind, code, str(cause) or DEFAULT_MESSAGES.get(status, kind)
    if isinstance(cause, (DeploymentUnavailableError, RayActorError)):
        return 503, "service_unavailable", grpc.StatusCode.UNAVAILABLE, "the model server is unavailable; retry later"
    logger.exception("internal error", exc_info=exc)
    return 500, "internal_error", grpc.StatusCode.INTERNAL, "internal error"


DEFAULT_MESSAGES = {429: "overloaded; retry later", 504: "timed out"}


def _field(exc: BaseException) -> str | None:
    cause = _cause(exc)
    return getattr(cause, "field", None)


def _retry_after(exc: BaseException, status: int) -> dict | None:
    """The Retry-After header of a 429 or 503: the error's own estimate, else a second."""
    if status not in (429, 503):
        return None
    seconds = getattr(_cause(exc), "retry_after_s", None) or 1
    return {"Retry-After": str(math.ceil(seconds))}


def refuse(admission: Admission) -> None:
    """Raise the error of a refused admission (nothing for an admitted one)."""
    if admission.refusal == "quota":
        raise QuotaExceededError(admission.reason, admission.retry_after_s)
    if admission.refusal == "too_large":
        raise InvalidRequestError("max_tokens", admission.reason)
    if admission.refusal == "duplicate":
        raise DuplicateRequestError(admission.reason)


def client_timeout(headers) -> float | None:
    """The client's deadline in seconds (Serve's own `x-request-timeout-seconds` header, which its
    HTTP proxy enforces too); None: the server derives one from the request's size."""
    value = headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidRequestError(TIMEOUT_HEADER, "must be a number of seconds") from None
    if not 0 < seconds < math.inf:
        raise InvalidRequestError(TIMEOUT_HEADER, "must be a positive number of seconds")
    return seconds


def checked_request_id(value: str | None, field: str) -> str:
    """The client's id of a request (scoped by its tenant), or a new one."""
    if not value:
        return uuid.uuid4().hex
    if not REQUEST_ID.fullmatch(value):
        raise InvalidRequestError(field, "must be 1 to 128 characters of A-Z a-z 0-9 . _ : -")
    return value


class Ingress:
    def __init__(self, llm_server, ledger, model_name: str | None = None, limits: dict | None = None,
                 max_pending_requests: int = 256, front_door_dir: str | None = None, encoder_server=None,
                 tenants: TenantsFile | None = None, circuit_breaker: dict | None = None,
                 cors_allowed_origins: list[str] | None = None):
        # The LLMServer in this process (engine_in_ingress, cluster/serve/in_process.py), or None
        self._server = llm_server.build() if isinstance(llm_server, InProcess) else None
        if self._server is not None:
            llm_server = LocalHandle(self._server)
            # Serve looks these up on the replica's object: this replica's health is its engine's,
            # and it scales on its engine's signals (the Ingress deployment takes llm_server's
            # autoscaling_config).
            self.check_health = self._server.check_health
            self.record_autoscaling_stats = self._server.record_autoscaling_stats
        self.llm = llm_server  # DeploymentHandle to LLMServer, or LocalHandle to the one above
        self.cors_allowed_origins = list(cors_allowed_origins or [])  # browsers' origins allowed to call
        # The TenantLedger: admission under the tenants' limits, usage, cancellation by id
        # (cluster/serve/ledger.py). A DeploymentHandle, or LocalHandle to this replica's own.
        self.ledger = LocalHandle(ledger.build()) if isinstance(ledger, InProcess) else ledger
        # tenants and their keys' SHA-256 digests (cluster/serve/tenants.py); None: an open server
        self._keys = KeyRing(tenants.tenants) if tenants else None
        self._prices = tenants.compute_units if tenants else ComputeUnitPrices()
        self._weights = {name: tenant.weight for name, tenant in tenants.tenants.items()} if tenants else {}
        self._replica = replica_name(self)
        # This replica's running requests by (tenant, request_id): their Serve response streams,
        # which a cancellation from the ledger cancels.
        self._streams: dict[tuple[str, str], object] = {}
        self._cancelled: set[tuple[str, str]] = set()
        self._cancellation_watch: asyncio.Task | None = None
        self._cancellation_poll = None  # the ledger call that watch is waiting on
        self._reports: set[asyncio.Task] = set()  # requests' ends on their way to the ledger
        breaker = CircuitBreakerConfig.model_validate(circuit_breaker or {})
        self._llm_breaker = CircuitBreaker("the model server", breaker)
        self._encoder_breaker = CircuitBreaker("the media encoder", breaker)
        # DeploymentHandle to an EncoderServer (encoder: deployment): media is encoded there before
        # the LLMServer sees the request; None: the LLMServer's engine encodes it (colocated).
        self.encoder_server = encoder_server
        self.model_name = model_name
        self.limits = InputLimits.model_validate(limits or {})
        # Requests of this replica not yet streaming (tokenizing, in transit, queued in an engine):
        # beyond the bound, refused at once, before any work is spent on them.
        self.max_pending_requests = max_pending_requests
        self.num_pending_requests = 0
        # With `pagoda serve --front-door`, HAProxy refuses while this replica's queue is full.
        self._front_door = FrontDoorFlag(front_door_dir) if front_door_dir else None
        self.num_in_flight = 0  # requests being answered, streams included (what a drain waits for)
        self._drain = DrainWatcher(replica_name(self), lambda: self.num_in_flight)
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._encoder: PromptEncoder | None = None
        self._media_prompts: MediaPromptEncoder | None = None  # multimodal models only
        self._media_metrics: MediaMetrics | None = None
        self._info: dict | None = None
        self._template_knows_tools = False
        self._init_lock = asyncio.Lock()

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this in the replica once the Ingress exists (serve.ingress() without an app)."""
        return build_fastapi_app(self)

    async def _ready(self) -> PromptEncoder:
        """Ask the LLMServer what it serves once, then tokenize here, off the engine's thread."""
        if self._encoder is None:
            async with self._init_lock:
                if self._encoder is None:
                    info = await self.llm.model_info.remote()
                    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, info["model_dir"])
                    self.model_name = self.model_name or info["model_id"]
                    self._info = info
                    encoder = PromptEncoder(tokenizer, info["vocab_size"], info["max_model_len"])
                    spec = await asyncio.to_thread(MultimodalSpec.from_dir, info["model_dir"])
                    if spec is not None:
                        self._media_prompts = await asyncio.to_thread(
                            MediaPromptEncoder, info["model_dir"], spec, self.limits.media(), encoder.max_prompt_chars)
                        self._media_metrics = MediaMetrics(self.model_name)
                    # a template that reads `tools` is given them; others get them described
                    self._template_knows_tools = "tools" in str(tokenizer.chat_template or "")
                    self._encoder = encoder
        return self._encoder

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant whose key the `Authorization` value holds (None on an open server);
        UnauthenticatedError without a valid one."""
        if self._keys is None:
            return None
        return self._keys.tenant(bearer_key(authorization))

    def authenticate_admin(self, authorization: str | None) -> str | None:
        """As `authenticate`, for an admin's key (403 for another tenant's)."""
        if self._keys is None:
            return None
        return self._keys.admin(bearer_key(authorization))

    def _authenticate_grpc(self, grpc_context) -> str | None:
        metadata = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        return self.authenticate(metadata.get("authorization"))

    @contextlib.contextmanager
    def _admission(self):
        """Holds a place among this replica's pending requests until the first delta (or an
        error); raises ServerDrainingError while draining, EngineOverloadedError at once when
        there is no place."""
        self._drain.check_admission()
        if self.num_pending_requests >= self.max_pending_requests:
            raise EngineOverloadedError.queue_full(self.max_pending_requests)
        self.num_pending_requests += 1
        self._tell_front_door()
        try:
            yield
        finally:
            self.num_pending_requests -= 1
            self._tell_front_door()

    def _tell_front_door(self) -> None:
        # A unix-socket round trip (~0.1 ms), and only when the state flips.
        if self._front_door is not None:
            self._front_door.set_full(self.num_pending_requests >= self.max_pending_requests)

    async def _submit(self, prompt, messages, params, tenant: str | None, request_id: str,
                      cache_salt: str | None = None, timeout_s: float | None = None, tools: list[dict] | None = None):
        """Check the limits, tokenize (and for a multimodal model decode and process its media),
        be admitted by the TenantLedger under the tenant's limits (which may lower max_tokens),
        encode the media on the EncoderServer where there is one, and start streaming deltas.
        Returns (first delta, the rest, the request's meter). The first delta is awaited here, so
        errors that happen before any output (overload, bad input) raise before a response
        starts. The caller holds an `_admission` place."""
        encoder = await self._ready()
        self.limits.check(params, messages)
        loop = asyncio.get_running_loop()
        media = []
        if messages is not None and self._media_prompts is not None:
            token_ids, media = await loop.run_in_executor(self._tokenizer_thread, self._media_prompts.encode, messages)
        else:
            refuse_media(messages)
            token_ids = await loop.run_in_executor(self._tokenizer_thread, encoder.encode, prompt, messages, tools)
        encoder.check(token_ids, params.max_tokens)
        size = RequestSize(len(token_ids), len(media), params.n, params.max_tokens)
        probe = self._llm_breaker.before_call()  # a failing model server: refused here, at once
        try:
            admission = await self.ledger.admit.remote(tenant, request_id, self._replica, size)
            refuse(admission)
        except BaseException:
            self._llm_breaker.forget(probe)
            raise
        self._watch_cancellations()
        meter = RequestMeter(self._prices, len(media), admission.units_limit)
        if admission.max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=admission.max_tokens)
        try:
            if media:
                self._media_metrics.record_items(media)
                if self.encoder_server is not None:
                    media = await self._encode(media)
            request = GenerationRequest(request_id, token_ids, params, timeout_s, media, tenant, cache_salt,
                                        self._weights.get(tenant, 1.0))
            # The deltas come over Serve's gRPC transport, by value, not as Ray objects: a message
            # then skips Ray's object machinery in both processes (docs/benchmarks.md: one served
            # stream's CPU a token on a 2-core node). The prefill's KV references, which must stay
            # Ray objects, never cross this handle.
            stream = self.llm.options(stream=True, _by_reference=False).generate.remote(request)
        except BaseException:
            self._llm_breaker.forget(probe)
            self._finish(tenant, request_id, meter, "error")
            raise
        deltas = self._metered(tenant, request_id, meter, stream, probe)
        # After a last delta the stream simply ends, so callers iterate `deltas` as is.
        return await deltas.__anext__(), deltas, meter

    async def _encode(self, media):
        probe = self._encoder_breaker.before_call()
        try:
            encoded = await self.encoder_server.encode.remote(media)
        except BaseException as e:
            self._encoder_breaker.record(probe, failed=_is_backend_failure(e))
            raise
        self._encoder_breaker.record(probe, failed=False)
        return encoded

    async def _metered(self, tenant: str | None, request_id: str, meter: RequestMeter, stream, probe: bool):
        """The LLMServer's deltas, counted by the meter. A consumer that stops early (client
        gone, request cancelled) cancels the LLMServer call, which aborts the request there: Serve
        would too when the cancellation lands while we wait on the LLMServer, but not when it lands
        while a chunk is being written to the client. A cancellation by the tenant (through the
        ledger) cancels the call the same way and ends the stream with RequestCancelledError.
        At the end, whatever it was, the ledger charges what the meter counted, and the model
        server's circuit breaker learns whether it failed (and how long the first token took)."""
        key = (tenant or "", request_id)
        self._streams[key] = stream
        outcome, failure, started, first_token_s = "abandoned", None, time.monotonic(), None
        try:
            async for delta in stream:
                if first_token_s is None:
                    first_token_s = time.monotonic() - started
                meter.count(delta)
                yield delta
            outcome = "ok"
        except (Exception, asyncio.CancelledError) as e:
            if key in self._cancelled:
                outcome = "cancelled"
                raise RequestCancelledError(f"request {request_id} was cancelled by its tenant") from None
            outcome, failure = ("error", e) if isinstance(e, Exception) else (outcome, None)
            raise
        finally:
            del self._streams[key]
            self._cancelled.discard(key)
            if outcome == "abandoned":
                stream.cancel()
            if outcome == "ok" or (failure is not None and _is_backend_failure(failure)):
                self._llm_breaker.record(probe, failed=outcome != "ok", latency_s=first_token_s)
            else:
                self._llm_breaker.forget(probe)
            self._finish(tenant, request_id, meter, outcome)

    def _finish(self, tenant: str | None, request_id: str, meter: RequestMeter, outcome: str) -> None:
        """Tell the ledger a request ended (charged, logged), without holding up its response."""
        async def tell():
            try:
                await self.ledger.finish.remote(tenant, request_id, meter.usage, outcome)
            except Exception:  # noqa: BLE001 - the ledger forgets it with this replica, if ever
                logger.exception("could not report the end of request %s to the ledger", request_id)

        task = asyncio.get_running_loop().create_task(tell())
        self._reports.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._reports.discard)

    def _watch_cancellations(self) -> None:
        """One long poll of the ledger per replica (from its first request on): the requests
        here that their tenants cancelled. Also this replica's sign of life to the ledger."""
        if self._cancellation_watch is not None and not self._cancellation_watch.done():
            return

        async def watch():
            while True:
                try:
                    self._cancellation_poll = self.ledger.next_cancellations.remote(self._replica)
                    cancelled = await self._cancellation_poll
                except Exception:  # noqa: BLE001 - the ledger restarting: ask again shortly
                    logger.warning("cannot reach the tenant ledger; retrying", exc_info=True)
                    await asyncio.sleep(1.0)
                    continue
                for key in cancelled:
                    stream = self._streams.get(tuple(key))
                    if stream is not None:
                        self._cancelled.add(tuple(key))
                        stream.cancel()

        self._cancellation_watch = asyncio.get_running_loop().create_task(watch())

    def __del__(self):  # Serve calls this on the replica's event loop when the replica stops
        # The long poll is a request in flight at the ledger, and Serve stops a replica only once
        # its requests end: left running, it held the ledger's stop (an app's delete, a redeploy,
        # `pagoda serve`'s exit) up to POLL_TIMEOUT_S, or until Serve killed it.
        if getattr(self, "_cancellation_watch", None) is not None:
            self._cancellation_watch.cancel()
        if getattr(self, "_cancellation_poll", None) is not None:
            self._cancellation_poll.cancel()
        if getattr(self, "_server", None) is not None:
            self._server.shutdown()

    def describe(self) -> dict | None:
        """Its engine's `describe()` where this replica holds one (`pagoda status`'s groups)."""
        return self._server.describe() if self._server is not None else None

    async def running_requests(self, tenant: str | None) -> list[dict]:
        return await self.ledger.requests.remote(tenant)

    async def cancel_request(self, tenant: str | None, request_id: str) -> dict:
        if not await self.ledger.cancel.remote(tenant, request_id):
            raise RequestNotFoundError(f"no running request of yours has id {request_id!r}")
        return {"id": request_id, "object": "request", "cancelled": True}

    # ---- gRPC (method names are the RPC names) ---------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context):
        self.num_in_flight += 1
        try:
            try:
                tenant = self._authenticate_grpc(grpc_context)
                with self._admission():
                    self._check_size(request.ByteSize())
                    prompt, messages = grpc_convert.prompt_or_messages(request)
                    params = grpc_convert.grpc_sampling_params(request.sampling, request.response_format)
                    request_id = checked_request_id(request.request_id, "request_id")
                    first, deltas, meter = await self._submit(prompt, messages, params, tenant, request_id,
                                                              request.cache_salt or None)
            except Exception as e:
                self._set_grpc_error(grpc_context, e)
                raise
            num_unfinished = params.n
            try:
                async for delta in _prepend(first, deltas):
                    num_unfinished -= bool(delta.finished)
                    # the last message of the request carries what it cost
                    yield grpc_convert.response(delta, meter if num_unfinished == 0 else None)
            except Exception as e:
                self._set_grpc_error(grpc_context, e)
                raise
        finally:
            self.num_in_flight -= 1

    async def Cancel(self, request: pb.CancelRequest, grpc_context) -> pb.CancelResponse:
        try:
            await self.cancel_request(self._authenticate_grpc(grpc_context), request.request_id)
        except Exception as e:
            self._set_grpc_error(grpc_context, e)
            raise
        return pb.CancelResponse(request_id=request.request_id)

    async def ListRequests(self, request: pb.ListRequestsRequest, grpc_context) -> pb.RequestList:
        try:
            running = await self.running_requests(self._authenticate_grpc(grpc_context))
        except Exception as e:
            self._set_grpc_error(grpc_context, e)
            raise
        return pb.RequestList(requests=[pb.RunningRequest(request_id=r["id"], created=r["created"]) for r in running])

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context) -> pb.ModelInfo:
        try:
            self._authenticate_grpc(grpc_context)
            await self._ready()
        except Exception as e:
            self._set_grpc_error(grpc_context, e)
            raise
        return grpc_convert.model_info(self._info)

    async def Health(self, request: pb.HealthRequest) -> pb.HealthResponse:
        try:
            await self._ready()
            serving = await self._model_server_serving()
            return pb.HealthResponse(healthy=serving, status="ok" if serving else "the model server is not serving")
        except Exception as e:  # the proxy must get an answer, not an error
            return pb.HealthResponse(healthy=False, status=_error_kind(e)[3])

    # grpc.health.v1.Health: what Kubernetes gRPC probes, grpc_health_probe and load balancers call.
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
        serving = not self._drain.draining and await self._model_server_serving()
        return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

    async def _model_server_serving(self) -> bool:
        """Asks a model server replica itself: a cached answer would say healthy after it died.
        With none running, Serve holds the call until one is; the timeout turns that into no."""
        try:
            return await asyncio.wait_for(self.llm.is_serving.remote(), timeout=HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - gone, restarting, timed out: all are "not serving"
            return False

    def _check_size(self, num_bytes: int) -> None:
        if num_bytes > self.limits.max_request_bytes:
            raise RequestTooLargeError(f"the request is {num_bytes} bytes; the cap is {self.limits.max_request_bytes} bytes")

    @staticmethod
    def _set_grpc_error(grpc_context, exc: BaseException) -> None:
        _, _, code, message = _error_kind(exc)
        grpc_context.set_code(code)
        grpc_context.set_details(message)

    # ---- OpenAI HTTP ------------------------------------------------------------------------

    async def health(self):
        """Open to all (probes carry no key): ready or not, and which model."""
        await self._ready()
        return {"status": "ok", "model": self.model_name}

    async def models(self):
        await self._ready()
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "pagoda",
            "max_model_len": self._info["max_model_len"],
        }]}

    async def stats(self):
        """One engine's statistics (and, where media is encoded by an EncoderServer, one of its
        replicas' encoder statistics under "encoder", as a colocated engine reports its own)."""
        stats = await self.llm.stats.remote()
        if self.encoder_server is not None:
            stats["encoder"] = await self.encoder_server.stats.remote()
        # this ingress replica's breakers
        stats["circuit_breakers"] = {"LLMServer": self._llm_breaker.describe()}
        if self.encoder_server is not None:
            stats["circuit_breakers"]["EncoderServer"] = self._encoder_breaker.describe()
        return stats

    async def status(self):
        """Deployments and their replicas (from Serve), every engine group with its ranks and
        where they run, plus one engine's statistics."""
        import ray
        from ray import serve

        from cluster.serve.autoscaling import last_decision
        from cluster.serve.topology import describe_groups

        app_name = serve.get_replica_context().app_name
        app_status = serve.status().applications.get(app_name)
        deployments = {
            name: {"status": str(d.status.value if hasattr(d.status, "value") else d.status),
                   "replicas": dict(d.replica_states),
                   "autoscaling": last_decision(app_name, name)}  # None: a fixed count or Serve's policy
            for name, d in (app_status.deployments.items() if app_status else [])
        }
        groups = await asyncio.to_thread(describe_groups, app_name)
        nodes = await asyncio.to_thread(lambda: sum(node["Alive"] for node in ray.nodes()))
        return {"app": app_name, "deployments": deployments, "groups": groups, "nodes": nodes,
                "engine": await self.stats(), "model": self.model_name}

    async def completions(self, raw: Request, tenant: str | None = None):
        return await self._openai(raw, tenant, CompletionRequest, self._completion_inputs, CompletionResponseBuilder)

    async def chat_completions(self, raw: Request, tenant: str | None = None):
        return await self._openai(raw, tenant, ChatCompletionRequest, self._chat_inputs, ChatResponseBuilder)

    async def _openai(self, raw: Request, tenant: str | None, model_cls, inputs, builder_cls: type[ResponseBuilder]):
        """One OpenAI route: its request model, how it becomes engine inputs, how answers look."""
        self.num_in_flight += 1
        streaming = False
        try:
            response = await self._openai_response(raw, tenant, model_cls, inputs, builder_cls)
            streaming = isinstance(response, StreamingResponse)  # its body counts itself out
            return response
        finally:
            if not streaming:
                self.num_in_flight -= 1

    async def _openai_response(self, raw: Request, tenant: str | None, model_cls, inputs,
                               builder_cls: type[ResponseBuilder]):
        try:
            await self._ready()
        except Exception as e:
            status, kind_name, _, message = _error_kind(e)
            return _http_error(status, message, kind_name)
        try:
            with self._admission():
                body = await self._read_json(raw)
                refuse_unsupported(body)
                request = model_cls.model_validate(body)
                given = inputs(request)
                params, want_logprobs = given.params, given.want_logprobs
                request_id = checked_request_id(request.request_id or raw.headers.get("x-request-id"), "request_id")
                first, deltas, meter = await self._submit(given.prompt, given.messages, params, tenant, request_id,
                                                          request.cache_salt or None, client_timeout(raw.headers),
                                                          given.template_tools)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"])
            return _http_error(400, f"{param}: {err['msg']}", "invalid_request_error", param)
        except Exception as e:
            status, kind_name, _, message = _error_kind(e)
            return _http_error(status, message, kind_name, _field(e), _retry_after(e, status))
        builder = builder_cls(self.model_name, params.n, self._decode_token, request_id, meter)
        builder.tools = given.tools
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(
                self._sse(first, deltas, builder, want_logprobs, include_usage),
                media_type="text/event-stream",
            )
        builder.add(first)
        try:
            async for delta in deltas:
                builder.add(delta)
        except Exception as e:
            status, kind_name, _, message = _error_kind(e)
            return _http_error(status, message, kind_name)
        return builder.final(want_logprobs)

    async def _read_json(self, raw: Request):
        """The body as JSON, read only up to the size cap; errors name what is wrong."""
        content_type = raw.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if content_type not in JSON_CONTENT_TYPES:
            raise UnsupportedMediaTypeError(f"the body must be JSON (content-type application/json), got {content_type}")
        length = raw.headers.get("content-length")
        if length is not None and length.isdigit():
            self._check_size(int(length))
        body = bytearray()
        async for chunk in raw.stream():
            body += chunk
            self._check_size(len(body))
        try:
            parsed = json.loads(body)
        except RecursionError:
            raise InvalidRequestError("body", f"the JSON is nested deeper than {self.limits.max_json_depth} levels") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequestError("body", f"the body is not valid JSON: {e}") from None
        self.limits.check_json_depth(parsed)
        return parsed

    def _completion_inputs(self, request: CompletionRequest) -> "EngineInputs":
        params = openai_sampling_params(request, 16, request.logprobs)
        return EngineInputs(request.prompt, None, params, request.logprobs is not None)

    def _chat_inputs(self, request: ChatCompletionRequest):
        messages = chat_messages(request)
        if request.max_completion_tokens is not None and request.max_tokens is None:
            request.max_tokens = request.max_completion_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        # Chat answers run until EOS by default, bounded by the context like OpenAI's API.
        params = openai_sampling_params(request, None, logprobs)
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
        if not tools or request.tool_choice == "none":
            return EngineInputs(None, messages if self._template_knows_tools else calls_as_text(messages),
                                params, request.logprobs)
        forced = forced_call(tools, request.tool_choice or "auto")
        if forced is not None:
            if params.structured_output is not None:
                raise InvalidRequestError("response_format", "cannot be given with a tool_choice that forces a call")
            params = dataclasses.replace(params, structured_output=forced)
        if request.stream:
            raise InvalidRequestError("stream", "answers that may be tool calls are sent whole; send stream: false")
        messages, template_tools = offer_tools(messages, tools, self._template_knows_tools)
        return EngineInputs(None, messages, params, request.logprobs, tools, template_tools)

    def _decode_token(self, token_id: int) -> str:
        return self._encoder.tokenizer.decode([token_id])

    async def _sse(self, first, deltas, builder, want_logprobs, include_usage):
        def event(payload) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        try:
            builder.add(first)
            yield event(builder.chunk(first, want_logprobs))
            try:
                async for delta in deltas:
                    builder.add(delta)
                    yield event(builder.chunk(delta, want_logprobs))
            except Exception as e:  # the status line has gone out: report in the stream, then end it
                status, kind_name, _, message = _error_kind(e)
                yield event(error_body(message, kind_name))
                return
            if include_usage:
                yield event(builder.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            self.num_in_flight -= 1


@dataclasses.dataclass(slots=True)
class EngineInputs:
    """What an OpenAI request becomes for the engine, and for its answer."""

    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    want_logprobs: bool | int | None
    tools: list[dict] | None = None  # offered to the model: its answer may be parsed into tool_calls
    template_tools: list[dict] | None = None  # for a chat template that reads `tools` itself


def refuse_media(messages: list[dict] | None) -> None:
    """A text-only model: an image or audio part is refused, naming it."""
    for message in messages or ():
        if isinstance(message.get("content"), list):
            for part in message["content"]:
                if part.get("type") != "text":
                    raise InvalidRequestError(part["where"], f"{part['type']} parts need a multimodal model; "
                                              "the model served here takes text only")


async def _prepend(first, rest):
    yield first
    async for item in rest:
        yield item


def _http_error(status: int, message: str, kind: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param), status_code=status, headers=headers)


def build_fastapi_app(ingress: Ingress) -> FastAPI:
    """The HTTP routes of one replica's Ingress (built in the replica, after the Ingress, by its
    __serve_build_asgi_app__: no FastAPI app object goes through Ray's pickling). CORS is off
    unless origins are configured."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    app = FastAPI(title="Pagoda", description="OpenAI-compatible API of Pagoda")

    # Errors that FastAPI and Starlette answer themselves (no such route, wrong method) are OpenAI
    # error JSON too, like every other error.
    @app.exception_handler(HTTPException)
    async def http_exception(_, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return _http_error(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_exception(_, exc: RequestValidationError):
        return _http_error(422, str(exc.errors()[0].get("msg", "invalid request")), "invalid_request_error")

    # A refused key or an unknown request id is answered here (Starlette's handler for a class of
    # its own), not by the catch-all below, which Starlette re-raises after answering: Serve would
    # log a traceback for every request without a key.
    async def client_error(_, exc: Exception):
        status, kind, _, message = _error_kind(exc)
        return _http_error(status, message, kind, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)

    app.add_exception_handler(PermissionError, client_error)
    app.add_exception_handler(RequestNotFoundError, client_error)

    @app.exception_handler(Exception)
    async def unexpected_exception(_, exc: Exception):
        status, kind, _, message = _error_kind(exc)
        return _http_error(status, message, kind)

    if ingress.cors_allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=ingress.cors_allowed_origins,
                           allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id", TIMEOUT_HEADER])

    def tenant(authorization: str | None = Header(None)) -> str | None:
        """Every route but /health: the caller's tenant, from its key (401 without one)."""
        return ingress.authenticate(authorization)

    def admin(authorization: str | None = Header(None)) -> str | None:
        """The cluster's internals (pids, node addresses): an admin's key (403 for a tenant's)."""
        return ingress.authenticate_admin(authorization)

    @app.get("/health")
    async def health():
        return await ingress.health()

    @app.get("/v1/models", dependencies=[Depends(tenant)])
    async def models():
        return await ingress.models()

    @app.get("/v1/pagoda/stats", dependencies=[Depends(tenant)])
    async def stats():
        return await ingress.stats()

    @app.get("/v1/pagoda/status", dependencies=[Depends(admin)])
    async def status():
        return await ingress.status()

    @app.get("/v1/pagoda/requests")
    async def running_requests(caller: str | None = Depends(tenant)):
        """The caller's tenant's running requests (ids scoped by tenant)."""
        return {"object": "list", "data": await ingress.running_requests(caller)}

    @app.delete("/v1/pagoda/requests/{request_id}")
    async def cancel_request(request_id: str, caller: str | None = Depends(tenant)):
        """Stop one of the caller's tenant's requests: its stream ends with a `cancelled` error."""
        return await ingress.cancel_request(caller, request_id)

    @app.post("/v1/completions")
    async def completions(raw: Request, caller: str | None = Depends(tenant)):
        return await ingress.completions(raw, caller)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request, caller: str | None = Depends(tenant)):
        return await ingress.chat_completions(raw, caller)

    return app
