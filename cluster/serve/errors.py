"""Errors the serving path maps to wire codes (HTTP status / gRPC status)."""


class EngineOverloadedError(RuntimeError):
    """More requests wait than the configured queue allows: retry later (429 / RESOURCE_EXHAUSTED)."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline and was stopped (504 / DEADLINE_EXCEEDED)."""


class RequestTooLargeError(ValueError):
    """The request is larger than the server accepts (413 / RESOURCE_EXHAUSTED)."""


class UnsupportedInputError(ValueError):
    """A well-formed input this server cannot handle yet, e.g. image parts (UNIMPLEMENTED / 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # errors cross Ray processes: rebuild with both arguments
        return type(self), (self.field, self.message)
