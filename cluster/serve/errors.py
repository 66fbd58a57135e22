"""Errors the serving path maps to wire codes (HTTP status / gRPC status)."""

from cluster.engine.errors import InvalidRequestError, RequestFailedError, WorkerLostError  # noqa: F401 - re-exported


class EngineOverloadedError(RuntimeError):
    """More requests wait than the configured queue allows: retry later (429 / RESOURCE_EXHAUSTED)."""

    @classmethod
    def queue_full(cls, max_waiting: int) -> "EngineOverloadedError":
        # A classmethod, not __init__: the error crosses Ray pickled by its message.
        return cls(f"more than {max_waiting} requests are waiting; retry later")


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline and was stopped (504 / DEADLINE_EXCEEDED)."""


class RequestTooLargeError(ValueError):
    """The request is larger than the server accepts (413 / RESOURCE_EXHAUSTED)."""


class UnsupportedMediaTypeError(ValueError):
    """The HTTP body is not JSON (415)."""


class QuotaExceededError(RuntimeError):
    """A tenant's concurrency limit or compute-unit budget is used up (429 / RESOURCE_EXHAUSTED,
    with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # it crosses Ray (to Serve's proxy) pickled
        return type(self), (str(self), self.retry_after_s)


class DuplicateRequestError(ValueError):
    """The tenant already runs a request of this id (409 / ALREADY_EXISTS)."""

    field = "request_id"


class RequestCancelledError(RuntimeError):
    """The request's tenant cancelled it by id (499 / CANCELLED)."""


class RequestNotFoundError(LookupError):
    """No running request of the caller's tenant has this id (404 / NOT_FOUND)."""


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve (404 / NOT_FOUND, OpenAI's
    `model_not_found`)."""

    field = "model"
    openai_code = "model_not_found"
