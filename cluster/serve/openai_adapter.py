"""The OpenAI adapter: the HTTP routes (FastAPI), their request bodies, SSE, over the RequestPipeline.

    POST /v1/completions, /v1/chat/completions   body -> GenerateInputs -> pipeline -> JSON or SSE
    GET  /v1/models, /health, /v1/pagoda/stats, /v1/pagoda/status (admin)
    GET  /v1/pagoda/requests, DELETE /v1/pagoda/requests/{id}

The app is built in the replica, after the Ingress (Ingress.__serve_build_asgi_app__): no FastAPI
app object goes through Ray's pickling. Every error, the framework's own included, is OpenAI
error JSON from the one table (error_table.py).
"""

# No `from __future__ import annotations` here: FastAPI must see real types on the route functions.
import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Awaitable, Callable

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.engine.errors import InvalidRequestError
from cluster.serve.error_table import WireError, wire_error
from cluster.serve.errors import UnsupportedMediaTypeError
from cluster.serve.openai_protocol import (
    ChatCompletionRequest,
    ChatResponseBuilder,
    CompletionRequest,
    CompletionResponseBuilder,
    ResponseBuilder,
    chat_messages,
    error_body,
    openai_sampling_params,
    refuse_unsupported,
)
from cluster.serve.pipeline import TIMEOUT_HEADER, Generation, GenerateInputs, RequestPipeline
from cluster.serve.served_model import ServedModel
from cluster.serve.tools import calls_as_text, forced_call, offer_tools

# curl -d sends form-urlencoded and text/plain is what some clients send with a JSON body: both are
# read as JSON, as vLLM and OpenAI do; anything else (a multipart upload, XML) is 415.
JSON_CONTENT_TYPES = ("application/json", "application/x-www-form-urlencoded", "text/plain", "")


@dataclasses.dataclass(slots=True)
class OpenAIRequest:
    """A parsed body: what the pipeline gets, and what the answer needs of the request."""

    body: CompletionRequest | ChatCompletionRequest
    inputs: GenerateInputs
    want_logprobs: bool
    tools: list[dict] | None = None  # offered to the model: its answer may be parsed into tool_calls


def _inputs(raw: Request, body, prompt, messages, params, template_tools: list[dict] | None = None) -> GenerateInputs:
    return GenerateInputs(prompt, messages, params, request_id=body.request_id or raw.headers.get("x-request-id"),
                          cache_salt=body.cache_salt or None, timeout=raw.headers.get(TIMEOUT_HEADER), model=body.model,
                          template_tools=template_tools)


def error_response(error: WireError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.type, error.param, error.openai_code),
                        status_code=error.status, headers=error.http_headers())


class OpenAIService:
    def __init__(self, pipeline: RequestPipeline):
        self.pipeline = pipeline

    async def health(self) -> dict:
        """Open to all (probes carry no key): ready or not, and which model."""
        return {"status": "ok", "model": (await self.pipeline.model()).name}

    async def models(self) -> dict:
        model = await self.pipeline.model()
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0, "owned_by": "pagoda",
                                            "max_model_len": model.info["max_model_len"]}]}

    async def completions(self, raw: Request, tenant: str | None):
        async def read(_model: ServedModel) -> OpenAIRequest:
            request = CompletionRequest.model_validate(await self._read_json(raw))
            params = openai_sampling_params(request, 16, request.logprobs)
            return OpenAIRequest(request, _inputs(raw, request, request.prompt, None, params), request.logprobs is not None)

        return await self._answer(tenant, read, CompletionResponseBuilder)

    async def chat_completions(self, raw: Request, tenant: str | None):
        async def read(model: ServedModel) -> OpenAIRequest:
            request = ChatCompletionRequest.model_validate(await self._read_json(raw))
            messages = chat_messages(request)
            if request.max_completion_tokens is not None and request.max_tokens is None:
                request.max_tokens = request.max_completion_tokens
            # Chat answers run until EOS by default, bounded by the context like OpenAI's API.
            params = openai_sampling_params(request, None, (request.top_logprobs or 0) if request.logprobs else None)
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
            if not tools or request.tool_choice == "none":
                messages = messages if model.template_knows_tools else calls_as_text(messages)
                return OpenAIRequest(request, _inputs(raw, request, None, messages, params), request.logprobs)
            forced = forced_call(tools, request.tool_choice or "auto")
            if forced is not None:
                if params.structured_output is not None:
                    raise InvalidRequestError("response_format", "cannot be given with a tool_choice that forces a call")
                params = dataclasses.replace(params, structured_output=forced)
            if request.stream:
                raise InvalidRequestError("stream", "answers that may be tool calls are sent whole; send stream: false")
            messages, template_tools = offer_tools(messages, tools, model.template_knows_tools)
            return OpenAIRequest(request, _inputs(raw, request, None, messages, params, template_tools),
                                 request.logprobs, tools)

        return await self._answer(tenant, read, ChatResponseBuilder)

    async def _answer(self, tenant: str | None, read: Callable[[ServedModel], Awaitable["OpenAIRequest"]],
                      builder_cls: type[ResponseBuilder]):
        """One generation route: `read` parses the body, inside the pipeline's admission."""
        parsed: OpenAIRequest | None = None

        async def read_inputs(model: ServedModel) -> GenerateInputs:
            nonlocal parsed
            parsed = await read(model)
            return parsed.inputs

        try:
            generation = await self.pipeline.generate(tenant, read_inputs)
        except Exception as e:
            return error_response(wire_error(e))
        builder = builder_cls(generation.model.name, generation.params.n, generation.model.decode_token,
                              generation.request_id, generation.meter)
        builder.tools = parsed.tools
        if parsed.body.stream:
            options = parsed.body.stream_options
            return StreamingResponse(_sse(generation, builder, parsed.want_logprobs, bool(options and options.include_usage)),
                                     media_type="text/event-stream")
        try:
            async with contextlib.aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    builder.add(delta)
        except Exception as e:
            return error_response(wire_error(e))
        return builder.final(parsed.want_logprobs)

    async def _read_json(self, raw: Request):
        """The body as JSON, read only up to the size cap; errors name what is wrong."""
        content_type = raw.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if content_type not in JSON_CONTENT_TYPES:
            raise UnsupportedMediaTypeError(f"the body must be JSON (content-type application/json), got {content_type}")
        length = raw.headers.get("content-length")
        if length is not None and length.isdigit():
            self.pipeline.check_size(int(length))
        body = bytearray()
        async for chunk in raw.stream():
            body += chunk
            self.pipeline.check_size(len(body))
        limits = self.pipeline.limits
        try:
            parsed = json.loads(body)
        except RecursionError:
            raise InvalidRequestError("body", f"the JSON is nested deeper than {limits.max_json_depth} levels") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequestError("body", f"the body is not valid JSON: {e}") from None
        limits.check_json_depth(parsed)
        refuse_unsupported(parsed)
        return parsed


async def _sse(generation: Generation, builder, want_logprobs, include_usage: bool):
    def event(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async with contextlib.aclosing(generation.deltas()) as deltas:
        try:
            async for delta in deltas:
                builder.add(delta)
                yield event(builder.chunk(delta, want_logprobs))
        except Exception as e:  # the status line has gone out: report in the stream, then end it
            error = wire_error(e)
            yield event(error_body(error.message, error.type))
            return
    if include_usage:
        yield event(builder.usage_chunk())
    yield "data: [DONE]\n\n"


async def pagoda_status(pipeline: RequestPipeline) -> dict:
    """Deployments and their replicas (from Serve), every engine group with its ranks and where
    they run, plus one engine's statistics."""
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
            "engine": await pipeline.stats(), "model": (await pipeline.model()).name}


def build_fastapi_app(service: OpenAIService, cors_allowed_origins: list[str] = ()) -> FastAPI:
    """The HTTP routes of one replica. CORS is off unless origins are configured."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    from cluster.serve.errors import RequestNotFoundError

    app = FastAPI(title="Pagoda", description="OpenAI-compatible API of Pagoda")
    pipeline = service.pipeline

    # Errors that FastAPI and Starlette answer themselves (no such route, wrong method) are OpenAI
    # error JSON too, like every other error.
    @app.exception_handler(HTTPException)
    async def http_exception(_, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_exception(_, exc: RequestValidationError):
        return JSONResponse(error_body(str(exc.errors()[0].get("msg", "invalid request")), "invalid_request_error"),
                            status_code=422)

    # A refused key or an unknown request id is answered here (Starlette's handler for a class of
    # its own), not by the catch-all below, which Starlette re-raises after answering: Serve would
    # log a traceback for every request without a key.
    async def client_error(_, exc: Exception):
        return error_response(wire_error(exc))

    app.add_exception_handler(PermissionError, client_error)
    app.add_exception_handler(RequestNotFoundError, client_error)
    app.add_exception_handler(Exception, client_error)

    if cors_allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_allowed_origins),
                           allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id", TIMEOUT_HEADER])

    def tenant(authorization: str | None = Header(None)) -> str | None:
        """Every route but /health: the caller's tenant, from its key (401 without one)."""
        return pipeline.authenticate(authorization)

    def admin(authorization: str | None = Header(None)) -> str | None:
        """The cluster's internals (pids, node addresses): an admin's key (403 for a tenant's)."""
        return pipeline.authenticate_admin(authorization)

    @app.get("/health")
    async def health():
        return await service.health()

    @app.get("/v1/models", dependencies=[Depends(tenant)])
    async def models():
        return await service.models()

    @app.get("/v1/pagoda/stats", dependencies=[Depends(tenant)])
    async def stats():
        return await pipeline.stats()

    @app.get("/v1/pagoda/status", dependencies=[Depends(admin)])
    async def status():
        return await pagoda_status(pipeline)

    @app.get("/v1/pagoda/requests")
    async def running_requests(caller: str | None = Depends(tenant)):
        """The caller's tenant's running requests (ids scoped by tenant)."""
        return {"object": "list", "data": await pipeline.running_requests(caller)}

    @app.delete("/v1/pagoda/requests/{request_id}")
    async def cancel_request(request_id: str, caller: str | None = Depends(tenant)):
        """Stop one of the caller's tenant's requests: its stream ends with a `cancelled` error."""
        await pipeline.cancel(caller, request_id)
        return {"id": request_id, "object": "request", "cancelled": True}

    @app.post("/v1/completions")
    async def completions(raw: Request, caller: str | None = Depends(tenant)):
        return await service.completions(raw, caller)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request, caller: str | None = Depends(tenant)):
        return await service.chat_completions(raw, caller)

    return app
