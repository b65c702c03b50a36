"""Domain errors. Servicers and the HTTP layer map these to gRPC codes / HTTP statuses in one place."""


class SpecDecError(Exception):
    """Base class of every error specdec raises on purpose."""


class InvalidRequestError(SpecDecError, ValueError):
    """The caller's input is wrong (bad parameter, prompt too long ...): INVALID_ARGUMENT / HTTP 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigError(SpecDecError, ValueError):
    """A configuration (speculative_config, flags) is invalid or incompatible."""


class ModelNotFoundError(SpecDecError, FileNotFoundError):
    """A model name could not be resolved to weights."""


class SequenceNotFoundError(SpecDecError, KeyError):
    """A service does not hold the sequence (restart, eviction): the caller resends the history."""

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0]) if self.args else "sequence not found"


class ResourceExhaustedError(SpecDecError):
    """A cache cap was reached: RESOURCE_EXHAUSTED / HTTP 429."""


class BackendUnavailableError(SpecDecError):
    """A draft or target service cannot be reached: UNAVAILABLE / HTTP 503."""
