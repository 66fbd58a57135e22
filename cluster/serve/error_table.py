"""The one error table of the serving front: an exception -> what each wire says of it (HTTP status
and OpenAI error type, gRPC status code, the message, the field it names, Retry-After). Both
adapters answer through `wire_error`; a client never sees a stack trace or a class name."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import grpc
from pydantic import ValidationError

from cluster.engine.errors import InvalidRequestError
from cluster.serve.circuit_breaker import CircuitOpenError
from cluster.serve.drain import ServerDrainingError
from cluster.serve.errors import (
    DuplicateRequestError,
    EngineOverloadedError,
    ModelNotFoundError,
    QuotaExceededError,
    RequestCancelledError,
    RequestFailedError,
    RequestNotFoundError,
    RequestTimeoutError,
    RequestTooLargeError,
    UnsupportedMediaTypeError,
    WorkerLostError,
)
from cluster.serve.tenants import ForbiddenError, UnauthenticatedError

logger = logging.getLogger("pagoda.errors")

DEFAULT_MESSAGES = {429: "overloaded; retry later", 504: "timed out"}


@dataclass(frozen=True, slots=True)
class WireError:
    status: int  # HTTP
    type: str  # OpenAI's error type
    code: grpc.StatusCode
    message: str
    param: str | None = None  # the request field at fault
    retry_after_s: float | None = None  # 429 and 503: when to try again
    openai_code: str | None = None  # OpenAI's `code` (e.g. model_not_found)

    def http_headers(self) -> dict | None:
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        if self.status in (429, 503):
            return {"Retry-After": str(math.ceil(self.retry_after_s or 1))}
        return None


@functools.cache
def _table() -> list[tuple[tuple[type, ...], int, str, grpc.StatusCode]]:
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
        ((RequestNotFoundError, ModelNotFoundError), 404, "not_found_error", codes.NOT_FOUND),
        ((RequestCancelledError,), 499, "cancelled", codes.CANCELLED),
        ((QuotaExceededError, EngineOverloadedError, BackPressureError), 429, "rate_limit_error", codes.RESOURCE_EXHAUSTED),
        ((RequestTimeoutError, TimeoutError), 504, "timeout_error", codes.DEADLINE_EXCEEDED),
        ((RequestFailedError,), 500, "internal_error", codes.INTERNAL),
        ((WorkerLostError, ServerDrainingError, CircuitOpenError), 503, "service_unavailable", codes.UNAVAILABLE),
    ]


def cause(exc: BaseException) -> BaseException:
    """The error itself: a RayTaskError carries the original as .cause."""
    return getattr(exc, "cause", None) or exc


def wire_error(exc: BaseException) -> WireError:
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    error = cause(exc)
    if isinstance(error, ValidationError):  # a request body that does not fit OpenAI's shapes
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        return WireError(400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT, f"{param}: {first['msg']}", param)
    for classes, status, kind, code in _table():
        if isinstance(error, classes):
            return WireError(status, kind, code, str(error) or DEFAULT_MESSAGES.get(status, kind),
                             getattr(error, "field", None), getattr(error, "retry_after_s", None),
                             getattr(error, "openai_code", None))
    if isinstance(error, (DeploymentUnavailableError, RayActorError)):
        return WireError(503, "service_unavailable", grpc.StatusCode.UNAVAILABLE,
                         "the model server is unavailable; retry later")
    logger.exception("internal error", exc_info=exc)
    return WireError(500, "internal_error", grpc.StatusCode.INTERNAL, "internal error")


def is_backend_failure(exc: BaseException) -> bool:
    """The backend's fault (what a circuit breaker counts), not the client's."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(cause(exc), (WorkerLostError, RequestFailedError, RequestTimeoutError, RayActorError,
                                   DeploymentUnavailableError))
