"""RequestPipeline: every request of the serving front, whatever its wire, takes this one path.

    adapter (gRPC | OpenAI HTTP): wire -> GenerateInputs
      -> admission: drain, this replica's queue bound (refused before the body is even parsed)
      -> limits (cluster/serve/limits.py), the model's name
      -> tokenize and check the prompt once (ServedModel; the engine trusts a CheckedPrompt)
      -> circuit breaker, the tenant's admission at the TenantLedger (may lower max_tokens)
      -> media to the EncoderServer (where there is one)
      -> LLMServer.generate: a RequestDelta stream, metered, watched for the tenant's cancel
    adapter: deltas -> wire

It knows no wire: the adapters (grpc_adapter.py, openai_adapter.py) turn their requests into
GenerateInputs and the deltas and errors (error_table.py) into their messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from cluster.engine.errors import InvalidRequestError
from cluster.engine.outputs import RequestDelta
from cluster.engine.sampling_params import SamplingParams
from cluster.serve.cancellations import CancellationWatch
from cluster.serve.circuit_breaker import CircuitBreaker, CircuitBreakerConfig
from cluster.serve.drain import DrainWatcher
from cluster.serve.error_table import is_backend_failure
from cluster.serve.errors import (
    DuplicateRequestError,
    EngineOverloadedError,
    ModelNotFoundError,
    QuotaExceededError,
    RequestCancelledError,
    RequestNotFoundError,
    RequestTooLargeError,
)
from cluster.serve.front_door import FrontDoorFlag
from cluster.serve.ledger import Admission, RequestMeter, RequestSize
from cluster.serve.limits import InputLimits
from cluster.serve.generation import GenerationRequest
from cluster.serve.served_model import ServedModel
from cluster.serve.tenants import ComputeUnitPrices, KeyRing, TenantsFile, bearer_key

logger = logging.getLogger("pagoda.ingress")

TIMEOUT_HEADER = "x-request-timeout-seconds"  # Serve's own, which its HTTP proxy enforces too
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
HEALTH_TIMEOUT_S = 1.0


@dataclasses.dataclass(slots=True)
class GenerateInputs:
    """A generation request as an adapter hands it over, in no wire's shapes."""

    prompt: str | list[int] | None
    messages: list[dict] | None
    params: SamplingParams
    request_id: str | None = None  # the client's (scoped by its tenant); None: a new one
    cache_salt: str | None = None
    timeout: str | None = None  # the client's deadline in seconds, as text; None: from the request's size
    model: str | None = None  # the model the client names; None: whichever is served
    template_tools: list[dict] | None = None  # for a chat template that reads `tools` itself


@dataclasses.dataclass(slots=True)
class Generation:
    """A request admitted and streaming: its first delta has arrived (errors before any output
    have raised already), the rest follow in `deltas`, counted by `meter`."""

    request_id: str
    params: SamplingParams  # as admitted (the tenant's limits may have lowered max_tokens)
    model: ServedModel
    meter: RequestMeter
    first: RequestDelta
    rest: AsyncIterator[RequestDelta]

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """Every delta, the first included; closing this closes the stream (the request ends)."""
        async with contextlib.aclosing(self.rest):
            yield self.first
            async for delta in self.rest:
                yield delta


class RequestPipeline:
    def __init__(self, llm, ledger, replica: str, *, model_name: str | None = None, limits: dict | None = None,
                 max_pending_requests: int = 256, front_door_dir: str | None = None, encoder_server=None,
                 tenants: TenantsFile | None = None, circuit_breaker: dict | None = None):
        self.llm = llm  # DeploymentHandle to LLMServer, or a LocalHandle to one in this process
        self.ledger = ledger  # the TenantLedger: admission, usage, cancellation by id (ledger.py)
        self.encoder_server = encoder_server  # media encoded there first; None: by the model server's engine
        self.replica = replica
        self.limits = InputLimits.model_validate(limits or {})
        self._model_name = model_name
        self._model: ServedModel | None = None
        self._model_lock = asyncio.Lock()
        self._keys = KeyRing(tenants.tenants) if tenants else None  # None: an open server
        self._prices = tenants.compute_units if tenants else ComputeUnitPrices()
        self._weights = {name: tenant.weight for name, tenant in tenants.tenants.items()} if tenants else {}
        breaker = CircuitBreakerConfig.model_validate(circuit_breaker or {})
        self.llm_breaker = CircuitBreaker("the model server", breaker)
        self.encoder_breaker = CircuitBreaker("the media encoder", breaker)
        self.cancellations = CancellationWatch(ledger, replica)
        self._reports: set[asyncio.Task] = set()  # requests' ends on their way to the ledger
        # Requests not yet streaming (being read, tokenized, queued in an engine): beyond the
        # bound, refused at once, before any work is spent on them.
        self.max_pending_requests = max_pending_requests
        self.num_pending_requests = 0
        # With `pagoda serve --front-door`, HAProxy refuses while this replica's queue is full.
        self._front_door = FrontDoorFlag(front_door_dir) if front_door_dir else None
        self.num_in_flight = 0  # requests being answered, streams included (what a drain waits for)
        self.drain = DrainWatcher(replica, lambda: self.num_in_flight)

    # ---- who asks ----------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant whose key the `Authorization` value holds (None on an open server);
        UnauthenticatedError without a valid one."""
        return None if self._keys is None else self._keys.tenant(bearer_key(authorization))

    def authenticate_admin(self, authorization: str | None) -> str | None:
        """As `authenticate`, for an admin's key (ForbiddenError for another tenant's)."""
        return None if self._keys is None else self._keys.admin(bearer_key(authorization))

    async def model(self) -> ServedModel:
        """What the model server serves, asked once; prompts are tokenized here, off its thread."""
        if self._model is None:
            async with self._model_lock:
                if self._model is None:
                    self._model = await ServedModel.load(self.llm, self.limits, self._model_name)
        return self._model

    def check_size(self, num_bytes: int) -> None:
        if num_bytes > self.limits.max_request_bytes:
            raise RequestTooLargeError(f"the request is {num_bytes} bytes; the cap is {self.limits.max_request_bytes} bytes")

    # ---- a generation ------------------------------------------------------------------------

    async def generate(self, tenant: str | None,
                       read: Callable[[ServedModel], Awaitable[GenerateInputs]]) -> Generation:
        """Admit a request, `read` its inputs from the wire (the model at hand: a chat's tools
        depend on its template), and start it. Work is refused in order of cost: the queue bound
        before the body is read, limits before tokenizing, the tenant's admission after."""
        self.num_in_flight += 1
        rest = None
        try:
            model = await self.model()
            with self._pending():
                request_id, params, meter, rest = await self._start(model, tenant, await read(model))
                # After a last delta the stream simply ends, so callers iterate the rest as is.
                first = await rest.__anext__()
        except BaseException:
            if rest is None:  # once started, the stream counts the request out itself (_metered)
                self.num_in_flight -= 1
            raise
        return Generation(request_id, params, model, meter, first, rest)

    @contextlib.contextmanager
    def _pending(self):
        """A place among this replica's pending requests until the first delta (or an error)."""
        self.drain.check_admission()
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

    async def _start(self, model: ServedModel, tenant: str | None, inputs: GenerateInputs):
        """Checks, tokenizes, admits and starts a request: (request id, params as admitted, its
        meter, its metered delta stream, not yet started)."""
        params = inputs.params
        if inputs.model and inputs.model not in (model.name, model.info["model_dir"]):
            raise ModelNotFoundError(f"the model {inputs.model!r} does not exist; this server serves {model.name!r}")
        request_id = checked_request_id(inputs.request_id)
        timeout_s = client_timeout(inputs.timeout)
        self.limits.check(params, inputs.messages)
        token_ids, media = await model.encode(inputs.prompt, inputs.messages, inputs.template_tools, params.max_tokens)
        size = RequestSize(len(token_ids), len(media), params.n, params.max_tokens)
        probe = self.llm_breaker.before_call()  # a failing model server: refused here, at once
        try:
            admission = await self.ledger.admit.remote(tenant, request_id, self.replica, size)
            refuse(admission)
        except BaseException:
            self.llm_breaker.forget(probe)
            raise
        meter = RequestMeter(self._prices, len(media), admission.units_limit)
        if admission.max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=admission.max_tokens)
        try:
            if media:
                model.media_metrics.record_items(media)
                if self.encoder_server is not None:
                    media = await self._encode(media)
            request = GenerationRequest(request_id, token_ids, params, timeout_s, media, tenant, inputs.cache_salt,
                                        self._weights.get(tenant, 1.0))
            # The deltas come over Serve's gRPC transport, by value, not as Ray objects: a message
            # then skips Ray's object machinery in both processes (docs/benchmarks-log.md: one served
            # stream's CPU a token on a 2-core node). The prefill's KV references, which must stay
            # Ray objects, never cross this handle.
            stream = self.llm.options(stream=True, _by_reference=False).generate.remote(request)
        except BaseException:
            self.llm_breaker.forget(probe)
            self._finish(tenant, request_id, meter, "error")
            raise
        return request_id, params, meter, self._metered(tenant, request_id, meter, stream, probe)

    async def _encode(self, media):
        probe = self.encoder_breaker.before_call()
        try:
            encoded = await self.encoder_server.encode.remote(media)
        except BaseException as e:
            self.encoder_breaker.record(probe, failed=is_backend_failure(e))
            raise
        self.encoder_breaker.record(probe, failed=False)
        return encoded

    async def _metered(self, tenant: str | None, request_id: str, meter: RequestMeter, stream, probe: bool):
        """The LLMServer's deltas, counted by the meter. A consumer that stops early (client
        gone, request cancelled) cancels the LLMServer call, which aborts the request there: Serve
        would too when the cancellation lands while we wait on the LLMServer, but not when it lands
        while a chunk is being written to the client. A cancellation by the tenant (through the
        ledger) cancels the call the same way and ends the stream with RequestCancelledError.
        At the end, whatever it was, the ledger charges what the meter counted, the model server's
        circuit breaker learns whether it failed (and how long the first token took), and the
        request stops counting as in flight."""
        key = (tenant or "", request_id)
        self.cancellations.add(key, stream)
        outcome, failure, started, first_token_s = "abandoned", None, time.monotonic(), None
        try:
            async for delta in stream:
                if first_token_s is None:
                    first_token_s = time.monotonic() - started
                meter.count(delta)
                yield delta
            outcome = "ok"
        except (Exception, asyncio.CancelledError) as e:
            if self.cancellations.was_cancelled(key):
                outcome = "cancelled"
                raise RequestCancelledError(f"request {request_id} was cancelled by its tenant") from None
            outcome, failure = ("error", e) if isinstance(e, Exception) else (outcome, None)
            raise
        finally:
            self.cancellations.remove(key)
            self.num_in_flight -= 1
            if outcome == "abandoned":
                stream.cancel()
            if outcome == "ok" or (failure is not None and is_backend_failure(failure)):
                self.llm_breaker.record(probe, failed=outcome != "ok", latency_s=first_token_s)
            else:
                self.llm_breaker.forget(probe)
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

    # ---- requests by id ----------------------------------------------------------------------

    async def running_requests(self, tenant: str | None) -> list[dict]:
        return await self.ledger.requests.remote(tenant)

    async def cancel(self, tenant: str | None, request_id: str) -> None:
        if not await self.ledger.cancel.remote(tenant, request_id):
            raise RequestNotFoundError(f"no running request of yours has id {request_id!r}")

    # ---- health and statistics ---------------------------------------------------------------

    async def serving(self) -> bool:
        """Not draining, and a model server replica itself says it serves: a cached answer would
        say healthy after it died. With none running, Serve holds the call until one is; the
        timeout turns that into no."""
        if self.drain.draining:
            return False
        try:
            return await asyncio.wait_for(self.llm.is_serving.remote(), timeout=HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - gone, restarting, timed out: all are "not serving"
            return False

    async def stats(self) -> dict:
        """One engine's statistics (and, where media is encoded by an EncoderServer, one of its
        replicas' encoder statistics under "encoder", as a colocated engine reports its own), and
        this replica's circuit breakers."""
        stats = await self.llm.stats.remote()
        stats["circuit_breakers"] = {"LLMServer": self.llm_breaker.describe()}
        if self.encoder_server is not None:
            stats["encoder"] = await self.encoder_server.stats.remote()
            stats["circuit_breakers"]["EncoderServer"] = self.encoder_breaker.describe()
        return stats

    def stop(self) -> None:
        self.cancellations.stop()
        if self._model is not None:
            self._model.close()


def refuse(admission: Admission) -> None:
    """Raise the error of a refused admission (nothing for an admitted one)."""
    if admission.refusal == "quota":
        raise QuotaExceededError(admission.reason, admission.retry_after_s)
    if admission.refusal == "too_large":
        raise InvalidRequestError("max_tokens", admission.reason)
    if admission.refusal == "duplicate":
        raise DuplicateRequestError(admission.reason)


def client_timeout(value: str | None) -> float | None:
    """The client's deadline in seconds (the `x-request-timeout-seconds` header); None: the server
    derives one from the request's size."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidRequestError(TIMEOUT_HEADER, "must be a number of seconds") from None
    if not 0 < seconds < math.inf:
        raise InvalidRequestError(TIMEOUT_HEADER, "must be a positive number of seconds")
    return seconds


def checked_request_id(value: str | None) -> str:
    """The client's id of a request (scoped by its tenant), or a new one."""
    if not value:
        return uuid.uuid4().hex
    if not REQUEST_ID.fullmatch(value):
        raise InvalidRequestError("request_id", "must be 1 to 128 characters of A-Z a-z 0-9 . _ : -")
    return value
