"""Domain errors, and the one table that says how each one crosses gRPC and HTTP.

Every error specdec raises on purpose declares here, once: its gRPC status code (by name, so this
module needs no grpc), its HTTP status, and OpenAI's error ``type`` / ``code``. The servicers
(``specdec.serving.grpc_errors``), the gateway's gRPC clients (status code → domain error) and the
OpenAI layer all read these attributes; nothing else maps errors.
"""

from __future__ import annotations

from concurrent import futures


class SpecDecError(Exception):
    """Base class of every error specdec raises on purpose (unknown ones are INTERNAL / 500)."""

    grpc_code = "INTERNAL"
    http_status = 500
    openai_type = "internal_error"
    openai_code: str | None = "internal_error"

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class InvalidRequestError(SpecDecError, ValueError):
    """The caller's input is wrong (bad parameter, prompt too long ...); the message says what to fix."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    openai_type = "invalid_request_error"
    openai_code = None


class ConfigError(SpecDecError, ValueError):
    """A configuration (speculative_config, flags, a draft/target pair) is invalid or incompatible."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 400
    openai_type = "invalid_request_error"
    openai_code = "invalid_config"


class ModelNotFoundError(SpecDecError, FileNotFoundError):
    """A model name could not be resolved to weights, or a request names a model not served here."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    openai_type = "invalid_request_error"
    openai_code = "model_not_found"

    def __init__(self, message: str = "", param: str | None = "model"):
        super().__init__(message, param)

    def __str__(self) -> str:  # FileNotFoundError would format its args otherwise
        return str(self.args[0]) if self.args else "model not found"


class SequenceNotFoundError(SpecDecError, KeyError):
    """A service does not hold the sequence (restart, eviction): the caller resends the history.

    The gateway handles it by resending; it reaches an HTTP client only if the resend fails too."""

    grpc_code = "NOT_FOUND"
    http_status = 503
    openai_type = "service_unavailable"
    openai_code = "sequence_lost"

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0]) if self.args else "sequence not found"


class ResourceExhaustedError(SpecDecError):
    """A cap was reached (cached sequences, queue): retry later."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    openai_type = "rate_limit_error"
    openai_code = "resource_exhausted"


class SequencePreemptedError(SpecDecError):
    """The service's KV pool ran out mid-generation and this sequence was preempted: its blocks were freed.

    Nothing is lost: the caller waits a moment and resends the whole history (the service recomputes it,
    mostly from its prefix cache). The gateway handles it; it reaches an HTTP client only if that fails."""

    grpc_code = "ABORTED"
    http_status = 503
    openai_type = "service_unavailable"
    openai_code = "kv_cache_preempted"


class BackendUnavailableError(SpecDecError):
    """A draft or target service cannot be reached, or is still loading: retry later."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    openai_type = "service_unavailable"
    openai_code = "backend_unavailable"


class ModelLoadError(BackendUnavailableError):
    """The service's model failed to load: retrying will not help, the operator must act."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 503
    openai_type = "service_unavailable"
    openai_code = "model_load_failed"


class DeadlineExceededError(SpecDecError, TimeoutError):
    """The request's deadline passed before it finished."""

    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    openai_type = "timeout"
    openai_code = "deadline_exceeded"


class AuthenticationError(SpecDecError):
    """A missing or wrong API key."""

    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    openai_type = "invalid_request_error"
    openai_code = "invalid_api_key"


class ResponseNotFoundError(SpecDecError, LookupError):
    """A stored response (the Responses API's ``previous_response_id``, ``GET /v1/responses/{id}``) that
    this gateway does not hold for the caller: never stored, expired, evicted, or another key's."""

    grpc_code = "NOT_FOUND"
    http_status = 404
    openai_type = "invalid_request_error"
    openai_code = "response_not_found"


# Every domain error class, most specific first where a gRPC code is shared: the first class with a
# code is what a bare status code (no class named in the trailing metadata) turns back into.
DOMAIN_ERRORS: tuple[type[SpecDecError], ...] = (
    InvalidRequestError,
    SequenceNotFoundError,
    ModelNotFoundError,
    ResourceExhaustedError,
    SequencePreemptedError,
    BackendUnavailableError,
    ModelLoadError,  # a bare FAILED_PRECONDITION comes from a backend that cannot serve
    ConfigError,
    DeadlineExceededError,
    AuthenticationError,
    ResponseNotFoundError,
)
_BY_NAME = {cls.__name__: cls for cls in DOMAIN_ERRORS}
_ROWS = frozenset(DOMAIN_ERRORS)

# Exceptions from outside specdec that still have a meaning: a timeout is a deadline.
_FOREIGN = ((futures.TimeoutError, DeadlineExceededError), (TimeoutError, DeadlineExceededError))


def domain_class(exc: BaseException) -> type[SpecDecError]:
    """The table row of ``exc`` (SpecDecError itself: an internal error)."""
    for cls in type(exc).__mro__:  # the nearest class with a row (a subclass inherits its parent's)
        if cls in _ROWS:
            return cls
    for foreign, cls in _FOREIGN:
        if isinstance(exc, foreign):
            return cls
    return SpecDecError


def error_from_code(code_name: str, message: str, class_name: str | None = None) -> SpecDecError:
    """The domain error a gRPC status turns back into: the class the server named, else the first
    class with that code; an unknown code is an internal error."""
    cls = _BY_NAME.get(class_name or "")
    if cls is None or cls.grpc_code != code_name:
        cls = next((c for c in DOMAIN_ERRORS if c.grpc_code == code_name), SpecDecError)
    return cls(message)


def internal_error_message(exc: BaseException) -> str:
    """What a client learns of an unexpected exception: its type only. Its message may hold internals or
    a request's text, and its trace goes to the server log alone."""
    return f"internal error ({type(exc).__name__}); see the server log"


def public_message(exc: BaseException) -> str:
    """The message a client gets for ``exc``: a domain error's own message (written for the caller),
    or ``internal_error_message`` for anything else."""
    if not isinstance(exc, SpecDecError) and domain_class(exc) is SpecDecError:
        return internal_error_message(exc)
    return str(exc) or domain_class(exc).__name__


def openai_error_body(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI's error body) for any exception; internals are not disclosed."""
    cls = domain_class(exc)
    message = public_message(exc)
    param = getattr(exc, "param", None)
    return cls.http_status, {"error": {"message": message, "type": cls.openai_type, "param": param,
                                       "code": cls.openai_code}}
