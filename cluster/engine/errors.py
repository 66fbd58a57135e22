"""Errors a caller can act on. The server maps InvalidRequestError to HTTP 400 / INVALID_ARGUMENT."""


class InvalidRequestError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # errors cross Ray processes: rebuild with both arguments
        return type(self), (self.field, self.message)
