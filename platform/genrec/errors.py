"""Errors genrec raises on purpose: each carries a message a user can act on."""


class GenrecError(Exception):
    """Base of every deliberate genrec error; `outcome`: how a request it ends is counted (engine.metrics)."""

    outcome = "error"


class ModelDirectoryError(GenrecError):
    """A model directory is missing a file, is not Qwen3, or holds invalid data."""

    def __init__(self, path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem

    def __reduce__(self):  # errors cross process boundaries (Ray): rebuild from the fields, not the message
        return type(self), (self.path, self.problem)


class CatalogError(ModelDirectoryError):
    """The item catalog does not validate."""


class InvalidRequestError(GenrecError, ValueError):
    """A request is well-formed but cannot be served (unknown item, prompt too long, ...)."""

    outcome = "invalid"

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self):
        return type(self), (self.field, self.problem)


class CacheError(GenrecError, ValueError):
    """Bad input to the embedding cache: IDs, vectors, a cache configuration or a bulk-load file."""


class StoreError(GenrecError):
    """A backing store cannot serve: unreachable, unreadable, or holding vectors of another width."""


class Overloaded(GenrecError):
    """The engine's queue is full: retry later (HTTP 503 with Retry-After)."""

    outcome = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeout(GenrecError, TimeoutError):
    """A request did not finish within its deadline; its resources were freed."""

    outcome = "timeout"


class EngineStopped(GenrecError):
    """The engine was shut down: requests it held were failed (or drained) and new ones are refused."""

    outcome = "stopped"
