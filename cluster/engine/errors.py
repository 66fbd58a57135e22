"""Errors a caller can act on. The server maps InvalidRequestError to HTTP 400 / INVALID_ARGUMENT,
RequestFailedError to 500 / INTERNAL and WorkerLostError to 503 / UNAVAILABLE."""


class InvalidRequestError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # errors cross Ray processes: rebuild with both arguments
        return type(self), (self.field, self.message)


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its numbers went bad, or a step running it failed
    again and again); the requests beside it went on."""


class WorkerLostError(RuntimeError):
    """A worker process of the engine died: the engine cannot run again (the server replaces it);
    retry."""
